"""The machine's constants, each from one small probe, and a counter of the ops a real step dispatches.

The cost model (`model.py`) needs read bandwidth, peak arithmetic, the cost of one eager op and of one
host sync, and the speed of the kernels a step spends most of its time in: the matrix library's products
of the model's shapes at a few rows and its attention calls over a cache (an eager step), and the kernels
a compiled graph runs for each weight format (a compiled step). Each is measured here by a probe that
times something other than the step it will predict (a `torch.sum` over a GiB, a 512-cube matmul, an
`.item()`, a decode step of the same model at a width where nothing is computed, random matrices of the
model's shapes, attention calls on random keys, a compiled graph of random matrices), so a prediction
made from them is made before, and independently of, the measurement it is compared with. `count_ops`
checks the model's op counts against what PyTorch really dispatches.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..model.attention import causal_mask_lower_right
from ..model.config import ModelConfig
from ..speed.cuda_graph import recorded
from ..speed.huge_pages import into_huge_pages
from ..speed.onednn import use_onednn
from .model import SMOLLM2_135M, Machine, block_matrix_shapes, head_shape, matmul_flops


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


def dispatch_model_config(config: ModelConfig) -> ModelConfig:
    """`config`'s layers, heads and switches at a width where the arithmetic is nil: 8 numbers per head, an MLP
    of 64 and a vocabulary of 256. Its eager step dispatches the same ops, through the same Python, as the
    full model's, and multiplies almost nothing."""
    return replace(config, d_model=8 * config.n_head, head_dim=None, d_ff=64, vocab_size=256, d_embed=None,
                   context_length=min(config.context_length, 512),
                   rotary_dim=None if config.rotary_dim is None else 4)


def measure_op_seconds(config: ModelConfig = SMOLLM2_135M, bursts: int = 20, repeat: int = 5,
                       context: int = 64) -> float:
    """One eager op as the model's own code dispatches it: a one-token decode step of `dispatch_model_config`
    (random weights, a static cache holding `context` tokens, through the `ModelRunner`) divided by the ops the
    step dispatches. What that step costs is the Python of the modules, the dispatch and the small allocations
    of every op, with nothing to compute: an in-place add of a few numbers, the cheapest op, costs half as much
    (lessons/cost-model/README.md), and an eager step's other ops (norm statistics, casts, views, a
    concatenation, the cache's copies) sit between its matrix products in the Python that calls them."""
    from ..decoding.sampling import SamplingConfig
    from ..model.transformer import Transformer
    from ..runtime.runner import ModelRunner
    from ..runtime.sequence import Sequence

    small = dispatch_model_config(config)
    torch.manual_seed(0)
    model = Transformer(small).eval()
    runner = ModelRunner(model, cache="static", max_len=context + 2)
    seq = Sequence.create(list(range(context - 1)), SamplingConfig(max_new_tokens=2), vocab_size=small.vocab_size,
                          device="cpu")
    with torch.inference_mode():
        runner.prefill([seq])
        seq.append(1)

        def step():
            runner.decode([seq])
            runner.rollback([seq])

        step()
        ops = count_ops(lambda: runner.decode([seq])).total()
        runner.rollback([seq])
        return fastest(step, bursts, repeat) / ops


def measure_sync_seconds(bursts: int = 50, repeat: int = 100, device: str = "cpu") -> float:
    """Reading one number back to Python (`.item()`); on a GPU this waits for the queue to drain."""
    x = torch.ones((), device=device)
    return fastest(lambda: x.item(), bursts, repeat)


def measure_graph_kernel_seconds(kernels: int = 256, bursts: int = 20, device: str = "cuda") -> float:
    """What one kernel costs inside a CUDA graph when it does nothing: `kernels` one-element adds recorded as one
    graph, the fastest replay over the count. The floor under every kernel of a captured step (its launch and
    the gap before the next), which no fusion of work inside a kernel removes; only fewer kernels do."""
    x = torch.zeros(1, device=device)

    def adds():
        for _ in range(kernels):
            x.add_(1)
    graph, _ = recorded(adds, warmup=1)

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    return fastest(replay, bursts) / kernels


ALLREDUCE_BYTES = (256, 2304, 2**14, 2**17, 2**20)  # one row of a small and of the default model, to a batch's


def allreduce_rank(group, sizes: tuple[int, ...], bursts: int, repeat: int, out: str) -> None:
    """One rank of `measure_allreduce_seconds`: every rank times the same all-reduces; rank 0 writes the fastest
    burst's mean per size (as `fastest` does) to `out`."""
    import json

    import torch.distributed as dist

    seconds = {}
    for size in sizes:
        x = torch.zeros(size // 4)
        dist.all_reduce(x)  # the connections' first use
        best = math.inf
        for _ in range(bursts):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                dist.all_reduce(x)
            best = min(best, (time.perf_counter() - start) / repeat)
        seconds[size] = best
    if group.leader:
        with open(out, "w") as file:
            json.dump(seconds, file)


def measure_allreduce_seconds(ranks: int, sizes=ALLREDUCE_BYTES, bursts: int = 5,
                              repeat: int = 50) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) of one gloo all-reduce among `ranks` fresh processes on this machine, for each size: the
    latency a tensor-parallel step pays in every collective (lesson 20). Each rank computes with its share of the
    cores, as a sharded command's do."""
    import json
    import tempfile

    from ..parallel.launch import spawn_ranks

    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/allreduce.json"
        spawn_ranks(ranks, allreduce_rank, tuple(sizes), bursts, repeat, out, timeout=120)
        with open(out) as file:
            return tuple((int(size), seconds) for size, seconds in json.load(file).items())


LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)  # rows a step multiplies: one token, a verify, a batch, a prefill
HEAD_ROWS = (1, 2, 4, 8, 16, 32)  # rows the LM head multiplies: the positions whose logits a step keeps
ATTENTION_KEYS = (64, 256, 1024)  # cached keys an attention call reads: a short chat to a long document
ATTENTION_BATCHES = (1, 2, 4, 8, 16, 32)  # one new token per row: a decode step
ATTENTION_QUERIES = (2, 4, 8, 16)  # new tokens of one row: a verify of drafted tokens


def measure_linear_rates(dtype=torch.float32, shapes=tuple(block_matrix_shapes(SMOLLM2_135M)), rows=LINEAR_ROWS,
                         bursts: int = 3, gib: float = 0.25) -> tuple[tuple[int, float], ...]:
    """The matrix library's speed at a few rows: ((rows, seconds per weight byte), ...) for linear layers of
    random weights of the (out, in) `shapes` in `dtype` (a model's own: how near a library kernel comes to the
    bandwidth depends on the matrix's shape), placed in huge pages and multiplied the way `load_model` sets a
    model up (float32 on a CPU through oneDNN's packed weights, or MKL's where it streams better,
    `minillm.speed.onednn`; other dtypes through plain `F.linear`).

    The shapes repeat, in order, until they hold `gib` (at least one of each). Up to a few rows the weights are
    read from memory (distinct matrices, past any cache), and the time per byte says how near the library's
    matrix-vector kernel comes to the bandwidth probe; at many rows the first few matrices are multiplied from
    cache and the time per byte says how near it comes to peak arithmetic.
    """
    size = torch.empty((), dtype=dtype).element_size()
    one_of_each = sum(out * inp for out, inp in shapes) * size
    copies = max(1, round(gib * 2**30 / one_of_each))
    layer_shapes = [shape for _ in range(copies) for shape in shapes]
    weights = into_huge_pages([torch.randn(shape).to(dtype) for shape in layer_shapes])
    layers = nn.ModuleList(nn.Linear(inp, out, bias=False, dtype=dtype) for out, inp in layer_shapes)
    for layer, weight in zip(layers, weights):
        layer.weight = nn.Parameter(weight, requires_grad=False)
    if dtype == torch.float32:
        use_onednn(layers)
    curve = []
    with torch.inference_mode():
        for n in rows:
            used, flops = [], 0
            for layer in layers:  # past 2 GFLOP per pass, the first matrices are enough to time the arithmetic
                if used and flops > 2e9:
                    break
                used.append(layer)
                flops += matmul_flops(n, layer.in_features, layer.out_features)
            inputs = {inp: torch.randn(n, inp).to(dtype) for _, inp in shapes}

            def run(used=used, inputs=inputs):
                for layer in used:
                    layer(inputs[layer.in_features])

            run()  # warm-up: the library picks its kernel and packs its weights, the pages are touched
            curve.append((n, fastest(run, bursts) / (sum(layer.weight.numel() for layer in used) * size)))
    return tuple(curve)


def measure_attention_seconds(config: ModelConfig = SMOLLM2_135M, bursts: int = 10,
                              cache_bytes: float = 2**28) -> dict[tuple[int, int], tuple[tuple[int, float], ...]]:
    """{(batch, queries): ((keys, seconds per call), ...)}: one layer's `scaled_dot_product_attention` on random
    queries, keys and values of the model's head layout, called as `model.attention.SDPABackend` calls it after
    a cache: the query heads that share a key/value head folded into one group of queries, a mask when a row
    brings more than one new token. Each timed burst calls it once per layer on that layer's own keys and
    values (up to `cache_bytes` of them), so they come from memory as a step's do, not from the last call's
    cache. On a CPU this kernel costs far more per call than the bytes of the keys it reads (tiles, softmax,
    threads), so the cost model prices an eager step's attention by these calls."""
    kv, hd = config.kv_heads, config.head_size
    group = config.n_head // kv
    calls = {}
    with torch.inference_mode():
        for batch, queries in [(b, 1) for b in ATTENTION_BATCHES] + [(1, q) for q in ATTENTION_QUERIES]:
            curve = []
            for keys in ATTENTION_KEYS:
                layers = max(1, min(config.n_layer, int(cache_bytes // (2 * batch * kv * keys * hd * 4))))
                q = torch.randn(batch, kv, group * queries, hd)
                cache = [(torch.randn(batch, kv, keys, hd), torch.randn(batch, kv, keys, hd)) for _ in range(layers)]
                mask = causal_mask_lower_right(queries, keys, "cpu").repeat(group, 1) if queries > 1 else None

                def step(q=q, cache=cache, mask=mask):
                    for k, v in cache:
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

                step()
                curve.append((keys, fastest(step, bursts) / layers))
            calls[(batch, queries)] = tuple(curve)
    return calls


COMPILED_FORMATS = ("float32", "bfloat16", "int8", "int4")  # a compiled step's weights: plain, or as --quant holds them


class LinearsProbe(nn.Module):
    """Linear layers called one after another on one input per width: what a compiled probe traces."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.widths = sorted({layer.in_features for layer in layers})

    @property
    def device(self) -> torch.device:  # what `speed.inductor.matmul_kernels` asks of a model
        return torch.device("cpu")

    def forward(self, *inputs):
        by_width = dict(zip(self.widths, inputs))
        return tuple(layer(by_width[layer.in_features]) for layer in self.layers)


def probe_layers(fmt: str, shapes, copies: int) -> list[nn.Module]:
    """Random linear layers of the (out, in) `shapes`, `copies` times, as a run with these weights holds them:
    float32 or bfloat16 `nn.Linear`, or int8 per channel / int4 in groups of 32 (computing in bfloat16)."""
    from ..speed.quant import Int4WeightLinear, Int8WeightLinear

    layers = [nn.Linear(inp, out, bias=False) for _ in range(copies) for out, inp in shapes]
    if fmt == "int8":
        return [Int8WeightLinear.from_linear(layer) for layer in layers]
    if fmt == "int4":
        return [Int4WeightLinear.from_linear(layer, 32) for layer in layers]
    return [layer.to(getattr(torch, fmt)).requires_grad_(False) for layer in layers]


def measure_compiled_rates(shapes=tuple(block_matrix_shapes(SMOLLM2_135M)), formats=COMPILED_FORMATS,
                           copies: int = 8, bursts: int = 20, flush_bytes: int = 2**27) -> dict:
    """{f"{format} compiled": ((1, seconds per weight byte),)}: one row through the matmul kernels a compiled
    graph runs for weights of `shapes` in each format, compiled the way the course compiles a decode step
    (`speed.inductor`: frozen weights, the kernels `matmul_kernels` picks for one row on this CPU).

    A compiled step does not call the library an eager step calls: Inductor generates a kernel for each
    weight's shape (or keeps the library's where it has none, as for int4 without AVX-512), and how near that
    comes to the bandwidth differs by format and CPU. Each timed call follows a read of `flush_bytes`, which
    evicts the weights from the caches, so they come from memory as a step's do; `copies` of the shapes make
    the call long enough to stream at its steady speed (two copies measured 30% slower per byte than eight
    on the AMD EPYC, whose eight came within 5% of a whole compiled decode step's weight rate).
    """
    from ..speed.inductor import inductor_settings, matmul_kernels
    from ..speed.quantize_model import weight_bytes as model_weight_bytes

    flush = torch.ones(flush_bytes // 4)
    rates = {}
    for fmt in formats:
        probe = LinearsProbe(probe_layers(fmt, shapes, copies)).eval()
        dtype = torch.float32 if fmt == "float32" else torch.bfloat16
        inputs = [torch.randn(1, width).to(dtype) for width in probe.widths]
        weight_bytes = model_weight_bytes(probe)
        with torch.no_grad():
            with inductor_settings(matmul_kernels(probe, rows=1), "cpu"):
                compiled = torch.compile(probe, fullgraph=True, dynamic=False)
                compiled(*inputs)
            best = math.inf
            for _ in range(bursts):
                flush.sum()
                start = time.perf_counter()
                compiled(*inputs)
                best = min(best, time.perf_counter() - start)
        rates[f"{fmt} compiled"] = ((1, best / weight_bytes),)
    return rates


def measure_machine(quick: bool = False, config: ModelConfig = SMOLLM2_135M) -> Machine:
    """All the constants, measured now: the four scalars, the library's matrix curves in float32 and bfloat16
    for `config`'s block matrices and its LM head, its attention calls, and (unless `quick`: about a minute of
    compiling) the compiled kernels' speed at one row for each weight format. With quick=True, some ten seconds,
    a compiled step is priced by the roofline."""
    bursts, gib = (2, 0.0625) if quick else (5, 0.25)
    linear = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        linear[name] = measure_linear_rates(dtype, tuple(block_matrix_shapes(config)), bursts=bursts, gib=gib)
        linear[f"{name} head"] = measure_linear_rates(dtype, (head_shape(config),), HEAD_ROWS, bursts=bursts, gib=0)
    if not quick:
        linear.update(measure_compiled_rates(tuple(block_matrix_shapes(config))))
    return Machine(bandwidth=measure_memory_bandwidth(gib=0.25 if quick else 1.0, repeats=5 if quick else 10),
                   peak_flops=measure_peak_flops(bursts=10 if quick else 30),
                   op_seconds=measure_op_seconds(config, bursts=20 if quick else 50),
                   sync_seconds=measure_sync_seconds(bursts=20 if quick else 50), linear=linear,
                   attention=measure_attention_seconds(config, bursts=3 if quick else 10,
                                                            cache_bytes=2**26 if quick else 2**28))
