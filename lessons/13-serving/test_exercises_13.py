"""Checks for lesson 13's exercises: `pytest lessons/13-serving` (yours) or `--solutions`.

References: JSON round trips and a real stream from the package's server (on a tiny random model with the default
model's tokenizer), the package's own parameter mapping (`minillm.serving.openai_api.sampling_config`), the load test's
`summarize`, a step-by-step simulation of a server's queue, and a simulated M/M/1 queue for the p99 predictions.
"""

from __future__ import annotations

import random

import httpx
import numpy as np
import pytest

from minillm.serving.loadtest import Outcome, summarize
from minillm.serving.openai_api import CompletionRequest, sampling_config


def test_exercise_1_events_round_trip(answers):
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("Hel", "lo", " \n\nworld", "")]
    stream = b"".join(answers.sse_encode(c) for c in chunks) + b"data: [DONE]\n\n"
    assert stream.count(b"\n\n") == len(chunks) + 1  # JSON escapes the newlines inside the text
    lines = stream.decode().split("\n")
    assert answers.sse_decode([": keep-alive", ""] + lines + ["data: {\"after\": 1}"]) == chunks


def test_exercise_1_a_real_stream_decodes_to_the_whole_answer(answers):
    from minillm.model.tiny import tiny_pair
    from minillm.serving.launch import BackgroundServer
    from minillm.speed.load import load_model

    answers.sse_decode(["data: [DONE]"])  # skips here, before loading anything, until you answer
    _, tokenizer = load_model("default")
    _, model = tiny_pair("llama", seed=2, vocab_size=49152, context_length=128)
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0.8, "seed": 3}
    with BackgroundServer(model, tokenizer, num_blocks=32, block_size=8) as server:
        whole = httpx.post(server.base_url + "/completions", json=body).json()["choices"][0]["text"]
        with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as response:
            lines = list(response.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in answers.sse_decode(lines)) == whole


def test_exercise_2_parameters_map_as_the_package_maps_them(answers):
    rng = random.Random(0)
    optional = {"temperature": lambda: rng.choice([0, 0.5, 1.3]), "top_p": lambda: rng.choice([0.5, 0.9, 1.0]),
                "seed": lambda: rng.randint(0, 99), "stop": lambda: rng.choice(["\n", ["END", "."]]),
                "presence_penalty": lambda: rng.uniform(-2, 2), "frequency_penalty": lambda: rng.uniform(-2, 2),
                "top_k": lambda: rng.randint(0, 50), "min_p": lambda: rng.choice([0.0, 0.1]),
                "repetition_penalty": lambda: rng.choice([1.0, 1.2])}
    for _ in range(50):
        body = {name: draw() for name, draw in optional.items() if rng.random() < 0.5}
        expected = sampling_config(CompletionRequest(prompt="x", **body), 20)
        assert answers.to_sampling_config(body, 20) == expected, body


def test_exercise_3_request_metrics_match_the_load_test(answers):
    rng = random.Random(1)
    for _ in range(20):
        sent = rng.uniform(0, 5)
        times = sorted(sent + rng.uniform(0.01, 3) for _ in range(rng.randint(1, 12)))
        end = times[-1] + rng.uniform(0, 0.1)
        tokens = len(times) + rng.randint(0, 3)
        outcome = Outcome(sent=sent, status=200, chunk_times=times, output_tokens=tokens, end=end)
        reference = summarize([outcome], slo_ttft=1.0, slo_tpot=1.0)
        mine = answers.request_metrics(sent, times, end, tokens)
        assert mine["ttft"] == pytest.approx(reference["ttft"]["p50"])
        if tokens > 1:
            assert mine["tpot"] == pytest.approx(reference["tpot"]["p50"])
        assert mine["itl"] == pytest.approx([b - a for a, b in zip(times, times[1:])])


def simulated_throughput(batch: int, step: float, lengths: list[int]) -> float:
    """Requests finished per second by a saturated server: every step, each of `batch` slots gets one token."""
    queue, slots, clock, done = list(lengths), [], 0.0, 0
    while queue or slots:
        while queue and len(slots) < batch:
            slots.append(queue.pop(0))
        clock += step
        slots = [left - 1 for left in slots]
        done += sum(left == 0 for left in slots)
        slots = [left for left in slots if left > 0]
    return done / clock


def test_exercise_3_littles_law_bounds_the_request_rate(answers):
    assert answers.max_request_rate(16, 0.1, 50) == pytest.approx(3.2)
    rng = random.Random(2)
    lengths = [rng.randint(20, 80) for _ in range(3000)]
    mean = sum(lengths) / len(lengths)
    simulated = simulated_throughput(8, 0.05, lengths)
    assert answers.max_request_rate(8, 0.05, mean) == pytest.approx(simulated, rel=0.02)


def simulated_p99(arrival_rate: float, service_rate: float, n: int = 200_000, seed: int = 0) -> float:
    """A first-come-first-served single-server queue, simulated request by request (Lindley's recursion)."""
    rng = np.random.default_rng(seed)
    gaps, services = rng.exponential(1 / arrival_rate, n), rng.exponential(1 / service_rate, n)
    wait, in_system = 0.0, np.empty(n)
    for i in range(n):  # wait_i = max(0, wait_{i-1} + service_{i-1} - gap_i)
        if i:
            wait = max(0.0, wait + services[i - 1] - gaps[i])
        in_system[i] = wait + services[i]
    return float(np.percentile(in_system[n // 10:], 99))  # the first tenth warms the queue up


@pytest.mark.parametrize("arrival_rate, service_rate", [(1.0, 4.0), (3.0, 5.0), (8.0, 10.0)])
def test_exercise_4_p99_matches_a_simulated_queue(answers, arrival_rate, service_rate):
    predicted = answers.p99_latency(arrival_rate, service_rate)
    simulated = simulated_p99(arrival_rate, service_rate)
    assert predicted == pytest.approx(simulated, rel=0.08), f"predicted {predicted:.3f} s, simulated {simulated:.3f} s"
    with pytest.raises(ValueError):
        answers.p99_latency(service_rate, service_rate)  # utilization 1: no steady state


def test_exercise_4_the_rate_an_slo_allows(answers):
    assert answers.max_rate_under_slo(10.0, 0.1) == 0  # even alone a request's p99 is ln(100) / 10 = 0.46 s
    rate = answers.max_rate_under_slo(10.0, 2.0)
    assert 0 < rate < 10.0
    assert simulated_p99(rate, 10.0) == pytest.approx(2.0, rel=0.08), "at that rate p99 sits at the objective"
    assert answers.p99_latency(rate, 10.0) == pytest.approx(2.0, rel=1e-9)
