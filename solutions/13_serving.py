"""Worked solutions to lesson 13's exercises (`pytest lessons/13-serving --solutions` checks them)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

from minillm.decoding.sampling import SamplingConfig

LINE_END = re.compile(rb"\r\n|\r|\n")  # \r\n first: one line end, not two


def sse_data(chunks: Iterable[bytes]) -> Iterator[str]:
    """Exercise 1: Server-sent events"""
    pending = b""  # the start of a line whose end has not arrived yet
    after_cr = False  # the last chunk ended on \r: a \n opening the next chunk is the rest of that line end
    data = None  # the current event's data lines; None while it has none (then a blank line dispatches nothing)
    for chunk in chunks:
        if not chunk:
            continue
        if after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # otherwise \r | \n across two chunks would read as a line end and a blank line
        after_cr = chunk.endswith(b"\r")  # treated as a line end at once: a \r-only stream is not held back
        *lines, pending = LINE_END.split(pending + chunk)  # split bytes: \r and \n never occur inside a UTF-8 character
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")  # a whole line: no character is cut in half any more
            if not line:  # a blank line: dispatch
                if data is not None:
                    payload, data = "\n".join(data), None
                    if payload == "[DONE]":
                        return  # no further chunk is read
                    yield payload
            elif not line.startswith(":"):  # ':' starts a comment (servers send them as keep-alives)
                field, _, value = line.partition(":")
                if field == "data":
                    data = (data or []) + [value.removeprefix(" ")]  # one space only: "data:  x" is " x"
    # Whatever is left (pending text, an event with no blank line after it) was cut off: dropped.


def to_sampling_config(body: dict, max_new_tokens: int):
    names = ("top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")
    stop = body.get("stop") or ()
    return SamplingConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=body.get("temperature", 1.0),
                          stop=(stop,) if isinstance(stop, str) else tuple(stop),
                          **{name: body[name] for name in names if body.get(name) is not None})


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Exercise 3: Quantiles from a scrape"""
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:  # in the +Inf bucket: nothing bounds it above, so the last finite bound stands
        return buckets[-2][0]
    start, below = (buckets[b - 1][0], buckets[b - 1][1]) if b else (0.0, 0.0)
    end, count = buckets[b]
    return start + (end - start) * (rank - below) / (count - below)
    # Predict first: how far can this be from the true quantile? Anywhere inside the bucket the rank falls in,
    # so at most that bucket's width: the buckets' edges are the resolution a dashboard's p99 has. Linear
    # interpolation assumes the observations spread evenly inside a bucket; a latency distribution's bulk sits
    # at the low end of a wide bucket, so the estimate leans high there.


def quantile_from_scrape(text: str, histogram: str, q: float) -> float:
    """Exercise 3: Quantiles from a scrape"""
    from prometheus_client.parser import text_string_to_metric_families

    family = next(f for f in text_string_to_metric_families(text) if f.name == histogram)
    buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name == f"{histogram}_bucket")
    return histogram_quantile(q, buckets)


def p99_latency(arrival_rate: float, service_rate: float) -> float:
    """Exercise 4: Predict p99 from the arrival rate"""
    if arrival_rate >= service_rate:
        raise ValueError(f"{arrival_rate} requests/s arrive and {service_rate} can be served: the queue grows "
                         "without bound")
    # In an M/M/1 queue (first come first served) the time in the system is exponential with rate mu - lambda,
    # so P(T > t) = exp(-(mu - lambda) t) and the q-th quantile is -ln(1 - q) / (mu - lambda): ln(100) for p99.
    return math.log(100) / (service_rate - arrival_rate)
    # Read it as ln(100) / mu (a request's own p99 service time, 4.6 mean services) times 1 / (1 - rho), where
    # rho = lambda / mu is the utilization. At rho = 0.5 p99 doubles, at 0.9 it is ten times the idle p99: the
    # tail explodes long before the server is "full", which is why a server sheds load (503) instead of queueing
    # forever. A batching server postpones it: in the stored load test (results/server.json) TTFT p99 goes
    # <!-- figure: server.rates.find(rate=2.0).ttft.p99 / server.rates.find(rate=0.5).ttft.p99 | .1f -->0.3<!-- /figure -->x from 0.5 to 2 req/s (a tail of a few dozen requests: one slow first
    # token moves it). By Little's law,
    # 2 req/s times the mean end-to-end time there is about
    # <!-- figure: server.rates.find(rate=2.0).rate * server.rates.find(rate=2.0).e2e.mean | .0f -->3<!-- /figure --> requests in flight,
    # <!-- figure: "fewer" if server.rates.find(rate=2.0).rate * server.rates.find(rate=2.0).e2e.mean < 16 else "more" -->fewer<!-- /figure --> than the 16 places in the
    # batch (`--max-num-seqs 16`), so almost no request waits for one; the load shows up instead as every step
    # carrying more rows, TPOT p50 <!-- figure: server.rates.find(rate=2.0).tpot.p50 / server.rates.find(rate=0.5).tpot.p50 | .1f -->1.1<!-- /figure -->x. At 4 req/s the same count is about
    # <!-- figure: server.rates.find(rate=4.0).rate * server.rates.find(rate=4.0).e2e.mean | .0f -->6<!-- /figure -->,
    # <!-- figure: "fewer" if server.rates.find(rate=4.0).rate * server.rates.find(rate=4.0).e2e.mean < 16 else "more" -->fewer<!-- /figure --> than 16: a request that finds the batch full would wait in the queue for
    # a place, and that wait would show in the TTFT tail first; here the TTFT p99 is <!-- figure: server.rates.find(rate=4.0).ttft.p99 / server.rates.find(rate=0.5).ttft.p99 | .1f -->0.4<!-- /figure -->x the 0.5 req/s
    # figure and the median <!-- figure: server.rates.find(rate=4.0).ttft.p50 / server.rates.find(rate=0.5).ttft.p50 | .1f -->1.5<!-- /figure -->x (and TPOT p50
    # <!-- figure: server.rates.find(rate=4.0).tpot.p50 / server.rates.find(rate=0.5).tpot.p50 | .1f -->1.3<!-- /figure -->x). The end-to-end p99 is set by the long answers, not the queue.
    # With 24 requests per rate the arrivals stop within seconds and the queue with them, so its wait stays
    # bounded: to see the blow-up, a run must keep arrivals above what the full batch serves for many more
    # requests, so that the waiting queue, and TTFT with it, keeps growing.
    # A real engine batches (several requests are served at once, so it is closer to M/M/c or a batch queue)
    # and its service times are not exponential, but the 1 / (1 - rho) blow-up near saturation is the same.


def max_rate_under_slo(service_rate: float, p99_slo: float) -> float:
    """Exercise 4: Predict p99 from the arrival rate"""
    # ln(100) / (mu - lambda) <= slo  <=>  lambda <= mu - ln(100) / slo
    return max(0.0, service_rate - math.log(100) / p99_slo)
