"""Lesson 13: the OpenAI-compatible server over the continuous-batching engine.

References: `generate` run alone on the same model (what every greedy or seeded answer
must equal, streamed or not, alone or among concurrent requests), the engine's own
block counts (a client that disconnects, or a request that times out, must leave every
block free), and OpenAI's documented error shape (every bad request gets a 4xx JSON
error and the server keeps answering).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from minillm.decoding.sampling import SamplingConfig
from minillm.model.tiny import tiny_pair
from minillm.serving.launch import BackgroundServer
from minillm.serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompts,
    max_new_tokens,
    sampling_config,
)
from minillm.strategies.generate import generate

CONTEXT = 256


@pytest.fixture(scope="module")
def tiny_model(default_model):
    """A tiny random Llama over the default model's tokenizer: real text in and out, fast forwards."""
    _, tokenizer = default_model
    _, model = tiny_pair("llama", seed=3, vocab_size=49152, context_length=CONTEXT)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    model, tokenizer = tiny_model
    with BackgroundServer(model, tokenizer, model_name="tiny", max_waiting=12, max_num_seqs=4, num_blocks=64,
                          block_size=8, max_body_bytes=4096) as server:
        yield server


def client_for(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def solo(model, tokenizer, prompt: str, **settings) -> str:
    config = SamplingConfig(**settings)
    return generate(model, prompt, config, tokenizer=tokenizer).rows[0].text


def wait_until_idle(server, timeout: float = 10.0) -> dict:
    """The engine's counters once nothing is held; fails if requests or blocks stay held."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(server.url + "/stats").json()
        if stats["requests_held"] == 0 and stats["blocks_free"] == stats["blocks_total"]:
            return stats
        assert time.monotonic() < deadline, f"requests or blocks still held: {stats}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- the real model

def test_openai_client_unchanged_on_the_default_model(default_model):
    """completions and chat, streaming and not, through the official client, equal `generate`."""
    model, tokenizer = default_model
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected_chat = solo(model, tokenizer, tokenizer.apply_chat_template(question), max_new_tokens=12)
    expected_text = solo(model, tokenizer, "The three primary colours are", max_new_tokens=12)
    with BackgroundServer(model, tokenizer, kv_cache_mb=32) as server:
        client = client_for(server)
        assert [m.id for m in client.models.list()] == ["default"]
        chat = client.chat.completions.create(model="default", messages=question, temperature=0, max_tokens=12)
        assert chat.choices[0].message.content == expected_chat == "The capital of France is Paris."
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(question)))
        stream = client.chat.completions.create(model="default", messages=question, temperature=0, max_tokens=12,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_chat
        text = client.completions.create(model="default", prompt="The three primary colours are", temperature=0,
                                         max_tokens=12)
        assert text.choices[0].text == expected_text and text.choices[0].finish_reason == "length"
        assert text.usage.completion_tokens == 12
        pieces = client.completions.create(model="default", prompt="The three primary colours are", temperature=0,
                                           max_tokens=12, stream=True)
        assert "".join(c.choices[0].text for c in pieces) == expected_text
        wait_until_idle(server)


# ---------------------------------------------------------------------------------------------- exactness

def test_streamed_equals_non_streamed_for_the_same_seed(tiny_server):
    client = client_for(tiny_server)
    settings = dict(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    whole = client.completions.create(**settings).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**settings, stream=True))
    assert streamed == whole and whole


def test_seeded_choices_equal_generate_with_seed_plus_index(tiny_server, tiny_model):
    model, tokenizer = tiny_model
    answer = client_for(tiny_server).completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=1.1,
                                                       seed=5, n=3, extra_body={"top_k": 20})  # an extra
    expected = [solo(model, tokenizer, "Hello", max_new_tokens=10, do_sample=True, temperature=1.1, top_k=20,
                     seed=5 + i) for i in range(3)]
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == expected
    assert len(set(expected)) > 1  # the seeds differ, so the choices do
    assert answer.usage.prompt_tokens == len(tokenizer.encode("Hello"))  # once, not once per choice


def test_logit_bias_is_applied_as_openai_defines_it(tiny_server, tiny_model):
    """logit_bias (token id as a string -> -100..100) reaches the sampler: +100 forces a token at every step, and
    a request with it equals generate with the same bias."""
    model, tokenizer = tiny_model
    client = client_for(tiny_server)
    forced = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={"42": 100})
    assert tokenizer.encode(forced.choices[0].text) == tokenizer.encode(tokenizer.decode([42] * 5))
    nudged = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0.8, seed=3,
                                       logit_bias={"42": 3, "7": -100})
    assert nudged.choices[0].text == solo(model, tokenizer, "Hello", max_new_tokens=8, do_sample=True,
                                          temperature=0.8, seed=3, logit_bias={42: 3, 7: -100})


def test_concurrent_greedy_requests_each_equal_their_solo_output(tiny_server, tiny_model):
    model, tokenizer = tiny_model
    prompts = [f"Request {i}: " + "word " * (3 * i) for i in range(10)]  # more than max_num_seqs: some wait
    expected = [solo(model, tokenizer, p, max_new_tokens=8 + i) for i, p in enumerate(prompts)]

    async def one(http, i, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8 + i, "temperature": 0, "stream": i % 2 == 0}
        if not body["stream"]:
            return (await http.post("/completions", json=body)).json()["choices"][0]["text"]
        text = ""
        async with http.stream("POST", "/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_at_once():
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=60) as http:
            return await asyncio.gather(*(one(http, i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(all_at_once()) == expected
    wait_until_idle(tiny_server)


def test_beam_search_through_the_server_equals_the_package(tiny_server, tiny_model):
    """use_beam_search (vLLM's extra): n beams, the n best returned, through the engine one token a step; the same
    hypotheses as the package's beam_search (itself checked against transformers' in lesson 10), for completions
    of two prompts and for chat, and nothing held afterwards."""
    from minillm.strategies.beam import beam_search

    model, tokenizer = tiny_model
    client = client_for(tiny_server)
    prompts = ["The capital of France is", "Once upon a time"]
    before = len(tiny_server.engine.timeline)
    answer = client.completions.create(model="tiny", prompt=prompts, max_tokens=9, n=3,
                                       extra_body={"use_beam_search": True, "length_penalty": 0.5})
    expected = beam_search(model, prompts, tokenizer=tokenizer, num_beams=3, num_return_sequences=3,
                           max_new_tokens=9, length_penalty=0.5)
    assert [c.text for c in answer.choices] == [row.text for row in expected.rows]
    assert [c.index for c in answer.choices] == list(range(6))
    assert answer.usage.completion_tokens == sum(len(row.token_ids) for row in expected.rows)
    # Each beam forks the request it extends and feeds one token: every step's requests fed one token each, but
    # for the prompts' own first forwards.
    steps = tiny_server.engine.timeline[before:]
    fed = sum(step.prefill_tokens + step.decode_tokens for step in steps)
    assert fed == sum(len(step.requests) for step in steps) + sum(len(tokenizer.encode(p)) - 1 for p in prompts)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          n=2, extra_body={"use_beam_search": True, "early_stopping": "never"})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    expected = beam_search(model, [tokenizer.encode(prompt)], tokenizer=tokenizer, num_beams=2,
                           num_return_sequences=2, max_new_tokens=6, early_stopping="never")
    assert [c.message.content for c in chat.choices] == [row.text for row in expected.rows]
    wait_until_idle(tiny_server)


@pytest.mark.parametrize("extra,param", [({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"),
                                         ({"logprobs": 2}, "logprobs"), ({"n": 0}, "n"),
                                         ({"repetition_penalty": 1.3}, None)])
def test_beam_search_refuses_what_it_cannot_honour(tiny_server, extra, param):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra}
    response = httpx.post(tiny_server.base_url + "/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]


def test_stream_format_and_usage_chunk(tiny_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", tiny_server.base_url + "/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1


# ---------------------------------------------------------------------------------------------- freeing blocks

@pytest.fixture
def slow_server(tiny_model):
    """Each engine step takes 20 ms longer: time for a client to leave mid-stream, or for a deadline to pass."""
    model, tokenizer = tiny_model
    with BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=64, block_size=8,
                          request_timeout=0.5) as server:
        step = server.engine.step
        server.engine.step = lambda: (time.sleep(0.02), step())[1]
        yield server


def test_a_disconnect_mid_stream_aborts_and_frees_the_blocks(slow_server):
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", slow_server.base_url + "/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        held = httpx.get(slow_server.url + "/stats").json()
        assert held["requests_held"] == 1 and held["blocks_free"] < held["blocks_total"]
    # leaving the `with` closed the connection, mid-stream
    stats = wait_until_idle(slow_server)
    assert stats["requests_aborted"] == 1


def test_the_time_limit_ends_a_request_as_length_and_frees_its_blocks(slow_server):
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0}
    answer = httpx.post(slow_server.base_url + "/completions", json=body, timeout=30).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert 0 < answer["usage"]["completion_tokens"] < 200
    wait_until_idle(slow_server)


# ---------------------------------------------------------------------------------------------- bad requests

LONG = "word " * 300  # over the tiny model's 256-token context

BAD_REQUESTS = {  # name: (path, body (bytes are sent raw), status, param)
    "malformed JSON": ("/v1/completions", b'{"prompt": "x",', 400, None),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None),
    "missing prompt": ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    "wrong type": ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    "negative temperature": ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    "top_p zero": ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    "penalty out of range": ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    "negative max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": -2}, 400, "max_tokens"),
    "n zero": ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    "unsupported best_of": ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    "logprobs over 5": ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    "logit_bias key not a token id": ("/v1/completions", {"prompt": "x", "logit_bias": {"the": 5}}, 400, "logit_bias"),
    "logit_bias over 100": ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "logit_bias outside the vocabulary": ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400,
                                          "logit_bias"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                               "top_logprobs": 2}, 400, "top_logprobs"),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [5, 10**6]}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "unknown model": ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    "prompt over the context": ("/v1/completions", {"prompt": LONG}, 400, None),
    "answer over the context": ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    "oversized body": ("/v1/completions", {"prompt": "x" * 5000}, 413, None),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    "stop of the wrong type": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "stop": 5}, 400, "stop"),
    "queue full": ("/v1/completions", {"prompt": "x", "n": 13, "max_tokens": 1}, 503, None),
    "unknown route": ("/v1/embeddings", {"input": "x"}, 404, None),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(tiny_server, name):
    path, body, status, param = BAD_REQUESTS[name]
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(tiny_server.url + path, headers={"Content-Type": "application/json"}, **sent)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    if status == 503:
        assert response.headers["retry-after"] == "1"
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}


def test_a_wrong_method_is_405(tiny_server):
    response = httpx.get(tiny_server.base_url + "/completions")
    assert response.status_code == 405 and "POST" not in response.json()["error"]["message"].split()[:1]


def test_short_soak_of_good_bad_and_abandoned_requests(tiny_server):
    """Well-formed requests all succeed, bad ones all get 4xx, and nothing is left held afterwards."""
    rng = random.Random(0)
    bad = [spec for spec in BAD_REQUESTS.values() if spec[2] != 503]

    async def one(http, i):
        kind = rng.choice(["good", "good", "stream", "abandon", "bad"])
        if kind == "bad":
            path, body, status, _ = rng.choice(bad)
            sent = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = await http.post(path.removeprefix("/v1"), headers={"Content-Type": "application/json"}, **sent)
            return kind, response.status_code == status
        body = {"model": "tiny", "prompt": f"Soak {i}", "max_tokens": rng.randint(1, 30), "temperature": 0.8,
                "seed": i, "stream": kind != "good"}
        while True:  # a well-behaved client retries a 503 after its Retry-After, as OpenAI's client does
            async with http.stream("POST", "/completions", json=body) as response:
                if response.status_code == 503:
                    await asyncio.sleep(float(response.headers["retry-after"]) / 10)  # a test need not wait 1 s
                    continue
                if kind == "good":
                    answer = json.loads(await response.aread())
                    return kind, response.status_code == 200 and answer["choices"][0]["finish_reason"] is not None
                async for line in response.aiter_lines():
                    if kind == "abandon" and line:
                        return kind, True  # leave mid-stream
                    if line == "data: [DONE]":
                        return kind, response.status_code == 200
                return kind, False

    async def soak():
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(40)))

    outcomes = asyncio.run(soak())
    assert all(ok for _, ok in outcomes), [kind for kind, ok in outcomes if not ok]
    assert {kind for kind, _ in outcomes} == {"good", "stream", "abandon", "bad"}
    wait_until_idle(tiny_server)


def test_an_engine_failure_fails_the_requests_in_flight_and_the_server_goes_on(tiny_model):
    model, tokenizer = tiny_model
    with BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=64, block_size=8) as server:
        step = server.engine.step
        failures = iter([True])

        def failing_once():
            if next(failures, False):
                raise RuntimeError("a simulated bug")
            return step()

        server.engine.step = failing_once
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        broken = httpx.post(server.base_url + "/completions", json=body)
        assert broken.status_code == 500 and "a simulated bug" in broken.json()["error"]["message"]
        assert broken.json()["error"]["type"] == "server_error"
        wait_until_idle(server)
        fine = httpx.post(server.base_url + "/completions", json=body)
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 5


def scrape(server) -> tuple[dict, dict]:
    """/metrics read with Prometheus' own parser: ({family name: its type}, {(sample name, labels): value})."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    types, samples = {}, {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, samples


METRIC_TYPES = {"minillm_requests_waiting": "gauge", "minillm_requests_running": "gauge",
                "minillm_kv_blocks_used": "gauge", "minillm_kv_blocks_total": "gauge",
                "minillm_prefix_cache_hit_rate": "gauge", "minillm_prompt_tokens": "counter",
                "minillm_generation_tokens": "counter", "minillm_requests_finished": "counter",
                "minillm_time_to_first_token_seconds": "histogram",
                "minillm_time_per_output_token_seconds": "histogram",
                "minillm_e2e_request_latency_seconds": "histogram"}


def test_metrics_count_what_the_requests_did_in_prometheus_format(tiny_model):
    """/metrics parses with Prometheus' own parser, names and types as documented (lesson 13), and between two
    scrapes its counters move by exactly what the responses reported: tokens in and out (usage), requests by finish
    reason, one latency sample per request; the gauges read the engine itself (its idle pool, the hit rate /stats
    reports)."""
    model, tokenizer = tiny_model
    with BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=64, block_size=8) as server:
        types, before = scrape(server)
        client = client_for(server)
        story = "Once upon a time there was a lighthouse keeper who counted ships"  # full blocks of 8, sent twice
        usages = [client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).usage
                  for prompt, n in ((story, 5), (story, 2), ("The capital of France is", 3))]
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage)
        stats = wait_until_idle(server)
        _, after = scrape(server)
    # prometheus_client also writes each counter's and histogram's start time as a `<name>_created` gauge
    assert {name: kind for name, kind in types.items() if not name.endswith("_created")} == METRIC_TYPES

    def value(samples, name, **labels):
        return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("minillm_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("minillm_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 5 + 2 + 3 + 4
    assert moved("minillm_requests_finished_total", finish_reason="length") == 4
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"minillm_{name}_count") == 4 and moved(f"minillm_{name}_sum") > 0
        assert value(after, f"minillm_{name}_bucket", le="+Inf") == 4
    assert value(after, "minillm_requests_waiting") == value(after, "minillm_requests_running") == 0
    assert value(after, "minillm_kv_blocks_used") == 0 and value(after, "minillm_kv_blocks_total") == 64
    assert value(after, "minillm_prefix_cache_hit_rate") == stats["prefix_hit_rate"] > 0  # the story's second time


def test_each_server_counts_in_its_own_registry(tiny_model):
    """Two servers of one model in one process (tests, a notebook) neither collide nor share counts: each app has
    its own CollectorRegistry, never prometheus_client's global one."""
    from prometheus_client import REGISTRY

    model, tokenizer = tiny_model
    with BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=32, block_size=8) as first, \
            BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=32, block_size=8) as second:
        client_for(first).completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        wait_until_idle(first)
        counted = {server: scrape(server)[1][("minillm_generation_tokens_total", (("model_name", "tiny"),))]
                   for server in (first, second)}
    assert counted == {first: 3, second: 0}
    assert REGISTRY.get_sample_value("minillm_generation_tokens_total", {"model_name": "tiny"}) is None


def test_release_forgets_only_finished_requests(tiny_model):
    from minillm.runtime.engine import Engine

    model, tokenizer = tiny_model
    engine = Engine(model, tokenizer, num_blocks=16, block_size=8)
    request = engine.add_request("Hello", max_new_tokens=3)
    with pytest.raises(ValueError, match="still running"):
        engine.release(request)
    while engine.has_unfinished():
        engine.step()
    assert engine.release(request).token_ids == generate(model, "Hello", tokenizer=tokenizer,
                                                          max_new_tokens=3).rows[0].token_ids
    assert engine.requests == {} and engine.manager.num_free == 16
    with pytest.raises(ValueError, match="unknown request"):
        engine.output(request)


# ---------------------------------------------------------------------------------------------- the mapping

def test_openai_parameters_map_onto_sampling_config():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.7, top_p=0.9, seed=3,
                                 stop="END", presence_penalty=0.5, frequency_penalty=-0.5, top_k=40, min_p=0.05,
                                 repetition_penalty=1.1)
    config = sampling_config(body, max_new=20, choice=2)
    assert config == SamplingConfig(max_new_tokens=20, stop=("END",), do_sample=True, temperature=0.7, top_p=0.9,
                                    seed=5, presence_penalty=0.5, frequency_penalty=-0.5, top_k=40, min_p=0.05,
                                    repetition_penalty=1.1)
    assert sampling_config(CompletionRequest(prompt="x", temperature=0), 4).greedy
    assert not sampling_config(CompletionRequest(prompt="x"), 4).greedy  # OpenAI samples by default


def test_max_tokens_defaults_and_limits():
    assert max_new_tokens(CompletionRequest(prompt="x"), 10, 100) == 16  # OpenAI's completions default
    assert max_new_tokens(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), 10, 100) == 90
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=50, max_completion_tokens=7)
    assert max_new_tokens(chat, 10, 100) == 7  # the newer name wins
    with pytest.raises(APIError, match="maximum context length is 100"):
        max_new_tokens(CompletionRequest(prompt="x", max_tokens=95), 10, 100)


def test_the_four_prompt_forms(default_model):
    _, tokenizer = default_model
    ids = tokenizer.encode("Hello there")
    assert completion_prompts("Hello there", tokenizer) == [ids]
    assert completion_prompts(["Hello there", "Hi"], tokenizer) == [ids, tokenizer.encode("Hi")]
    assert completion_prompts(ids, tokenizer) == [ids]
    assert completion_prompts([ids, [1, 2]], tokenizer) == [ids, [1, 2]]


# ---------------------------------------------------------------------------------------------- command lines

def test_serve_command_line_errors_are_one_line(capsys):
    from minillm.serve import main
    from minillm.serving.launch import bind

    assert main(["--port", "70000"]) == 2
    taken = bind("127.0.0.1", 0)
    try:
        assert main(["--port", str(taken.getsockname()[1])]) == 2  # refused before the model loads
    finally:
        taken.close()
    assert main(["--max-num-seqs", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("minillm: error: ") for line in lines), lines
    assert "--port 70000" in lines[0] and "Pick another --port" in lines[1] and "--max-num-seqs 0" in lines[2]


def start_serve_command() -> tuple[subprocess.Popen, int]:
    """`python -m minillm.serve --eager` on a free port, and the port, once it answers (output piped for checks)."""
    from minillm.base.ports import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "minillm.serve", "--eager", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert process.poll() is None, process.communicate()[1][-2000:]
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                return process, port
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
    except BaseException:
        process.kill()
        raise


@pytest.mark.real_model
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_serve_command_answers_then_stops_on_a_signal(stop):
    """`python -m minillm.serve` runs its engine on the main thread and HTTP on another: it answers, SIGTERM
    ends it cleanly (exit 0) and Ctrl-C in one line (exit 130), never a traceback."""
    process, port = start_serve_command()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
        assert answer.usage.completion_tokens == 4
        process.send_signal(getattr(signal, stop))
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "Traceback" not in err
    if stop == "SIGTERM":
        assert process.returncode == 0, err[-2000:]
    else:
        assert process.returncode == 130 and err.strip().endswith("minillm: interrupted"), err[-2000:]


@pytest.mark.real_model
def test_serve_command_stops_on_sigterm_while_a_schema_compiles():
    """A request whose schema takes seconds to compile (here: until it hits the automaton's limits) must not hold
    the server up: SIGTERM ends it cleanly while the compile runs, and the compile stops with its request."""
    import threading

    process, port = start_serve_command()
    try:
        schema = {"type": "array", "items": {"type": "string", "maxLength": 1500}}  # tens of thousands of states
        body = {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
        request = threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                                             json=body, timeout=60), daemon=True)
        request.start()
        time.sleep(0.5)  # the compile is under way
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert "Traceback" not in err and process.returncode == 0, err[-2000:]


def test_loadtest_command_line_measures_a_server(default_model, capsys):
    from minillm.serving.loadtest import main

    _, tokenizer = default_model
    _, model = tiny_pair("llama", seed=3, vocab_size=49152, context_length=1024)  # room for the workload's prompts
    with BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=256, block_size=16) as server:
        assert main(["--base-url", server.base_url, "--model", "tiny", "--num-requests", "4", "--concurrency", "2",
                     "--json"]) == 0
        wait_until_idle(server)
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["requests"] == 4 and metrics["failed"] == 0 and metrics["statuses"] == [200]
    assert metrics["output_tokens"] > 0 and metrics["ttft"]["p50"] > 0


def test_notebook_runs(run_notebook):
    run_notebook("13_serving.ipynb", timeout=600)
