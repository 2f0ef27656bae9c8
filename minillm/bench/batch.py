"""Suite `batch`: generated tokens per second against batch size (lesson 07).

At batch 1 a decode step reads every weight to produce one token; a batch of B
rows reads the same weights once for B tokens, so throughput grows almost
linearly until the matrix multiplications become compute-bound. Prompts of mixed
lengths are padded to the longest for the prefill (on the right in minillm's decode
session, on the left in transformers), and the padding is computed too: the suite
reports its share.

minillm's `generate` and transformers' batched `generate` (left padding,
`attention_mask`) run the same prompts on the same FP32 weights, alternating in
one run. EOS is switched off so every row produces exactly `new_tokens` tokens,
and both must produce the same tokens. Per contender and batch size:

    tokens_per_second    B * new_tokens / wall time (prefill included)
    decode_per_second    B * (new_tokens - 1) / time after the first token
    ms_per_token         time between a row's successive tokens while decoding

    python -m minillm.bench batch            # batch 1..32, 32 new tokens
    python -m minillm.bench batch --quick    # batch 1..8, 8 new tokens
"""

from __future__ import annotations

import time

import torch

from ..costmodel.probes import synchronize
from ..runtime.batching import pad_left, padding_share
from ..strategies.generate import generate
from .common import alternate, median, plot_title, save_png, spread_band

# A mix of prompt lengths (tokens), cycled to fill each batch: mean ~30, longest 64.
PROMPT_LENGTHS = [9, 57, 21, 40, 14, 33, 5, 64]
BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # a full run's (--quick: up to 8)
NEW_TOKENS = 32  # a full run's new tokens per row (--quick: 8)
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press adapted from those used for wine. Within fifty "
        "years presses were running in more than two hundred European cities, books became cheap, and the way "
        "people learned, argued and worshipped changed for good. ") * 4


def batch_prompts(tokenizer, batch: int) -> list[list[int]]:
    """`batch` prompts cut from TEXT at different offsets, lengths cycling through PROMPT_LENGTHS."""
    ids = tokenizer.encode(TEXT)
    return [ids[3 * i: 3 * i + PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]] for i in range(batch)]


class _FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrives.

    `generate` hands it the prompt first, then each step's tokens.
    """

    def __init__(self):
        self.calls, self.first_token_at = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


def _minillm_contender(model, prompts, new_tokens, device, record):
    def run():
        synchronize(device)
        t = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=new_tokens, compile=False)  # ids, no tokenizer: no EOS
        synchronize(device)
        total = time.perf_counter() - t
        record.append((total, out.stats.prefill_seconds, out.token_ids))
        return total
    return run


def _transformers_contender(hf_model, prompts, new_tokens, device, record):
    tokens, key_valid, _ = pad_left(prompts, pad_id=0, device=device)

    def run():
        clock = _FirstTokenClock()
        synchronize(device)
        t = time.perf_counter()
        out = hf_model.generate(tokens, attention_mask=key_valid.long(), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0, streamer=clock)
        synchronize(device)
        total = time.perf_counter() - t
        record.append((total, clock.first_token_at - t, out[:, tokens.shape[1]:].tolist()))
        return total
    return run


def _summary(record, batch, new_tokens) -> dict:
    total = median([r[0] for r in record])
    first = median([r[1] for r in record])
    decode = total - first
    return {"seconds": total, "seconds_per_repeat": [r[0] for r in record],
            "time_to_first_token_per_repeat": [r[1] for r in record], "time_to_first_token": first,
            "tokens_per_second": batch * new_tokens / total,
            "decode_per_second": batch * (new_tokens - 1) / decode,
            "ms_per_token": 1000 * decode / (new_tokens - 1)}


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ..model.loading import resolve_checkpoint_folder
    from ..speed.load import load_model

    batch_sizes = [1, 2, 4, 8] if args.quick else list(BATCH_SIZES)
    new_tokens = 8 if args.quick else NEW_TOKENS
    repeats = 1 if args.quick else args.repeats
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    hf_model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint_folder(args.model),
                                                    dtype=torch.float32).to(args.device).eval()
    hf_model.generation_config.eos_token_id = None  # every row runs to new_tokens, as in minillm without EOS

    rows = []
    for batch in batch_sizes:
        prompts = batch_prompts(tokenizer, batch)
        records = {"minillm": [], "transformers": []}
        with torch.inference_mode():
            alternate({"minillm": _minillm_contender(model, prompts, new_tokens, args.device, records["minillm"]),
                       "transformers": _transformers_contender(hf_model, prompts, new_tokens, args.device,
                                                               records["transformers"])},
                      repeats=repeats, warmup=1, desc=f"batch {batch}")
        lengths = [len(p) for p in prompts]
        row = {"batch": batch, "prompt_lengths": lengths, "padding_share": padding_share(lengths, new_tokens),
               "prefill_padding_share": padding_share(lengths),
               "same_tokens": records["minillm"][-1][2] == records["transformers"][-1][2]}
        for name, record in records.items():
            row[name] = _summary(record[1:], batch, new_tokens)  # the warm-up call is not counted
        row["speedup_vs_transformers"] = row["minillm"]["tokens_per_second"] / row["transformers"][
            "tokens_per_second"]
        rows.append(row)
        print(f"batch {batch:3d}: minillm {row['minillm']['tokens_per_second']:7.1f} tok/s, transformers "
              f"{row['transformers']['tokens_per_second']:7.1f} tok/s, x{row['speedup_vs_transformers']:.2f}, "
              f"padding {row['padding_share']:.0%}, same tokens: {row['same_tokens']}", flush=True)

    base = rows[0]["minillm"]["tokens_per_second"]
    for row in rows:
        row["minillm_scaling_vs_batch_1"] = row["minillm"]["tokens_per_second"] / base
    return {"model": args.model, "dtype": "float32", "new_tokens": new_tokens, "repeats": repeats, "rows": rows}


def plot(data: dict, path) -> None:
    """Throughput (all rows, and the decode phase alone) and per-row latency against batch size.

    Bands: min-max over the repeats, each repeat's figures computed from its own times.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, new_tokens = data["rows"], data["new_tokens"]
    batches = [r["batch"] for r in rows]

    def per_repeat(name, figure):  # figure(batch, total seconds, seconds to the first token) for each repeat
        return [[figure(r["batch"], total, first) for total, first in
                 zip(r[name].get("seconds_per_repeat", []), r[name].get("time_to_first_token_per_repeat", []))]
                for r in rows]

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.4))
    for name, color in (("minillm", "tab:blue"), ("transformers", "tab:orange")):
        ax_tp.plot(batches, [r[name]["tokens_per_second"] for r in rows], "o-", color=color, label=f"{name}")
        spread_band(ax_tp, batches, per_repeat(name, lambda b, total, first: b * new_tokens / total), color)
        ax_tp.plot(batches, [r[name]["decode_per_second"] for r in rows], "o--", color=color, alpha=0.5,
                   label=f"{name}, decode only")
        spread_band(ax_tp, batches, per_repeat(name, lambda b, total, first: b * (new_tokens - 1) / (total - first)),
                    color)
        ax_lat.plot(batches, [r[name]["ms_per_token"] for r in rows], "o-", color=color, label=name)
        spread_band(ax_lat, batches,
                    per_repeat(name, lambda b, total, first: 1000 * (total - first) / (new_tokens - 1)), color)
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (prompts generated together)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_tp.set_ylabel("generated tokens / s (all rows)")
    ax_tp.set_title("throughput")
    ax_lat.set_ylabel("ms per token (each row, decoding)")
    ax_lat.set_title("per-token latency")
    fig.suptitle(plot_title("Batched generation", data, data["dtype"]) +
                 f"\n{new_tokens} new tokens, mixed prompt lengths; median over repeats (n = {data['repeats']}), "
                 "bands: min-max", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
