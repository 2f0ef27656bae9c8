"""A load-test client for any OpenAI-compatible server: minillm's, vLLM's, llama.cpp's.

    python -m minillm.serving.loadtest --base-url http://127.0.0.1:8000/v1 --model default --concurrency 16
    python -m minillm.serving.loadtest --base-url http://127.0.0.1:8000/v1 --model default --rate 2 --num-requests 40

It sends streaming chat requests over HTTP, as real clients do, and times what a user
sees: when the first text arrives (time to first token, TTFT), the gaps between
streamed chunks (inter-token latency, ITL), the time per output token after the first
(TPOT), the whole request (end-to-end), and over the run the request and output-token
throughput and the goodput (requests per second meeting a latency objective). These
are the metrics of vLLM's serving benchmark, so the figures compare across engines.

Arrivals follow a gamma process with mean gap 1 / rate (burstiness 1 is Poisson), or
all at once; `concurrency` caps the requests in flight (a fixed pool of clients, each
sending its next request when the last one ends). Output lengths are exact: the
requests ask the server to ignore EOS in both the ways servers accept (`ignore_eos`:
vLLM, minillm; `min_tokens` equal to `max_tokens`: llama-cpp-python, vLLM), so every
engine does the same work. A server that sends no usage chunk (llama-cpp-python's
ignores `stream_options`) is credited `max_tokens` for a request it ended for length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from ..base.commands import OneLineParser, run_command

SYSTEM_PROMPT = (
    "You are the help desk of the Riverside Public Library. Answer questions about opening hours, borrowing, "
    "renewals, fines, events and the catalogue. Opening hours: Monday to Friday 9:00 to 20:00, Saturday 10:00 to "
    "17:00, closed on Sundays and public holidays. Members may borrow up to twelve items at a time: books for "
    "three weeks, films and games for one week. Items can be renewed twice online or at the desk unless another "
    "member has reserved them. There are no fines for late books, but a lost or damaged item is charged at its "
    "replacement cost. Children's story time is every Wednesday at 10:30; the chess club meets on Thursdays at "
    "18:00; the computer room can be booked for two hours a day. Be brief, friendly and precise, and if you do "
    "not know an answer, say so and suggest asking a librarian at the front desk. "
)
QUESTIONS = (
    "Can I renew a book that someone else has reserved?", "When does story time start?",
    "How many films can I borrow at once, and for how long?", "Is the library open on Sunday afternoons?",
    "What happens if I lose a library book?", "Can I use a computer for the whole afternoon?",
    "Do you have a chess club for beginners, and when does it meet?", "I returned a book two weeks late. "
    "How much do I owe?", "Can my ten-year-old borrow video games on her own card?",
    "What time do you close on Saturday?", "How do I renew my loans online?",
    "Is there anything for toddlers on Wednesday mornings?",
)
SHORT_OUTPUTS, LONG_OUTPUTS, LONG_SHARE = (8, 48), (128, 256), 0.2  # most answers short, a fifth long


@dataclass
class ChatRequest:
    """One request of a workload: when it is sent, what it asks, how many tokens it wants."""

    at: float  # seconds after the start
    messages: list[dict]
    max_tokens: int


def chat_workload(n: int, rate: float, seed: int = 0, burstiness: float = 1.0,
                  outputs: tuple = (SHORT_OUTPUTS, LONG_OUTPUTS, LONG_SHARE)) -> list[ChatRequest]:
    """n library help-desk questions sharing one system prompt, at `rate` per second (math.inf: all at once)."""
    rng = random.Random(seed)
    short, long, long_share = outputs
    t, requests = 0.0, []
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))  # mean 1 / rate
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": rng.choice(QUESTIONS)}]
        max_tokens = rng.randint(*(long if rng.random() < long_share else short))
        requests.append(ChatRequest(t, messages, max_tokens))
    return requests


@dataclass
class Outcome:
    """What the client saw of one request (perf_counter seconds)."""

    sent: float
    status: int | None = None  # HTTP status; None when the connection failed
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk carrying text
    output_tokens: int = 0  # from the usage chunk
    end: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end is not None


async def stream_chat(http: httpx.AsyncClient, model: str, request: ChatRequest, extra: dict | None = None) -> Outcome:
    """Send one streaming chat request and time its chunks."""
    body = {"model": model, "messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "min_tokens": request.max_tokens, **(extra or {})}
    outcome = Outcome(sent=time.perf_counter())
    finish_reasons = set()
    try:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode(errors="replace")[:200]
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome.end = time.perf_counter()
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = chunk["error"].get("message", "error")
                elif chunk.get("usage"):
                    outcome.output_tokens = chunk["usage"]["completion_tokens"]
                elif any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                    outcome.chunk_times.append(time.perf_counter())
                finish_reasons.update(c["finish_reason"] for c in chunk.get("choices") or () if c.get("finish_reason"))
    except httpx.HTTPError as e:
        outcome.error = f"{type(e).__name__}: {e}"
    if not outcome.output_tokens and finish_reasons == {"length"}:  # no usage chunk: ended at max_tokens exactly
        outcome.output_tokens = request.max_tokens
    return outcome


async def run_load(base_url: str, model: str, requests: list[ChatRequest], concurrency: int | None = None,
                   extra: dict | None = None, progress=None) -> list[Outcome]:
    """Send `requests` at their times (at most `concurrency` in flight); outcomes in request order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(concurrency or len(requests) or 1)
    start = time.perf_counter()

    async def one(http, request):
        await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
        async with gate:
            outcome = await stream_chat(http, model, request, extra)
        if progress is not None:
            progress.update()
        return outcome

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10), limits=limits) as http:
        return await asyncio.gather(*(one(http, r) for r in requests))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (NumPy's linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if values else None


def summarize(outcomes: list[Outcome], slo_ttft: float, slo_tpot: float) -> dict:
    """vLLM's serving metrics over one run (seconds, tokens per second); failed requests are counted, not timed."""
    done = [o for o in outcomes if o.ok and o.chunk_times]
    ttft = [o.chunk_times[0] - o.sent for o in done]
    tpot = [(o.end - o.chunk_times[0]) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    itl = [b - a for o in done for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    e2e = [o.end - o.sent for o in done]
    span = (max(o.end for o in done) - min(o.sent for o in outcomes)) if done else math.nan
    tokens = sum(o.output_tokens for o in done)
    good = sum(o.chunk_times[0] - o.sent <= slo_ttft and
               (o.output_tokens <= 1 or (o.end - o.chunk_times[0]) / (o.output_tokens - 1) <= slo_tpot) for o in done)
    out = {"requests": len(outcomes), "failed": len(outcomes) - len(done), "seconds": span, "output_tokens": tokens,
           "tokens_per_second": tokens / span, "requests_per_second": len(done) / span, "goodput": good / span,
           "statuses": sorted({o.status for o in outcomes if o.status is not None})}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                     "mean": float(np.mean(values)) if values else None}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillm.serving.loadtest",
                      description="Load-test an OpenAI-compatible server with streaming chat requests.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", default="default", help="the model name the server expects")
    p.add_argument("--num-requests", type=int, default=32, metavar="N", help="requests to send (default 32)")
    p.add_argument("--rate", type=float, default=math.inf, metavar="R",
                   help="requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--concurrency", type=int, metavar="N", help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws (default 0)")
    p.add_argument("--slo-ttft", type=float, default=2.0, metavar="S",
                   help="goodput objective: time to first token in seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.25, metavar="S",
                   help="goodput objective: time per output token in seconds (default 0.25)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    return p


def main(argv=None) -> int:
    return run_command(build_parser(), run, argv)


def run(args) -> int:
    if args.num_requests < 1 or (args.concurrency is not None and args.concurrency < 1) or not args.rate > 0:
        raise ValueError(f"--num-requests {args.num_requests}, --concurrency {args.concurrency}, --rate {args.rate}: "
                         f"the first two must be >= 1 and the rate > 0")
    workload = chat_workload(args.num_requests, args.rate, args.seed)
    outcomes = asyncio.run(run_load(args.base_url, args.model, workload, args.concurrency))
    metrics = summarize(outcomes, args.slo_ttft, args.slo_tpot)
    if args.json:
        print(json.dumps(metrics))
        return 0
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(f"{len(failed)} requests failed, e.g. status {failed[0].status}: {failed[0].error}", file=sys.stderr)
    if metrics["failed"] == metrics["requests"]:
        return 1
    ms = {name: {k: (v * 1000 if v is not None else math.nan) for k, v in metrics[name].items()}
          for name in ("ttft", "tpot", "itl", "e2e")}
    print(f"{metrics['requests'] - metrics['failed']}/{metrics['requests']} requests in {metrics['seconds']:.1f} s: "
          f"{metrics['tokens_per_second']:.1f} output tok/s, {metrics['requests_per_second']:.2f} req/s, "
          f"goodput {metrics['goodput']:.2f} req/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"  {name:5s} p50 {ms[name]['p50']:9.1f} ms   p99 {ms[name]['p99']:9.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
