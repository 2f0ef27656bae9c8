"""Worked solutions to lesson 13's exercises (`pytest lessons/13-serving --solutions` checks them)."""

from __future__ import annotations

import json
import math

from minillm.decoding.sampling import SamplingConfig


def sse_encode(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def sse_decode(lines: list[str]) -> list[dict]:
    chunks = []
    for line in lines:
        if not line or line.startswith(":"):
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            break
        chunks.append(json.loads(payload))
    return chunks


def to_sampling_config(body: dict, max_new_tokens: int):
    names = ("top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")
    stop = body.get("stop") or ()
    return SamplingConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=body.get("temperature", 1.0),
                          stop=(stop,) if isinstance(stop, str) else tuple(stop),
                          **{name: body[name] for name in names if body.get(name) is not None})


def request_metrics(sent: float, chunk_times: list[float], end: float, output_tokens: int) -> dict:
    first = chunk_times[0]
    return {"ttft": first - sent, "tpot": (end - first) / (output_tokens - 1) if output_tokens > 1 else None,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])]}


def max_request_rate(batch: int, seconds_per_step: float, mean_output_tokens: float) -> float:
    # Little's law: requests in flight (batch) = rate x time each spends (mean tokens x seconds per step).
    return batch / (mean_output_tokens * seconds_per_step)


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
    # forever. The stored load test does not show it: its runs (24 requests per rate on a 16-request batch) are too
    # short to reach steady state, so its TTFT p99 only rises from 238 ms to 613 ms; seeing the blow-up takes many
    # more requests per rate, at rates near the server's capacity.
    # A real engine batches (several requests are served at once, so it is closer to M/M/c or a batch queue)
    # and its service times are not exponential, but the 1 / (1 - rho) blow-up near saturation is the same.


def max_rate_under_slo(service_rate: float, p99_slo: float) -> float:
    """Exercise 4: Predict p99 from the arrival rate"""
    # ln(100) / (mu - lambda) <= slo  <=>  lambda <= mu - ln(100) / slo
    return max(0.0, service_rate - math.log(100) / p99_slo)
