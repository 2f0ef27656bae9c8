"""Lesson 13: logprobs, top_logprobs and echo, as OpenAI's and vLLM's servers report them.

References: transformers' model holding the same weights, run over the whole sequence
(prompt + the tokens the server produced): every reported logprob equals log_softmax of its
logits at that position, in float32, to 1e-4. Generated tokens are compared with the
distribution they were drawn from: transformers' own logits processors (repetition penalty,
temperature, top-k, top-p) applied to its logits; prompt tokens (echo) with the raw
distribution. The stream is checked against the whole answer, and the engine against the
same references through chunked prefills, prefix-cache hits and preemption.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from openai import OpenAI
from tokenizers import Tokenizer, decoders, models
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minillm.model.tiny import tiny_pair
from minillm.model.tokenizer import HFTokenizerWrapper
from minillm.runtime.engine import Engine
from minillm.serving.launch import BackgroundServer
from minillm.serving.openai_api import LOGPROB_FLOOR

ATOL = 1e-4
QUESTION = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."


@pytest.fixture(scope="module")
def twins(default_model):
    """(transformers model, minillm model, tokenizer): a tiny random Llama over the default model's tokenizer."""
    _, tokenizer = default_model
    hf_model, model = tiny_pair("llama", seed=3, vocab_size=49152, context_length=256)
    return hf_model, model, tokenizer


@pytest.fixture(scope="module")
def server(twins):
    """A token budget of 8 cuts every prompt into chunks; blocks of 4 fill up, so prefixes get cached."""
    _, model, tokenizer = twins
    with BackgroundServer(model, tokenizer, model_name="tiny", max_num_seqs=4, max_num_batched_tokens=8,
                          num_blocks=128, block_size=4) as server:
        yield server


@pytest.fixture(scope="module")
def vocab(twins) -> dict[str, list[int]]:
    """Each token's text alone -> the ids that decode to it: how a test finds the ids behind reported tokens."""
    _, _, tokenizer = twins
    index = {}
    for token_id in range(tokenizer.vocab_size):
        index.setdefault(tokenizer.decode([token_id]), []).append(token_id)
    return index


def id_of(vocab, token: str) -> int:
    (token_id,) = vocab[token]  # the tokens these tests meet decode to texts no other token has
    return token_id


def client_for(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def reference_logprobs(hf_model, ids: list[int], processors=()) -> torch.Tensor:
    """float32 [len(ids), V]: row p is log_softmax of transformers' logits after ids[:p + 1], each processor
    applied (with the tokens so far as its history, as `generate` gives them)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()  # [T, V]
    rows = []
    for p, row in enumerate(logits):
        scores = row[None]
        for processor in processors:
            scores = processor(torch.tensor([ids[: p + 1]]), scores)
        rows.append(scores[0].log_softmax(dim=-1))
    return torch.stack(rows)


def assert_close(reported: float, expected: float) -> None:
    expected = max(float(expected), LOGPROB_FLOOR)  # what the server reports for -inf
    assert abs(reported - expected) <= ATOL, (reported, expected)


def check_position(reference: torch.Tensor, token_id: int, logprob: float, top: list[tuple[int, float]]) -> None:
    """One position against its reference row [V]: the token's logprob, and the top ones, best first."""
    assert_close(logprob, reference[token_id])
    for top_id, top_logprob in top:
        assert_close(top_logprob, reference[top_id])
    expected = reference.topk(len(top)).values.tolist()
    assert all(abs(a - max(b, LOGPROB_FLOOR)) <= ATOL for a, b in zip([lp for _, lp in top], expected)), top


# ---------------------------------------------------------------------------------------------- chat

SAMPLED = dict(temperature=0.7, seed=11, top_p=0.9, extra_body={"top_k": 30, "repetition_penalty": 1.3})


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chat_logprobs_are_those_of_the_distribution_drawn_from(server, twins, vocab, sampling):
    hf_model, _, tokenizer = twins
    settings = dict(temperature=0) if sampling == "greedy" else SAMPLED
    answer = client_for(server).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8,
                                                         logprobs=True, top_logprobs=5, **settings)
    content = answer.choices[0].logprobs.content
    prompt = tokenizer.encode(tokenizer.apply_chat_template(QUESTION))
    generated = [id_of(vocab, entry.token) for entry in content]
    assert len(content) == answer.usage.completion_tokens == 8
    assert tokenizer.decode(generated) == answer.choices[0].message.content
    processors = [] if sampling == "greedy" else [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                                                   TopKLogitsWarper(30), TopPLogitsWarper(0.9)]
    reference = reference_logprobs(hf_model, prompt + generated, processors)[len(prompt) - 1 : -1]
    for row, entry, token_id in zip(reference, content, generated):
        check_position(row, token_id, entry.logprob, [(id_of(vocab, t.token), t.logprob) for t in entry.top_logprobs])
        assert len(entry.top_logprobs) == 5
        assert bytes(entry.bytes) == tokenizer.token_bytes(token_id)
        assert all(bytes(t.bytes) == tokenizer.token_bytes(id_of(vocab, t.token)) for t in entry.top_logprobs)
    if sampling == "greedy":
        assert all(e.top_logprobs[0].logprob == e.logprob for e in content)  # the argmax is the token


def test_tokens_the_sampler_removed_report_the_floor_in_strict_json(server):
    """top_k 2 leaves two tokens to draw from: they share all the probability, the others report -9999 (JSON has
    no -inf, and a strict parser refuses Python's -Infinity)."""
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 4, "temperature": 1, "seed": 0, "top_k": 2,
            "logprobs": True, "top_logprobs": 4}
    response = httpx.post(server.base_url + "/chat/completions", json=body)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    for entry in json.loads(response.text, parse_constant=refuse)["choices"][0]["logprobs"]["content"]:
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top[2:] == [LOGPROB_FLOOR] * 2 and sum(torch.tensor(top[:2]).exp()) == pytest.approx(1, abs=1e-5)


def test_streamed_chat_logprobs_concatenate_to_the_whole_answers(server):
    settings = dict(model="tiny", messages=QUESTION, max_tokens=10, logprobs=True, top_logprobs=3, **SAMPLED)
    whole = client_for(server).chat.completions.create(**settings).choices[0]
    chunks = list(client_for(server).chat.completions.create(**settings, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content


def test_without_logprobs_none_are_reported(server):
    answer = client_for(server).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, temperature=0)
    assert answer.choices[0].logprobs is None
    text = client_for(server).completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert text.choices[0].logprobs is None


# ---------------------------------------------------------------------------------------------- completions and echo

def test_completion_logprobs_in_the_legacy_shape(server, twins, vocab):
    hf_model, _, tokenizer = twins
    answer = client_for(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3,
                                                   temperature=0.8, seed=2, extra_body={"top_k": 20})
    choice, logprobs = answer.choices[0], answer.choices[0].logprobs
    prompt = tokenizer.encode(PROMPT)
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == 6
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    generated = [id_of(vocab, token) for token in logprobs.tokens]
    reference = reference_logprobs(hf_model, prompt + generated, [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20)])
    for row, token_id, logprob, top in zip(reference[len(prompt) - 1 : -1], generated, logprobs.token_logprobs,
                                           logprobs.top_logprobs):
        assert 3 <= len(top) <= 4 and top[tokenizer.decode([token_id])] == logprob  # the token itself is there
        check_position(row, token_id, logprob, [])
        likeliest = sorted(top.values(), reverse=True)[:3]
        assert all(abs(a - b) <= ATOL for a, b in zip(likeliest, row.topk(3).values.tolist()))


def test_echo_scores_the_prompt_against_the_full_sequence_forward(server, twins):
    """What lm-evaluation-harness sends to score a text: the prompt as token ids, max_tokens 0, echo, logprobs."""
    hf_model, _, tokenizer = twins
    prompt = tokenizer.encode(PROMPT)
    client = client_for(server)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)  # now its blocks are cached
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                       temperature=0)
    choice, logprobs = answer.choices[0], answer.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(prompt)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts the first
    reference = reference_logprobs(hf_model, prompt)
    for p in range(1, len(prompt)):
        assert_close(logprobs.token_logprobs[p], reference[p - 1, prompt[p]])
        assert sorted(logprobs.top_logprobs[p].values(), reverse=True)[0] == pytest.approx(
            reference[p - 1].max().item(), abs=ATOL)


def test_echo_with_a_completion_and_its_stream(server, twins, vocab):
    hf_model, _, tokenizer = twins
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "echo": True, "logprobs": 1, "temperature": 0}
    whole = httpx.post(server.base_url + "/completions", json=body).json()["choices"][0]
    prompt = tokenizer.encode(PROMPT)
    assert whole["text"].startswith(PROMPT) and len(whole["logprobs"]["tokens"]) == len(prompt) + 5
    ids = prompt + [id_of(vocab, token) for token in whole["logprobs"]["tokens"][len(prompt):]]
    reference = reference_logprobs(hf_model, ids)
    for p in range(1, len(ids)):
        assert_close(whole["logprobs"]["token_logprobs"][p], reference[p - 1, ids[p]])
    with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = {key: [x for c in chunks for x in c["choices"][0]["logprobs"][key]] for key in whole["logprobs"]}
    assert streamed == whole["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)


def test_echo_without_logprobs_returns_the_prompt_alone(server):
    answer = client_for(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert answer.choices[0].text == PROMPT and answer.choices[0].logprobs is None


# ---------------------------------------------------------------------------------------------- bad values

BAD = {  # name: (path, body, param)
    "top_logprobs without logprobs": ("/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    "top_logprobs over 20": ("/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21},
                             "top_logprobs"),
    "negative top_logprobs": ("/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": -1},
                              "top_logprobs"),
    "completion logprobs over 5": ("/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    "negative completion logprobs": ("/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_logprob_values_are_a_400_naming_the_parameter(server, name):
    path, body, param = BAD[name]
    response = httpx.post(server.base_url + path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    if name == "top_logprobs without logprobs":
        assert '"logprobs": true' in error["message"]


# ---------------------------------------------------------------------------------------------- the engine

ENGINES = {  # name: (engine options, what must happen)
    "chunked prefill, prefix hits": (dict(block_size=4, num_blocks=200, max_num_batched_tokens=8, max_num_seqs=4),
                                     "chunked"),
    "tight pool: preemption": (dict(block_size=4, num_blocks=14, max_num_seqs=6), "preempted"),
}


@pytest.mark.parametrize("name", ENGINES)
def test_engine_logprobs_through_chunks_hits_and_preemption(name):
    """Requests asking for logprobs beside requests that do not, sharing a prefix: every number equals
    transformers' over the request's whole sequence; the others compute and carry nothing."""
    hf_model, model = tiny_pair("llama", seed=5)
    options, must = ENGINES[name]
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 96, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 14, 1, 8, 11, 5)]
    engine = Engine(model, **options)
    asks = [i % 2 == 1 for i in range(len(prompts))]  # the first one, asking nothing, caches the shared prefix
    ids = [engine.add_request(p, max_new_tokens=12, eos_token_id=(),
                              **(dict(top_logprobs=3, prompt_top_logprobs=2) if ask else {}))
           for p, ask in zip(prompts, asks)]
    events = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            events[event.row].append(event)
    if must == "preempted":
        assert any(r.preemptions for r in engine.requests.values())
    for request_id, prompt, ask in zip(ids, prompts, asks):
        request = engine.requests[request_id]
        if not ask:
            assert request.logprobs == request.prompt_logprobs == []
            assert all(e.logprobs is None and e.prompt_logprobs is None for e in events[request_id])
            continue
        sequence = prompt + request.generated
        reference = reference_logprobs(hf_model, sequence)
        reported = [r for e in events[request_id] for r in e.logprobs]
        assert [r.token_id for r in reported] == request.generated
        for p, report in enumerate(events[request_id][0].prompt_logprobs + reported, start=1):
            assert report.token_id == sequence[p]
            check_position(reference[p - 1], report.token_id, report.logprob, report.top)
        assert [len(r.top) for r in reported] == [3] * 12
        assert events[request_id][0].prompt_logprobs == request.prompt_logprobs
        assert all(e.prompt_logprobs is None for e in events[request_id][1:])


def test_engine_refuses_what_it_cannot_report():
    _, model = tiny_pair("llama")
    engine = Engine(model, num_blocks=16)
    with pytest.raises(ValueError, match="top_logprobs=-1 is invalid"):
        engine.add_request([1, 2, 3], top_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_top_logprobs needs max_new_tokens >= 1"):
        engine.add_request([1, 2, 3], prompt_top_logprobs=2, max_new_tokens=0)


# ---------------------------------------------------------------------------------------------- token bytes

def test_token_bytes_join_into_the_texts_bytes(default_model):
    """Byte-level BPE splits an emoji over tokens that are not UTF-8 alone: their bytes still join into the text's."""
    _, tokenizer = default_model
    text = "héllo 😀 wörld, 日本語"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some token is part of a character
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_byte_fallback_tokens():
    """sentencepiece's byte fallback (Gemma, Llama 2): a "<0xF0>" token's bytes are that byte."""
    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "<0x98>": 3, "<0x80>": 4, "▁a": 5}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = HFTokenizerWrapper(hf, None)
    ids = [5, 1, 2, 3, 4]
    assert tokenizer.decode(ids) == " a😀" and tokenizer.decode([1]) == "\ufffd"
    assert [tokenizer.token_bytes(i) for i in ids] == [b" a", b"\xf0", b"\x9f", b"\x98", b"\x80"]
