"""Lesson 13: does a server speak OpenAI's API as clients expect? Checked from the client's side only.

The same checks run against minillm's own server (always) and against any other
OpenAI-compatible server named by an environment variable (skipped when unset):

    MINILLM_CONFORMANCE_URL=http://127.0.0.1:8080/v1 pytest tests/test_13_conformance.py
    MINILLM_CONFORMANCE_MODEL=...   # the model to ask for (default: the first one /v1/models lists)

so a learner can point them at vLLM or llama.cpp's server. Greedy requests
(temperature 0) are the reference for each other: streamed text must equal the
non-streamed text, and a stop string must cut exactly where the text had it.
"""

from __future__ import annotations

import os

import httpx
import pytest
from openai import OpenAI

from minillm.model.tiny import tiny_pair
from minillm.serving.launch import BackgroundServer

QUESTION = [{"role": "user", "content": "Name three colours and say why you like them."}]


@pytest.fixture(scope="module", params=["minillm", "external"])
def target(request):
    """(client, model name, base URL) of the server under test."""
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
