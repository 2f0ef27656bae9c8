"""Suite `attention`: time and peak memory of attention against sequence length (lesson 16).

One causal prefill of L tokens through one attention layer shaped like the model's
(its query heads, key heads and head size; random q, k, v, since the kernels' cost does
not depend on the values), for each length L, computed three ways, alternating:

    naive   the full [H, L, L] score matrix (`minillm.speed.attention_kernels.naive_attention`)
    flash   tiles and the online softmax, in plain PyTorch (`flash_attention`)
    sdpa    PyTorch's fused kernel (what the model runs by default)

Peak memory is measured, not estimated: the bytes of every tensor the call allocates,
counted while they are alive (`PeakMemory`); it is the same on every machine, so one run
suffices. A fused kernel's private scratch buffers (SDPA's) are not tensors and are not
counted. FLOPs and bytes moved are computed from the shapes (`attention_cost`). A last
sweep times flash attention's tile size at one length: small tiles pay Python's overhead
per tile, large tiles hold more scores.

Everything runs on one thread. The flash loop is many small operations, and each one
that PyTorch splits across threads ends at a barrier; on a machine whose cores are
shared with other work a descheduled thread stalls every barrier, and we measured the
same flash call swing from 0.3 s to 14 s with two threads while one thread stayed
within 20%. One thread compares the kernels' work, not the neighbours' load.

On a GPU where triton is installed, the suite also times lesson 16's Triton kernel beside
SDPA (prefills), and flash-decoding beside both for one query over caches of up to 128k keys
(the "triton" section of the JSON; `triton_kernels`).

    python -m minillm.bench attention            # L = 256 .. 4096, about two minutes
    python -m minillm.bench attention --quick    # L = 64 .. 256
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm.auto import tqdm

from ..costmodel.probes import synchronize
from ..model.attention import AttentionStep, SDPABackend
from ..speed.attention_kernels import flash_attention, naive_attention
from .common import alternate, finish_figure, median, plot_title, spread_band

CONTENDERS = ("naive", "flash", "sdpa")
COLORS = {"naive": "tab:red", "flash": "tab:blue", "sdpa": "tab:gray"}
TILE = 128  # flash attention's query and key tile in the length sweep


class PeakMemory(TorchDispatchMode):
    """The most bytes held at once by tensors allocated inside the `with` block.

    Every operator's outputs are seen as they are made; a storage not seen before is
    counted until Python frees it (a finalizer on the storage). Views and in-place results
    share a storage and are counted once. Works on any device.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.tracked: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self.tracked.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self.tracked:
                    self.tracked.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def attention_cost(kind: str, T: int, S: int, H: int, KV: int, hd: int, block_q: int = TILE,
                   element: int = 4) -> dict:
    """FLOPs and bytes moved by a causal attention of T queries (the last T of S keys), by `kind`.

    FLOPs: 2 per multiply-add of q kᵀ and of p v, over the (query, key) pairs the kernel
    computes: naive computes all T·S and masks half; flash computes every tile that holds a
    visible pair, up to the last visible key (it clips the last tile there), so a little
    more than the causal half. Bytes, at the least: q, k, v read
    and the output written once; naive also writes the [H, T, S] scores, reads them for the
    softmax, writes the probabilities and reads them for p v; flash reads k and v again for
    every query tile (a tile of queries reuses each key tile for block_q rows: the reuse that
    makes it compute-bound).
    """
    io = 2 * H * T * hd * element  # q read, output written
    if kind == "naive":
        pairs = T * S
        moved = io + 2 * KV * S * hd * element + 4 * H * T * S * element
    elif kind == "flash":
        visible_keys = [S - T + min(q0 + block_q, T) for q0 in range(0, T, block_q)]  # per query tile
        pairs = sum(min(block_q, T - q0) * keys for q0, keys in zip(range(0, T, block_q), visible_keys))
        moved = io + sum(2 * KV * keys * hd * element for keys in visible_keys)
    else:
        raise ValueError(f"no cost model for {kind!r}: use naive or flash")
    return {"flops": 4 * pairs * hd * H, "bytes": moved}


def kernels(block_q: int = TILE, block_k: int = TILE) -> dict:
    """name -> f(q, k, v) -> out, each causal with the queries last."""
    sdpa = SDPABackend()
    return {"naive": lambda q, k, v: naive_attention(q, k, v)[0],
            "flash": lambda q, k, v: flash_attention(q, k, v, block_q=block_q, block_k=block_k)[0],
            "sdpa": lambda q, k, v: sdpa(q, k, v, AttentionStep(torch.zeros(1, q.shape[2], dtype=torch.long)))}


def timed(fn, device):
    """A no-argument function for `alternate`: runs fn, returns its seconds."""
    def call():
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start
    return call


def peak_bytes(fn) -> int:
    with torch.inference_mode(), PeakMemory() as memory:
        fn()
    return memory.peak


def run(args) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring
    try:
        return measure(args)
    finally:
        torch.set_num_threads(threads)


def measure(args) -> dict:
    from ..speed.load import load_model

    lengths = [64, 128, 256] if args.quick else [256, 512, 1024, 2048, 4096]
    sweep_length = lengths[-2]
    tiles = [16, 32, 64, 128, 256]
    repeats = args.repeats
    config = load_model(args.model, dtype="float32", device=args.device)[0].config
    H, KV, hd = config.n_head, config.kv_heads, config.head_size
    gen = torch.Generator().manual_seed(0)

    def qkv(L):
        return (torch.randn(1, H, L, hd, generator=gen).to(args.device),
                torch.randn(1, KV, L, hd, generator=gen).to(args.device),
                torch.randn(1, KV, L, hd, generator=gen).to(args.device))

    rows = []
    with torch.inference_mode():
        for L in tqdm(lengths, desc="attention", unit="length"):
            q, k, v = qkv(L)
            calls = {name: (lambda f=f: f(q, k, v)) for name, f in kernels().items()}
            reference = calls["sdpa"]()
            error = {name: float((calls[name]() - reference).abs().max()) for name in ("naive", "flash")}
            times = alternate({name: timed(call, args.device) for name, call in calls.items()}, repeats=repeats)
            row = {"length": L, "ms": {name: 1000 * median(t) for name, t in times.items()},
                   "ms_per_repeat": {name: [1000 * s for s in t] for name, t in times.items()},
                   "peak_mib": {name: peak_bytes(call) / 2**20 for name, call in calls.items()},
                   "max_abs_error_vs_sdpa": error,
                   "cost": {name: attention_cost(name, L, L, H, KV, hd) for name in ("naive", "flash")}}
            rows.append(row)
            tqdm.write(f"L={L:5d}: " + ", ".join(f"{n} {row['ms'][n]:.1f} ms / {row['peak_mib'][n]:.1f} MiB"
                                                 for n in CONTENDERS))
        q, k, v = qkv(sweep_length)
        sweep_calls = {tile: (lambda tile=tile: kernels(tile, tile)["flash"](q, k, v)) for tile in tiles}
        sweep_times = alternate({str(tile): timed(call, args.device) for tile, call in sweep_calls.items()},
                                repeats=repeats, desc="flash tile sizes")
        sweep = [{"tile": tile, "ms": 1000 * median(sweep_times[str(tile)]),
                  "ms_per_repeat": [1000 * s for s in sweep_times[str(tile)]],
                  "peak_mib": peak_bytes(call) / 2**20} for tile, call in sweep_calls.items()]
        triton = triton_kernels(H, KV, hd, args.device, repeats, args.quick)
    return {"model": args.model, "quick": args.quick, "dtype": "float32", "repeats": repeats,
            "heads": H, "kv_heads": KV, "head_dim": hd, "batch": 1, "tile": TILE, "threads": 1, "rows": rows,
            "sweep": {"length": sweep_length, "tiles": sweep}, **({"triton": triton} if triton else {})}


def triton_kernels(H: int, KV: int, hd: int, device, repeats: int, quick: bool) -> dict | None:
    """On a GPU where triton imports: lesson 16's Triton kernel beside SDPA over causal prefills, and for one
    query over a long cache (a decode step's attention) beside flash-decoding, which also splits the keys
    (`minillm.speed.attention_triton`); each call's largest difference from SDPA. None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from ..speed.attention_triton import triton_flash_attention, triton_flash_decode
    except ImportError:
        return None
    sdpa, gen, measured = SDPABackend(), torch.Generator().manual_seed(1), {}
    shapes = {"prefill": [(L, L) for L in ((256, 1024) if quick else (256, 1024, 4096))],
              "decode": [(1, S) for S in ((1024, 8192) if quick else (1024, 8192, 32768, 131072))]}
    for kind, sizes in shapes.items():
        measured[kind] = []
        for T, S in sizes:
            q = torch.randn(1, H, T, hd, generator=gen).to(device)
            k, v = (torch.randn(1, KV, S, hd, generator=gen).to(device) for _ in range(2))
            step = AttentionStep(torch.zeros(1, T, dtype=torch.long, device=device))
            calls = {"sdpa": lambda: sdpa(q, k, v, step), "triton flash": lambda: triton_flash_attention(q, k, v)[0]}
            if kind == "decode":
                calls["triton flash-decoding"] = lambda: triton_flash_decode(q, k, v)[0]
            reference = calls["sdpa"]()
            times = alternate({name: timed(call, device) for name, call in calls.items()}, repeats=repeats,
                              warmup=1, desc=f"triton {kind} {S}")
            row = {"queries": T, "keys": S, "ms": {name: 1000 * median(t) for name, t in times.items()},
                   "ms_per_repeat": {name: [1000 * x for x in t] for name, t in times.items()},
                   "max_abs_error_vs_sdpa": {name: float((call() - reference).abs().max())
                                             for name, call in calls.items() if name != "sdpa"}}
            measured[kind].append(row)
            tqdm.write(f"triton {kind} {T}x{S}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in row["ms"].items()))
    return measured


def plot(data: dict, path=None):
    """Three panels: time and peak memory against length (log-log), and flash attention's tile sweep."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    lengths = [row["length"] for row in rows]
    fig, (ax_time, ax_memory, ax_tile) = plt.subplots(1, 3, figsize=(15, 4.4))
    for name in CONTENDERS:
        ax_time.plot(lengths, [row["ms"][name] for row in rows], "o-", color=COLORS[name], label=name)
        spread_band(ax_time, lengths, [row["ms_per_repeat"][name] for row in rows], COLORS[name])
        ax_memory.plot(lengths, [row["peak_mib"][name] for row in rows], "o-", color=COLORS[name], label=name)
    ax_time.set(ylabel="ms per causal prefill (log scale)", title="time: slope 2 on log-log = quadratic")
    ax_memory.set(ylabel="peak MiB of tensors allocated (log scale)",
                  title="memory: naive holds every score, flash one tile")
    for ax in (ax_time, ax_memory):
        ax.set(xlabel="sequence length L (tokens)", xscale="log", yscale="log")
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.minorticks_off()
    sweep = data["sweep"]
    tiles = [entry["tile"] for entry in sweep["tiles"]]
    ax_tile.plot(tiles, [entry["ms"] for entry in sweep["tiles"]], "o-", color=COLORS["flash"], label="time")
    spread_band(ax_tile, tiles, [entry["ms_per_repeat"] for entry in sweep["tiles"]], COLORS["flash"])
    ax_tile.set(xlabel="flash tile size (block_q = block_k)", ylabel="ms per causal prefill", xscale="log",
                title=f"flash attention's tile size at L = {sweep['length']}", ylim=(0, None))
    ax_tile.set_xticks(tiles, [str(t) for t in tiles])
    ax_tile.minorticks_off()
    ax_peak = ax_tile.twinx()
    ax_peak.plot(tiles, [entry["peak_mib"] for entry in sweep["tiles"]], "s--", color="tab:orange", label="peak MiB")
    ax_peak.set(ylabel="peak MiB", ylim=(0, None))
    handles = ax_tile.get_legend_handles_labels()[0] + ax_peak.get_legend_handles_labels()[0]
    ax_tile.legend(handles=handles, fontsize=8)
    for ax in (ax_time, ax_memory, ax_tile):
        ax.grid(alpha=0.3, which="both")
    ax_time.legend(fontsize=8)
    ax_memory.legend(fontsize=8)
    subject = (f"Attention kernels, one layer ({data['heads']} query heads, {data['kv_heads']} key heads, head size "
               f"{data['head_dim']}, flash tiles {data['tile']}, {data['threads']} thread)")
    fig.suptitle(plot_title(subject, data, data["dtype"]) + f"; median of {data['repeats']}, bands: min-max",
                 fontsize=10)
    return finish_figure(fig, path)
