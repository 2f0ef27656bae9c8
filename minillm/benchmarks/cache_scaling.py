"""Suite `cache-scaling`: what one more token costs as the sequence grows (lesson 06).

Without a cache, token t+1 needs a forward over all t tokens: the per-token cost
grows with length and the total cost of a generation grows quadratically. With a
cache it is one token's forward plus attention over t stored keys: at these
lengths the weights dominate, so the per-token cost stays nearly flat and the
total grows linearly. The dynamic cache pays a little more as it copies the
whole cache on every step.

For each length L the suite times, alternating, the step that produces token L+1:
    static / dynamic cache   a one-token forward after L tokens were prefilled
    no cache                 a forward over all L tokens (last position's logits only)

    python -m minillm.bench cache-scaling            # L = 64 .. 1024
    python -m minillm.bench cache-scaling --quick    # L = 32 .. 256
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..bench import alternate, machine_label, median, synchronize
from ..kv_cache import make_cache
from ..model import causal_positions
from .batch import TEXT


def step_contenders(model, ids: list[int], device) -> dict:
    """No-argument functions, each producing the logits after `ids` by one route; they return seconds."""
    L = len(ids)
    tokens = torch.tensor([ids], device=device)
    positions = causal_positions(1, L, device)
    caches = {}
    for kind in ("static", "dynamic"):
        caches[kind] = make_cache(kind, model, 1, L + 1)
        model(tokens[:, :-1], positions[:, :-1], cache=caches[kind], last_only=True)  # prefill L-1 tokens

    def cached(kind):
        def step():
            cache = caches[kind]
            cache.crop(L - 1)  # forget the previous timing's token: every call does the same work
            synchronize(device)
            t = time.perf_counter()
            model(tokens[:, -1:], positions[:, -1:], cache=cache)
            synchronize(device)
            return time.perf_counter() - t
        return step

    def uncached():
        synchronize(device)
        t = time.perf_counter()
        model(tokens, positions, last_only=True)
        synchronize(device)
        return time.perf_counter() - t

    return {"static cache": cached("static"), "dynamic cache": cached("dynamic"), "no cache": uncached}


def run(args) -> dict:
    from ..loading import load_model

    lengths = [32, 64, 128, 256] if args.quick else [64, 128, 256, 512, 768, 1024]
    repeats = 3 if args.quick else max(args.repeats, 5)
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    ids = tokenizer.encode(TEXT * (1 + max(lengths) // 64))
    if len(ids) < max(lengths):
        raise ValueError(f"the benchmark text has only {len(ids)} tokens; need {max(lengths)}")
    rows = []
    with torch.inference_mode():
        for L in tqdm(lengths, desc="cache-scaling", unit="length"):
            times = alternate(step_contenders(model, ids[:L], args.device), repeats=repeats, warmup=1)
            rows.append({"length": L, **{name: 1000 * median(t) for name, t in times.items()}})
            tqdm.write(f"L={L:5d}: " + ", ".join(f"{n} {rows[-1][n]:.1f} ms" for n in times))
    first, last = rows[0], rows[-1]
    return {"model": args.model, "quick": args.quick, "dtype": "float32", "repeats": repeats, "unit": "ms per generated token",
            "rows": rows,
            "growth": {name: last[name] / first[name] for name in ("static cache", "dynamic cache", "no cache")}}


def plot(data: dict, path=None):
    """Left: ms for the next token against length. Right: total ms to generate up to that length."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    lengths = [r["length"] for r in rows]
    fig, (ax_step, ax_total) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"static cache": "tab:blue", "dynamic cache": "tab:green", "no cache": "tab:red"}
    for name, color in styles.items():
        per_token = [r[name] for r in rows]
        ax_step.plot(lengths, per_token, "o-", color=color, label=name)
        # Total cost of generating tokens 1..L: the integral of the per-token cost (trapezoids from 0).
        totals, acc, prev_len, prev_cost = [], 0.0, 0, per_token[0]
        for L, cost in zip(lengths, per_token):
            acc += (L - prev_len) * (cost + prev_cost) / 2
            totals.append(acc / 1000)
            prev_len, prev_cost = L, cost
        ax_total.plot(lengths, totals, "o-", color=color, label=name)
    ax_step.set_ylabel("ms for the next token")
    ax_step.set_title("cost of one more token")
    ax_total.set_ylabel("s to generate the whole sequence (estimated)")
    ax_total.set_title("total cost: linear with a cache, quadratic without")
    for ax in (ax_step, ax_total):
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"KV cache scaling, {data['model']} {data['dtype']} on {data['machine']['device']} "
                 f"({machine_label(data['machine'])})", fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig
