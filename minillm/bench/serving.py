"""`python -m minillm.bench serving`: continuous batching (lesson 12) under a stream of requests.

A server does not get its prompts all at once: requests arrive while others are being
served. This suite replays one workload, in real time and in process, through three
ways of serving it, on the default model in FP32:

- **continuous batching**: `minillm.runtime.engine.Engine`, a paged KV cache with prefix
  caching, eager (and once more with the prefix cache off, to show what it saves), and
  with its decode steps through the compiled paged graph kept on disk (lesson 15; built
  first, before any timing, when it is not there yet: its build time is recorded);
- **static batching** (lesson 07): whenever the model is idle, the requests waiting are
  batched (up to the same batch limit) and `generate` runs them to the end of the
  slowest; newcomers wait for the whole batch;
- **one at a time**: `generate` on each request in arrival order (measured only with every
  request arriving at once: any rate above its capacity of well under one request per
  second saturates it the same way, and its runs are the longest by far).

The workload, as vLLM's serving benchmark draws it: arrival gaps from a gamma
distribution with mean 1 / rate (burstiness 1 is a Poisson process; lower is burstier),
prompts that share a few-hundred-token system prompt followed by a short user message,
and output lengths with a long tail (most answers short, some long; EOS is ignored so
every request produces exactly its length, whichever way it is served).

Per way and request rate: output-token throughput (tokens over the time from the first
arrival to the last finish), request throughput, and per-request time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency (ITL) and
end-to-end latency, as p50 and p99; goodput, the requests per second that meet a
latency objective. From the continuous runs: KV memory holding keys against what the
paged pool set aside and against what reserving each request's exact final length
contiguously would take (an oracle, the best case for contiguous allocation: EOS is
ignored, so `max_new_tokens` is each request's true length), and the share of prompt
tokens the prefix cache served.

    python -m minillm.bench serving            # 2 request rates + everything at once, 40 requests each
    python -m minillm.bench serving --quick    # 1 rate + everything at once, 8 short requests
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..decoding.sampling import SamplingConfig
from ..runtime.engine import Engine, kv_bytes_per_token
from ..serving.loadtest import LONG_OUTPUTS, LONG_SHARE, SHORT_OUTPUTS, SYSTEM_PROMPT, chat_workload, percentile
from ..strategies.generate import generate
from .common import finish_figure, plot_title


@dataclass
class Arrival:
    """One request of the workload."""

    at: float  # seconds after the start
    prompt_ids: list[int]
    new_tokens: int


def make_workload(tokenizer, n: int, rate: float, seed: int = 0, burstiness: float = 1.0,
                  outputs: tuple = (SHORT_OUTPUTS, LONG_OUTPUTS, LONG_SHARE)) -> list[Arrival]:
    """n requests at `rate` per second (math.inf: all at once), the same draws for every way of serving:
    the load test's chat workload (`minillm.serving.loadtest`), tokenized through the chat template."""
    return [Arrival(r.at, tokenizer.encode(tokenizer.apply_chat_template(r.messages)), r.max_tokens)
            for r in chat_workload(n, rate, seed, burstiness, outputs)]


@dataclass
class Served:
    """When one request arrived and got each of its tokens (perf_counter seconds)."""

    arrival: float
    token_times: list[float]


def _config(arrival: Arrival) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=arrival.new_tokens, eos_token_id=())  # exact lengths: EOS ignored


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def serve_continuous(model, workload: list[Arrival], engine_options: dict) -> tuple[list[Served], Engine]:
    engine = Engine(model, **engine_options)
    start = time.perf_counter()
    pending, ids = list(workload), []
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and start + pending[0].at <= now:
            arrival = pending.pop(0)
            ids.append(engine.add_request(arrival.prompt_ids, _config(arrival), arrival_time=start + arrival.at))
        if not engine.has_unfinished():
            _wait_until(start + pending[0].at)
            continue
        engine.step()
    return [Served(engine.requests[i].arrival_time, engine.requests[i].token_times) for i in ids], engine


def serve_static(model, workload: list[Arrival], max_batch: int) -> list[Served]:
    """Lesson 07's batching behind a queue: batch whatever waits, run it to its slowest row, repeat."""
    start = time.perf_counter()
    pending, served = list(workload), []
    while pending:
        _wait_until(start + pending[0].at)
        now = time.perf_counter()
        batch = []
        while pending and start + pending[0].at <= now and len(batch) < max_batch:
            batch.append(pending.pop(0))
        rows = [Served(start + a.at, []) for a in batch]
        for event in generate(model, [a.prompt_ids for a in batch], [_config(a) for a in batch], stream=True,
                              compile=False):
            if event.token_ids:
                rows[event.row].token_times.append(time.perf_counter())
        served += rows
    return served


def summarize(served: list[Served], slo_ttft: float, slo_tpot: float) -> dict:
    """vLLM's serving metrics over one run (seconds); goodput counts requests meeting both objectives."""
    ttft = [s.token_times[0] - s.arrival for s in served]
    tpot = [_tpot(s) for s in served]
    itl = [b - a for s in served for a, b in zip(s.token_times, s.token_times[1:])]
    e2e = [s.token_times[-1] - s.arrival for s in served]
    span = max(s.token_times[-1] for s in served) - min(s.arrival for s in served)
    tokens = sum(len(s.token_times) for s in served)
    good = sum(t <= slo_ttft and (p is None or p <= slo_tpot) for t, p in zip(ttft, tpot))
    out = {"seconds": span, "output_tokens": tokens, "tokens_per_second": tokens / span,
           "requests_per_second": len(served) / span, "goodput": good / span, "e2e_per_request": e2e}
    for name, values in (("ttft", ttft), ("tpot", [p for p in tpot if p is not None]), ("itl", itl), ("e2e", e2e)):
        out[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    return out


def _tpot(s: Served) -> float | None:
    """Time per output token after the first; None for a one-token answer."""
    return (s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) if len(s.token_times) > 1 else None


def kv_memory(engine: Engine) -> dict:
    """Over the continuous run's steps: how much of the KV memory set aside holds keys.

    paged: slots holding keys / slots in the blocks handed out (a shared block counts once);
    contiguous: keys stored / what reserving each running request's maximum length would take.
    Both are step-weighted means; the peaks say how large each pool must be.
    """
    steps = [r for r in engine.timeline if r.blocks_used]
    bs = engine.manager.block_size
    return {"paged_used_share": sum(r.slots_filled for r in steps) / sum(r.blocks_used * bs for r in steps),
            "contiguous_used_share": sum(r.tokens_stored for r in steps) / sum(r.tokens_reserved for r in steps),
            "paged_peak_slots": max(r.blocks_used * bs for r in steps),
            "contiguous_peak_slots": max(r.tokens_reserved for r in steps),
            "pool_slots": engine.manager.capacity,
            "bytes_per_token": kv_bytes_per_token(engine.model)}


def engine_trace(engine: Engine) -> dict:
    """What the plots draw from one continuous run: who was in each step, and the pool's occupancy; and what the
    cost model predicts each step's time from (lesson 12's prediction): its tokens, and how long it took."""
    t0 = engine.timeline[0].start
    return {"step_start": [r.start - t0 for r in engine.timeline], "requests": [r.requests for r in engine.timeline],
            "step_seconds": [r.seconds for r in engine.timeline],
            "prefill_tokens": [r.prefill_tokens for r in engine.timeline],
            "decode_tokens": [r.decode_tokens for r in engine.timeline],
            "slots_held": [r.blocks_used * engine.manager.block_size for r in engine.timeline],
            "slots_filled": [r.slots_filled for r in engine.timeline],
            "contiguous_reserved": [r.tokens_reserved for r in engine.timeline],
            "preempted": [r.preempted for r in engine.timeline]}


WAYS = ("continuous", "continuous, compiled step", "continuous, no prefix cache", "static", "one at a time")
SATURATED_ONLY = ("one at a time",)  # ways measured only with every request arriving at once


def ways_at(rate: float) -> tuple[str, ...]:
    return WAYS if not math.isfinite(rate) else tuple(w for w in WAYS if w not in SATURATED_ONLY)


def run(args) -> dict:
    from ..speed.load import load_model

    quick = args.quick
    n = 8 if quick else 40
    rates = [2.0, math.inf] if quick else [2.0, 4.0, math.inf]
    outputs = ((4, 12), (24, 32), 0.2) if quick else (SHORT_OUTPUTS, LONG_OUTPUTS, LONG_SHARE)
    max_batch = 16
    slo_ttft, slo_tpot = 2.0, 0.25  # a chat user waits two seconds for the first words, then reads at >= 4 tokens/s
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    pool_tokens = 4096
    # Eager unless the way says compiled, whatever graphs are on disk: what the scheduling buys (lesson 12) is
    # measured with the same forward as static batching's, and the compiled step beside it.
    engine_options = dict(block_size=16, num_blocks=pool_tokens // 16, max_num_seqs=max_batch,
                          max_num_batched_tokens=512, graph="eager")
    compiled_options = dict(engine_options, graph="compiled")
    warm = make_workload(tokenizer, 4, math.inf, seed=99, outputs=((4, 8), (4, 8), 0.0))
    serve_continuous(model, warm, engine_options)  # warm-up: oneDNN primitives for the common shapes
    _, compiled = serve_continuous(model, warm, compiled_options)  # the paged graph loaded, or built and kept
    serve_static(model, warm, max_batch)

    rows, traces = [], {}
    runs = sum(len(ways_at(r)) for r in rates)
    with tqdm(total=runs, desc="serving runs", leave=False, disable=None) as progress:
        for rate in rates:
            workload = make_workload(tokenizer, n, rate, seed=0, outputs=outputs)
            row = {"rate": rate if math.isfinite(rate) else None, "requests": n,
                   "prompt_tokens": sum(len(a.prompt_ids) for a in workload),
                   "output_tokens": sum(a.new_tokens for a in workload),
                   "prompt_lengths": [len(a.prompt_ids) for a in workload],  # in arrival order
                   "output_lengths": [a.new_tokens for a in workload]}
            for way in ways_at(rate):
                progress.set_postfix_str(f"{rate} req/s: {way}")
                if way.startswith("continuous"):
                    options = dict(compiled_options if way == "continuous, compiled step" else engine_options,
                                   prefix_caching=way != "continuous, no prefix cache")
                    served, engine = serve_continuous(model, workload, options)
                    row[way] = summarize(served, slo_ttft, slo_tpot)
                    row[way].update(kv_memory(engine), prefix_hit_rate=engine.prefix_hit_rate,
                                    preemptions=sum(r.preemptions for r in engine.requests.values()),
                                    forward_passes=engine.forward_passes,
                                    compiled_steps=engine.runner.compiled_steps)
                    if way == "continuous":
                        traces[str(row["rate"])] = engine_trace(engine)
                    elif not math.isfinite(rate):  # all at once: what lesson 12 predicts the prefix cache's gain from
                        traces[f"{row['rate']}, no prefix cache"] = engine_trace(engine)
                else:
                    served = serve_static(model, workload, max_batch if way == "static" else 1)
                    row[way] = summarize(served, slo_ttft, slo_tpot)
                progress.update()
            row["throughput_vs_static"] = row["continuous"]["tokens_per_second"] / row["static"]["tokens_per_second"]
            row["compiled_vs_static"] = (row["continuous, compiled step"]["tokens_per_second"]
                                         / row["static"]["tokens_per_second"])
            rows.append(row)
            print(f"rate {rate} req/s: " + ", ".join(f"{way} {row[way]['tokens_per_second']:.1f} tok/s "
                                                     f"(p99 e2e {row[way]['e2e']['p99']:.1f} s)" for way in ways_at(rate)),
                  flush=True)
    return {"model": args.model, "dtype": "float32", "requests": n, "max_batch": max_batch,
            "engine": engine_options, "slo": {"ttft": slo_ttft, "tpot": slo_tpot},
            "compiled_step": {"graph": compiled.runner.graph,  # loaded, or built and kept, before any timing
                              "ready_seconds": compiled.runner.build_seconds},
            "workload": {"system_prompt_tokens": len(tokenizer.encode(SYSTEM_PROMPT)), "outputs": outputs,
                         "burstiness": 1.0},
            "rows": rows, "traces": traces}


def plot(data: dict, path) -> None:
    """Throughput and p99 latency against request rate; one saturated run's batch timeline and pool
    occupancy; the latency distributions at saturation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    finite = [r for r in rows if r["rate"] is not None]
    saturated = rows[-1]
    colors = dict(zip(WAYS, ("tab:blue", "tab:purple", "tab:cyan", "tab:orange", "tab:gray")))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.2))
    (ax_tp, ax_p99, ax_ttft), (ax_timeline, ax_pool, ax_cdf) = axes
    rates = [r["rate"] for r in finite]
    for way in WAYS:
        if way not in SATURATED_ONLY:
            ax_tp.plot(rates, [r[way]["tokens_per_second"] for r in finite], "o-", color=colors[way], label=way)
            ax_p99.plot(rates, [r[way]["e2e"]["p99"] for r in finite], "o-", color=colors[way], label=way)
            ax_ttft.plot(rates, [r[way]["ttft"]["p50"] for r in finite], "o-", color=colors[way], label=way)
        else:  # measured at saturation only: its throughput is the same at every rate above its capacity
            ax_tp.axhline(saturated[way]["tokens_per_second"], color=colors[way], ls=":", label=f"{way} (saturated)")
        e2e = sorted(saturated[way]["e2e_per_request"])
        ax_cdf.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], color=colors[way], label=way)
    for ax, label, title in ((ax_tp, "output tokens / s", "throughput"),
                             (ax_p99, "p99 end-to-end latency (s)", "tail latency"),
                             (ax_ttft, "median time to first token (s)", "waiting for the first token")):
        ax.set_xlabel("request rate (requests / s, Poisson arrivals)")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax_p99.set_yscale("log")
    ax_ttft.set_yscale("log")
    ax_tp.legend(fontsize=8)

    trace = data["traces"][str(saturated["rate"])]
    for start, ids in zip(trace["step_start"], trace["requests"]):
        ax_timeline.scatter([start] * len(ids), ids, s=2, color="tab:blue", marker="s", linewidths=0)
    ax_timeline.set_xlabel("time (s)")
    ax_timeline.set_ylabel("request id")
    ax_timeline.set_title("continuous batching: who is in each step (all arrive at once)")

    t = trace["step_start"]
    ax_pool.plot(t, trace["contiguous_reserved"], color="tab:red", label="contiguous: each request's max length")
    ax_pool.plot(t, trace["slots_held"], color="tab:blue", label="paged: slots in blocks handed out")
    ax_pool.plot(t, trace["slots_filled"], color="tab:green", label="slots holding keys")
    ax_pool.axhline(saturated["continuous"]["pool_slots"], color="black", lw=0.8, ls="--", label="pool size")
    ax_pool.set_xlabel("time (s)")
    ax_pool.set_ylabel("KV slots (tokens)")
    ax_pool.set_title("KV memory over the run")
    ax_pool.legend(fontsize=7)

    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("end-to-end latency (s)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.set_title("latency distribution (all arrive at once)")
    ax_cdf.legend(fontsize=8)
    for ax in (ax_timeline, ax_pool, ax_cdf):
        ax.grid(alpha=0.3)
    fig.suptitle(plot_title("Serving a stream of requests", data, data["dtype"]) +
                 f"\n{data['requests']} requests per rate sharing a {data['workload']['system_prompt_tokens']}-token "
                 f"system prompt, long-tailed output lengths, batch limit {data['max_batch']}", fontsize=10)
    finish_figure(fig, path)
