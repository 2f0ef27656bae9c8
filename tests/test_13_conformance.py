"""Lesson 13: does a server speak OpenAI's API as clients expect? Checked from the client's side only.

The same checks run against minillm's own server (always) and against any other
OpenAI-compatible server named by an environment variable (skipped when unset):

    MINILLM_CONFORMANCE_URL=http://127.0.0.1:8080/v1 pytest tests/test_13_conformance.py
    MINILLM_CONFORMANCE_MODEL=...   # the model to ask for (default: the first one /v1/models lists)

so a learner can point them at vLLM or llama.cpp's server. They also run against
llama.cpp's server on the default model's own GGUF (llama-cpp-python's
`python -m llama_cpp.server`, started here; slow; skipped with the reason when it does
not import), where the places it departs from OpenAI's API are listed and expected to
fail (`LLAMA_CPP_GAPS`: strict, so a fix upstream shows). Greedy requests (temperature
0) are the reference for each other: streamed text must equal the non-streamed text,
and a stop string must cut exactly where the text had it. Lesson 13's load test runs
against each at a small load.
"""

from __future__ import annotations

import asyncio
import math
import os

import httpx
import pytest
import torch
from openai import OpenAI

from minillm.model.tiny import tiny_pair
from minillm.serving.launch import BackgroundServer
from minillm.serving.loadtest import chat_workload, run_load, summarize

QUESTION = [{"role": "user", "content": "Name three colours and say why you like them."}]
# Where llama-cpp-python's server (0.3.36) departs from OpenAI's API, as these checks found it
LLAMA_CPP_GAPS = {
    "test_streamed_chat_equals_the_whole_answer": "ignores stream_options.include_usage: a stream has no usage chunk",
    "test_a_malformed_request_is_a_4xx_json_error": "answers a malformed body (messages not a list) with a 500",
}


@pytest.fixture(scope="module", params=["minillm", "external", pytest.param("llama.cpp", marks=pytest.mark.slow)])
def target(request):
    """(client, model name, base URL) of the server under test."""
    if request.param == "llama.cpp":
        from minillm.bench.llama_cpp import server_missing_reason, server_process
        from minillm.speed.quant_gguf import gguf_path_for

        reason = server_missing_reason()
        if reason is not None:
            pytest.skip(f"llama.cpp's server: {reason}")
        with server_process(gguf_path_for("default"), torch.get_num_threads()) as server:
            yield OpenAI(base_url=server.base_url, api_key="unused", max_retries=0), "default", server.base_url
        return
    if request.param == "external":
        url = os.environ.get("MINILLM_CONFORMANCE_URL")
        if not url:
            pytest.skip("set MINILLM_CONFORMANCE_URL to a server's /v1 URL to check it")
        client = OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)
        model = os.environ.get("MINILLM_CONFORMANCE_MODEL") or client.models.list().data[0].id
        yield client, model, url
        return
    _, tokenizer = request.getfixturevalue("default_model")
    _, model = tiny_pair("llama", seed=4, vocab_size=49152, context_length=256)  # real tokenizer, tiny random weights
    with BackgroundServer(model, tokenizer, model_name="tiny", num_blocks=64, block_size=8) as server:
        yield OpenAI(base_url=server.base_url, api_key="unused", max_retries=0), "tiny", server.base_url


@pytest.fixture(autouse=True)
def known_gaps(request):
    """A check llama-cpp-python's server is known to fail is expected to fail there (strict: a fix shows)."""
    callspec = getattr(request.node, "callspec", None)
    gap = LLAMA_CPP_GAPS.get(request.node.originalname)
    if gap and callspec is not None and callspec.params.get("target") == "llama.cpp":
        request.node.add_marker(pytest.mark.xfail(reason=f"llama-cpp-python's server {gap}", strict=True))


def test_models_lists_the_model(target):
    client, model, _ = target
    assert model in [m.id for m in client.models.list()]


def test_chat_answer_and_usage(target):
    client, model, _ = target
    answer = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
    choice = answer.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    u = answer.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_streamed_chat_equals_the_whole_answer(target):
    client, model, _ = target
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1


def test_streamed_completion_equals_the_whole_completion(target):
    client, model, _ = target
    settings = dict(model=model, prompt="The weather today is", temperature=0, max_tokens=12)
    whole = client.completions.create(**settings)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**settings, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_max_tokens_is_a_hard_limit(target):
    client, model, _ = target
    answer = client.completions.create(model=model, prompt="Count: one, two,", temperature=0, max_tokens=1)
    assert answer.usage.completion_tokens <= 1 and answer.choices[0].finish_reason in ("length", "stop")


def test_a_stop_string_cuts_the_text_where_it_first_appears(target):
    client, model, _ = target
    settings = dict(model=model, prompt="Once upon a time", temperature=0, max_tokens=24)
    text = client.completions.create(**settings).choices[0].text
    words = text.split()
    if len(words) < 3:
        pytest.skip(f"the greedy text {text!r} is too short to pick a stop string from")
    stop = words[len(words) // 2]
    cut = client.completions.create(**settings, stop=[stop]).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"


def test_a_malformed_request_is_a_4xx_json_error(target):
    _, model, url = target
    response = httpx.post(url + "/chat/completions", json={"model": model, "messages": "not a list"})
    assert 400 <= response.status_code < 500
    assert isinstance(response.json(), dict)


def test_the_load_test_measures_the_server(target):
    """Lesson 13's load test at a small load: every request streams exactly the tokens it asked for (EOS ignored
    through `ignore_eos` or `min_tokens`), none fails, and each is timed."""
    _, model, url = target
    workload = chat_workload(4, math.inf, seed=0, outputs=((8, 8), (8, 8), 0.0))
    metrics = summarize(asyncio.run(run_load(url, model, workload, concurrency=2)), slo_ttft=2.0, slo_tpot=0.25)
    assert metrics["failed"] == 0 and metrics["output_tokens"] == 4 * 8, metrics
    assert metrics["ttft"]["p50"] > 0 and metrics["tpot"]["p50"] > 0 and metrics["tokens_per_second"] > 0
