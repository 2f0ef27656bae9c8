"""Suite `cache-scaling`: what one more token costs as the sequence grows (lesson 06).

Without a cache, token t+1 needs a forward over all t tokens: the per-token cost
grows with length and the total cost of a generation grows quadratically. With a
cache it is one token's forward plus attention over t stored keys: at these
lengths the weights dominate, so the per-token cost stays nearly flat and the
total grows linearly. The dynamic cache pays a little more as it copies the
whole cache on every step.

For each length L the suite times, alternating, the step that produces token L+1, as
`generate` runs it (the model runner's decode step over each cache kind):
    static / dynamic cache   a one-token forward after L - 1 tokens were prefilled
    no cache                 a forward over all L tokens (last position's logits only)

    python -m minillm.bench cache-scaling            # L = 64 .. 1024
    python -m minillm.bench cache-scaling --quick    # L = 32 .. 256
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..costmodel.probes import measure_memory_bandwidth, synchronize
from ..decoding.sampling import SamplingConfig
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from .batch import TEXT
from .common import alternate, finish_figure, median, plot_title, spread_band

LENGTHS = (64, 128, 256, 512, 768, 1024)  # context lengths of a full run (--quick: 32-256)
CONTENDERS = {"static": "static cache", "dynamic": "dynamic cache", "none": "no cache"}


def step_contenders(model, ids: list[int], device) -> dict:
    """No-argument functions, each producing the logits after `ids` through the model runner (what `generate`
    runs) over one cache kind; they return seconds."""
    contenders = {}
    for kind in ("static", "dynamic", "none"):
        runner = ModelRunner(model, cache=kind, max_len=len(ids))
        seq = Sequence.create(ids[:-1], SamplingConfig(max_new_tokens=2), vocab_size=model.config.vocab_size,
                              device=device)
        runner.prefill([seq])  # L - 1 tokens held (no cache: nothing held, each step recomputes)
        seq.append(ids[-1])
        contenders[CONTENDERS[kind]] = next_token_step(runner, seq, device)
    return contenders


def next_token_step(runner: ModelRunner, seq: Sequence, device):
    def step():
        synchronize(device)
        t = time.perf_counter()
        runner.decode([seq])  # the L-th token after the L - 1 held: the step that produces token L + 1
        synchronize(device)
        elapsed = time.perf_counter() - t
        runner.rollback([seq])  # forget it again: every call does the same work
        return elapsed
    return step


def run(args) -> dict:
    from ..speed.load import load_model

    lengths = [32, 64, 128, 256] if args.quick else list(LENGTHS)
    repeats = 3 if args.quick else max(args.repeats, 5)
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    ids = tokenizer.encode(TEXT * (1 + max(lengths) // 64))
    if len(ids) < max(lengths):
        raise ValueError(f"the benchmark text has only {len(ids)} tokens; need {max(lengths)}")
    # Probed in this run: the cost model's prediction for these steps (lesson 06) reads at this bandwidth, and on
    # a shared machine the bandwidth of another run (the decode suite's) may differ by a third.
    bandwidth = measure_memory_bandwidth(device=args.device)
    rows = []
    with torch.inference_mode():
        for L in tqdm(lengths, desc="cache-scaling", unit="length"):
            times = alternate(step_contenders(model, ids[:L], args.device), repeats=repeats, warmup=1)
            rows.append({"length": L, **{name: 1000 * median(t) for name, t in times.items()},
                         "ms_per_repeat": {name: [1000 * s for s in t] for name, t in times.items()}})
            tqdm.write(f"L={L:5d}: " + ", ".join(f"{n} {rows[-1][n]:.1f} ms" for n in times))
    first, last = rows[0], rows[-1]
    return {"model": args.model, "quick": args.quick, "dtype": "float32", "repeats": repeats,
            "unit": "ms per generated token", "memory_bandwidth_gb_s": bandwidth / 1e9, "rows": rows,
            "growth": {name: last[name] / first[name] for name in ("static cache", "dynamic cache", "no cache")}}


def plot(data: dict, path=None):
    """Three panels: the cached routes alone (their own scale), all three routes on a log axis, and the total.

    On one linear axis the uncached line, tens of times higher, would flatten the
    cached ones into the floor. Bands: min-max over the repeats.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    lengths = [r["length"] for r in rows]
    fig, (ax_cached, ax_step, ax_total) = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"static cache": "tab:blue", "dynamic cache": "tab:green", "no cache": "tab:red"}
    for name, color in styles.items():
        per_token = [r[name] for r in rows]
        samples = [r.get("ms_per_repeat", {}).get(name) for r in rows]
        for ax in (ax_cached, ax_step) if name != "no cache" else (ax_step,):
            ax.plot(lengths, per_token, "o-", color=color, label=name)
            spread_band(ax, lengths, samples, color)
        # Total cost of generating tokens 1..L: the integral of the per-token cost (trapezoids from 0).
        totals, acc, prev_len, prev_cost = [], 0.0, 0, per_token[0]
        for L, cost in zip(lengths, per_token):
            acc += (L - prev_len) * (cost + prev_cost) / 2
            totals.append(acc / 1000)
            prev_len, prev_cost = L, cost
        ax_total.plot(lengths, totals, "o-", color=color, label=name)
    ax_cached.set(ylabel="ms for the next token", title="with a cache, on its own scale", ylim=(0, None))
    ax_step.set(ylabel="ms for the next token (log scale)", title="every route, log scale", yscale="log")
    ax_total.set(ylabel="s for the whole sequence (estimated)", xscale="log", yscale="log",
                 title="total cost, log-log: slope 1 = linear, 2 = quadratic")
    ax_total.set_xticks(lengths, [str(L) for L in lengths], minor=False)
    ax_total.minorticks_off()
    for ax in (ax_cached, ax_step, ax_total):
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(plot_title("KV cache scaling", data, data["dtype"]) +
                 f"; median over repeats (n = {data['repeats']}), bands: min-max", fontsize=10)
    return finish_figure(fig, path)
