"""Checks for lesson 19's exercises: `pytest lessons/19-capstone` (yours) or `--solutions`.

References: transformers' RepetitionPenaltyLogitsProcessor and the package's `generate` with
`repetition_penalty`; plain string search over the text and the engine's own run without stop
strings; the engine's own run without sharing (the same tokens, more blocks) and `generate`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from minillm.model.tiny import tiny_pair
from minillm.strategies.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Engine, Model, Params


@pytest.fixture(scope="module")
def tiny():
    """(the package's tiny random Llama, the capstone's view of the same weights)"""
    model = tiny_pair("llama", seed=3, context_length=128)[1]
    return model, Model.from_minillm(model)


def random_prompts(n: int, seed: int, shared: int = 0, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [system + torch.randint(0, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 12, (n,), generator=g)]


def test_exercise_1_a_repetition_penalty(answers, tiny):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    for penalty in (1.3, 2.0, 0.7):
        for _ in range(10):
            logits = torch.randn(64, generator=g) * 3
            tokens = torch.randint(0, 64, (int(torch.randint(1, 30, (), generator=g)),), generator=g).tolist()
            expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), logits[None].clone())[0]
            torch.testing.assert_close(answers.penalize_repeats(logits.clone(), tokens, penalty), expected)
    model, capstone = tiny
    prompts = random_prompts(3, seed=1)
    engine = Engine(capstone, block_size=4, num_blocks=32, lookup=4)  # lookup stays off for processed requests
    out = engine.run(prompts, Params(max_new_tokens=24), arrivals=[0, 1, 3],
                     processors=[lambda logits, tokens: answers.penalize_repeats(logits, tokens, 1.8)])
    expected = [generate(model, p, max_new_tokens=24, repetition_penalty=1.8, compile=False).rows[0].token_ids
                for p in prompts]
    assert [r.generated for r in out] == expected


class Letters:
    """A toy tokenizer for the tiny model: token i is one character."""

    alphabet = "abcde fgh\n"

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i % len(self.alphabet)] for i in ids)


def reference_stop(text: str, stops: list[str]) -> str | None:
    """Plain string search: everything before the first position where any stop string begins."""
    for end in range(len(text) + 1):
        for stop in stops:
            if text[end:end + len(stop)] == stop:
                return text[:end]
    return None


def test_exercise_2_stop_strings(answers, tiny):
    rng = random.Random(2)
    for _ in range(300):
        text = "".join(rng.choice("ab \n") for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice("ab \n") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        assert answers.stop_at(text, stops) == reference_stop(text, stops), (text, stops)
    model, capstone = tiny
    prompts = random_prompts(4, seed=3)
    free = Engine(capstone, block_size=4, num_blocks=64, tokenizer=Letters()).run(prompts, Params(max_new_tokens=30))
    for lookup in (0, 4):  # a verified draft may append several tokens in one step: the stop is still exact
        engine = Engine(capstone, block_size=4, num_blocks=64, tokenizer=Letters(), lookup=lookup)
        cases = []
        for prompt, whole in zip(prompts, free):
            stops = [whole.text[12:14], whole.text[20:23], "zzz"]  # the first surely occurs, by token 14
            stop = lambda text, stops=stops: answers.stop_at(text, stops)  # noqa: E731
            cases.append((engine.add_request(prompt, Params(max_new_tokens=30), stop=stop), whole, stops))
        while engine.waiting or engine.running:
            engine.step()
        for request, whole, stops in cases:
            ends = next(n for n in range(1, 31)  # the first token after which the text holds a stop string
                        if reference_stop(Letters().decode(whole.generated[:n]), stops) is not None)
            assert request.finish_reason == "stop"
            assert request.generated == whole.generated[:ends], "the request must end at the token that stops it"
            assert request.text == reference_stop(whole.text, stops)


def test_exercise_3_prefix_caching(answers, tiny):
    model, capstone = tiny
    for num_blocks, arrivals in ((64, [0, 0, 1, 4, 4, 6]), (14, [0, 1, 1, 2, 5, 5])):  # roomy; tight: preemptions
        prompts = random_prompts(6, seed=num_blocks, shared=13)  # a 13-token system prompt: 3 full blocks of 4
        prompts.append(list(prompts[0]))  # the same prompt twice: its last token is still computed
        arrivals = [*arrivals, 6]
        plain = Engine(capstone, num_blocks=num_blocks, block_size=4, max_batch=4)
        pool = answers.prefix_caching_pool(num_blocks, 4)
        shared = Engine(capstone, pool=pool, max_batch=4)
        expected = plain.run(prompts, Params(max_new_tokens=10), arrivals=arrivals)
        out = shared.run(prompts, Params(max_new_tokens=10), arrivals=arrivals)
        assert [r.generated for r in out] == [r.generated for r in expected]
        assert pool.allocations < plain.pool.allocations, "sharing should hand out fewer blocks"
        assert max(num_blocks - step["free"] for step in shared.history) <= \
            max(num_blocks - step["free"] for step in plain.history)
        assert pool.num_free == num_blocks, "every block back on the free list once all requests are done"
    alone = [generate(model, p, max_new_tokens=10, compile=False).rows[0].token_ids for p in prompts]
    assert [r.generated for r in out] == alone
