"""Checks for lesson 13's exercises: `pytest lessons/13-serving` (yours) or `--solutions`.

References: the package's own SSE encoder (`minillm.serving.http.sse`), the WHATWG event-stream rules case by case,
the `openai` client's SSE decoder on random streams written field by field, a real stream from the
package's server (on a tiny random model with the default model's tokenizer), the package's own parameter mapping
(`minillm.serving.openai_api.sampling_config`), Prometheus' documented `histogram_quantile` rule case by case and a
real scrape of the server's metrics against the samples' exact quantiles, and a simulated M/M/1 queue for the p99
predictions.
"""

from __future__ import annotations

import json
import math
import random

import httpx
import numpy as np
import pytest

from minillm.serving.openai_api import CompletionRequest, sampling_config


def cuts(stream: bytes, rng: random.Random, random_splits: int = 20):
    """The same stream as the network may deliver it: whole, cut once at every byte, one byte at a time, and cut at
    random places (empty chunks included)."""
    yield [stream]
    for i in range(1, len(stream)):
        yield [stream[:i], stream[i:]]
    yield [stream[i:i + 1] for i in range(len(stream))]
    for _ in range(random_splits):
        points = sorted(rng.randint(0, len(stream)) for _ in range(rng.randint(1, 12)))
        yield [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)])]


def decode(answers, chunks):
    return list(answers.sse_data(iter(chunks)))


def test_exercise_1_decodes_the_package_encoder(answers):
    import asyncio

    from minillm.serving.http import sse

    texts = ("Hel", "lo", " \n\nworld", "é日")  # JSON escapes the newlines (and, by default, the non-ASCII)
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
    chunks += [{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, {"choices": [], "usage": {}}]

    async def written():  # what the server writes for these chunks, then `data: [DONE]`
        async def source():
            for chunk in chunks:
                yield chunk
        return [text async for text in sse(source(), on_close=lambda: None)]

    stream = "".join(asyncio.run(written())).encode() + b"data: {\"after\": \"[DONE]\"}\n\n"
    for pieces in cuts(stream, random.Random(0)):
        assert [json.loads(d) for d in decode(answers, pieces)] == chunks, [len(p) for p in pieces]


RULES = {  # the WHATWG event-stream rules, one case each: stream -> the data of its events
    "one event": (b"data: a\n\n", ["a"]),
    "crlf line ends": (b"data: a\r\n\r\ndata: b\r\n\r\n", ["a", "b"]),
    "cr line ends": (b"data: a\r\rdata: b\r\r", ["a", "b"]),
    "multi-line data, crlf": (b"data: first\r\ndata: second\r\n\r\n", ["first\nsecond"]),
    "multi-line data, mixed ends": (b"data: 1\rdata: 2\ndata: 3\r\n\n", ["1\n2\n3"]),
    "comments": (b": keep-alive\n\ndata: x\n: in the middle\ndata: y\n\n:last\n\n", ["x\ny"]),
    "one space stripped, only one": (b"data:none\n\ndata:  two\n\ndata:\ttab\n\n", ["none", " two", "\ttab"]),
    "colons in the value": (b'data: {"a": "b:c"}\n\n', ['{"a": "b:c"}']),
    "empty data is still an event": (b"data\n\ndata:\n\ndata: \n\n", ["", "", ""]),
    "other fields ignored": (b"event: delta\nid: 7\nretry: 100\nDATA: no\ndatum: no\ndata: z\n\n", ["z"]),
    "no data, no event": (b"event: ping\n\nretry: 5\n\n\n\ndata: w\n\n", ["w"]),
    "cut off at the end": (b"data: a\n\ndata: never ended\n", ["a"]),
    "done stops": (b"data: a\n\ndata: [DONE]\n\ndata: after\n\n", ["a"]),
    "utf-8": ("data: é日🙂\r\n\r\n".encode(), ["é日🙂"]),
}


@pytest.mark.parametrize("case", RULES)
def test_exercise_1_the_rules_by_hand(answers, case):
    stream, expected = RULES[case]
    for pieces in cuts(stream, random.Random(case)):
        assert decode(answers, pieces) == expected, pieces


def test_exercise_1_each_event_as_soon_as_it_ends(answers):
    pieces = [b"data: one\n", b"\n", b"data: two\r", b"\n\r\n", b": ping\n\ndata: [DO", b"NE]\n\n", b"data: late\n\n"]
    read = []

    def arriving():  # the network: each piece arrives only when the decoder asks for more
        for i, piece in enumerate(pieces):
            read.append(i)
            yield piece

    seen = [(data, len(read)) for data in answers.sse_data(arriving())]
    assert seen == [("one", 2), ("two", 4)], "each event is yielded before the next piece is read"
    assert len(read) == 6, "nothing is read after the piece that ended [DONE]"


def random_stream(rng: random.Random) -> tuple[bytes, list[str]]:
    """A random event stream and the data of its events, written field by field: multi-line data with and without
    the space after the colon, comments, fields a decoder ignores, events with no data, any of the three line ends,
    sometimes a [DONE] with an event after it."""

    def text():
        return "".join(rng.choice("ab :é日🙂{}\"[]") for _ in range(rng.randint(0, 6)))

    stream, expected = b"", []
    for _ in range(rng.randint(1, 5)):
        sep = rng.choice(["\n", "\r\n", "\r"])
        values, lines = [text() for _ in range(rng.choice([0, 1, 1, 2, 3]))], []
        for value in values:
            if rng.random() < 0.3:
                lines.append(":" + text())
            if rng.random() < 0.2:
                lines.append(rng.choice(["event: delta", "retry: 10", "dat: x", "Data: x"]))
            no_space = rng.random() < 0.5 and not value.startswith(" ")  # "data:" + " x" would lose the space
            lines.append(("data:" if no_space else "data: ") + value)
        if not values:
            lines.append(":" + text())  # a block with no data: nothing is dispatched
        stream += (sep.join(lines) + sep * rng.randint(2, 3)).encode()
        if values:
            expected.append("\n".join(values))
    if rng.random() < 0.3:
        stream += b"data: [DONE]\n\ndata: after\n\n"
    return stream, expected


def test_exercise_1_agrees_with_the_openai_clients_decoder(answers):
    streaming = pytest.importorskip("openai._streaming")  # the official client's own WHATWG decoder
    rng = random.Random(1)
    for _ in range(150):
        stream, expected = random_stream(rng)
        theirs = [event.data for event in streaming.SSEDecoder().iter_bytes(iter([stream]))]
        theirs = theirs[:theirs.index("[DONE]")] if "[DONE]" in theirs else theirs
        assert theirs == expected, stream  # the stream and its expected data agree with the client's decoder
        points = sorted(rng.randint(0, len(stream)) for _ in range(rng.randint(1, 8)))
        for pieces in ([stream], [stream[i:i + 1] for i in range(len(stream))],
                       [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)])]):
            assert decode(answers, pieces) == expected, (stream, pieces)


def test_exercise_1_a_real_stream_decodes_to_the_whole_answer(answers):
    from minillm.model.tiny import tiny_pair
    from minillm.serving.launch import BackgroundServer
    from minillm.speed.load import load_model

    list(answers.sse_data(iter([b"data: [DONE]\n\n"])))  # skips here, before loading anything, until you answer
    _, tokenizer = load_model("default")
    _, model = tiny_pair("llama", seed=2, vocab_size=49152, context_length=128)
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0.8, "seed": 3}
    with BackgroundServer(model, tokenizer, num_blocks=32, block_size=8) as server:
        whole = httpx.post(server.base_url + "/completions", json=body).json()["choices"][0]["text"]
        with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as response:
            arrived = list(response.iter_raw())  # the body's bytes, cut where the network cut them
    stream = b"".join(arrived)
    for pieces in (arrived, [stream[i:i + 5] for i in range(0, len(stream), 5)]):
        chunks = [json.loads(data) for data in decode(answers, pieces)]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole


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


# Prometheus' histogram_quantile, case by case from its documented rule (promql/quantile.go's bucketQuantile): the
# rank q · total, the first bucket whose cumulative count reaches it, linear inside it from the bucket below's bound
# (0 under the first), the largest finite bound for a rank in +Inf, NaN without observations.
BUCKETS = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
CASES = [(0.5, BUCKETS, 0.3), (0.99, BUCKETS, 0.98), (0.05, BUCKETS, 0.02), (0.25, BUCKETS, 0.1), (1.0, BUCKETS, 1.0),
         (0.0, BUCKETS, 0.0), (0.99, [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 50.0)], 1.0),
         (0.9, [(0.1, 0.0), (0.5, 0.0), (2.0, 8.0), (math.inf, 8.0)], 1.85)]


@pytest.mark.parametrize("q, buckets, expected", CASES)
def test_exercise_3_histogram_quantile_follows_prometheus(answers, q, buckets, expected):
    assert answers.histogram_quantile(q, buckets) == pytest.approx(expected)


def test_exercise_3_no_observations_have_no_quantile(answers):
    assert math.isnan(answers.histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))


def test_exercise_3_a_real_scrape_puts_p50_and_p99_in_the_true_quantiles_bucket(answers):
    """The server's own metrics fed 2,000 lognormal TTFTs and scraped as /metrics writes them: each estimate lies in
    the bucket that holds the samples' exact quantile (the most a histogram can say)."""
    from minillm.serving.metrics import REQUEST_BUCKETS, ServerMetrics

    metrics = ServerMetrics("m")
    samples = np.random.default_rng(3).lognormal(mean=-1.0, sigma=1.0, size=2000)
    for ttft in samples:
        metrics.time_to_first_token.observe(float(ttft))
    text = metrics.render({"requests_waiting": 0, "requests_running": 0, "blocks_total": 8, "blocks_free": 8,
                           "prefix_hit_rate": 0.0}).decode()
    edges = [0.0, *REQUEST_BUCKETS]
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(samples, q))
        low, high = next((a, b) for a, b in zip(edges, edges[1:]) if a < exact <= b)
        estimate = answers.quantile_from_scrape(text, "minillm_time_to_first_token_seconds", q)
        assert low <= estimate <= high, (q, exact, estimate)


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
