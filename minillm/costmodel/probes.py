"""The machine's four constants, each from one small probe, and a counter of the ops a real step dispatches.

The cost model (`model.py`) needs read bandwidth, peak arithmetic, the cost of one eager op and of one
host sync. Each is measured here by a probe that times something other than the step it will predict
(a `torch.sum` over a GiB, a 512-cube matmul, an in-place add of 64 numbers, an `.item()`), so a
prediction made from them is made before, and independently of, the measurement it is compared with.
`count_ops` checks the model's op counts against what PyTorch really dispatches.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..speed.huge_pages import into_huge_pages
from ..speed.onednn import use_onednn
from .model import Machine, matmul_flops


def synchronize(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def bandwidth_probe(gib: float = 1.0, passes: int = 3, device: str = "cpu"):
    """A run for `alternate`: the seconds of the fastest of `passes` torch.sum calls over `gib` GiB.

    Read bandwidth is `probe.bytes / seconds`. Sampled between the contenders of one
    alternating run, it is the bandwidth the memory system offered while they ran: on a
    shared VM that drifts with the neighbours' load (we saw 35-69 GB/s), and a roofline
    measured at another moment would credit or blame the contenders for the drift.
    On a CPU the tensor sits in huge pages, where `load_model` places the weights
    (`minillm.speed.huge_pages`): the ceiling is measured on the pages they are read from.
    """
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    if x.device.type == "cpu":
        x = into_huge_pages([x])[0]

    def run() -> float:
        times = []
        for _ in range(passes):
            synchronize(device)
            t = time.perf_counter()
            x.sum()
            synchronize(device)
            times.append(time.perf_counter() - t)
        return min(times)
    run.bytes = x.numel() * 4
    return run


def measure_memory_bandwidth(gib: float = 1.0, repeats: int = 10, device: str = "cpu") -> float:
    """Peak read bandwidth in bytes/s: the fastest of `repeats` torch.sum calls over `gib` GiB.

    A roofline asks what the memory system can deliver at best, so this takes the
    fastest pass rather than the median: on a shared VM the median swings with the
    neighbours' load, while the best pass is steadier (`bandwidth_probe` samples it
    during a run instead).
    """
    probe = bandwidth_probe(gib, repeats + 1, device)  # the first pass faults the pages in; the minimum skips it
    return probe.bytes / probe()


class OpCounter(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher inside the `with` block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> Counter:
    """The aten ops `fn()` dispatches, by name (a Counter; `.total()` is the step's op count)."""
    with OpCounter() as counter:
        fn()
    return counter.ops


def fastest(fn, bursts: int, repeat: int = 1) -> float:
    """Seconds of one call: the fastest of `bursts` bursts of `repeat` calls.

    On a shared machine most bursts are slowed by neighbours; a short burst that ran
    undisturbed is what the hardware can do, so the minimum is the estimate.
    """
    best = math.inf
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def measure_peak_flops(n: int = 512, bursts: int = 30, dtype=torch.float32) -> float:
    """flop/s of an n x n x n matmul, the most arithmetic-dense kernel the machine runs."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return matmul_flops(n, n, n) / fastest(lambda: a @ b, bursts)


def measure_op_seconds(bursts: int = 50, repeat: int = 100) -> float:
    """One eager op on a tiny tensor (an in-place add of 64 numbers): nearly all of it is dispatch."""
    x = torch.ones(64)
    return fastest(lambda: x.add_(1.0), bursts, repeat)


def measure_sync_seconds(bursts: int = 50, repeat: int = 100, device: str = "cpu") -> float:
    """Reading one number back to Python (`.item()`); on a GPU this waits for the queue to drain."""
    x = torch.ones((), device=device)
    return fastest(lambda: x.item(), bursts, repeat)


LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)  # rows a step multiplies: one token, a verify, a batch, a prefill
LINEAR_SHAPE = (1024, 1024)  # a generic transformer-sized weight matrix (not any model's own)


def measure_linear_rates(dtype=torch.float32, rows=LINEAR_ROWS, bursts: int = 3,
                         gib: float = 0.25) -> tuple[tuple[int, float], ...]:
    """The matrix library's speed at a few rows: ((rows, seconds per weight byte), ...) for linear layers of
    generic 1024 x 1024 weights in `dtype`, placed in huge pages and multiplied the way `load_model` sets a
    model up (float32 on a CPU through oneDNN's packed weights, or MKL's where it streams better,
    `minillm.speed.onednn`; other dtypes through plain `F.linear`).

    Up to a few rows the weights are read from memory (`gib` of distinct matrices, past any cache), and the
    time per byte says how near the library's matrix-vector kernel comes to the bandwidth probe; at many rows
    the same matrices are multiplied from cache and the time per byte says how near it comes to peak arithmetic.
    """
    out_features, in_features = LINEAR_SHAPE
    one = out_features * in_features * torch.empty((), dtype=dtype).element_size()
    weights = into_huge_pages([torch.randn(LINEAR_SHAPE).to(dtype) for _ in range(max(1, int(gib * 2**30) // one))])
    layers = nn.ModuleList(nn.Linear(in_features, out_features, bias=False, dtype=dtype) for _ in weights)
    for layer, weight in zip(layers, weights):
        layer.weight = nn.Parameter(weight, requires_grad=False)
    if dtype == torch.float32:
        use_onednn(layers)
    curve = []
    with torch.inference_mode():
        for n in rows:
            used = layers[:max(1, min(len(layers), int(2e9 // matmul_flops(n, in_features, out_features))))]
            x = torch.randn(n, in_features).to(dtype)

            def run(used=used, x=x):
                for layer in used:
                    layer(x)

            run()  # warm-up: the library picks its kernel and packs its weights, the pages are touched
            curve.append((n, fastest(run, bursts) / (len(used) * one)))
    return tuple(curve)


def measure_machine(quick: bool = False) -> Machine:
    """All the constants, measured now (a few seconds with quick=True): the four scalars, and the library's
    matrix curve in float32 and bfloat16."""
    linear = {name: measure_linear_rates(dtype, bursts=2 if quick else 3, gib=0.0625 if quick else 0.25)
              for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    return Machine(bandwidth=measure_memory_bandwidth(gib=0.25 if quick else 1.0, repeats=5 if quick else 10),
                   peak_flops=measure_peak_flops(bursts=10 if quick else 30),
                   op_seconds=measure_op_seconds(bursts=20 if quick else 50),
                   sync_seconds=measure_sync_seconds(bursts=20 if quick else 50), linear=linear)
