"""Worked solutions to lesson 13's exercises (`pytest lessons/13-serving --solutions` checks them)."""

from __future__ import annotations

import json

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
