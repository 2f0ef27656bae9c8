"""Checks for lesson 02's exercises: each compares your answer with a reference computed here."""

from __future__ import annotations

import pytest
import torch

from minillm.model.tiny import tiny_pair
from minillm.runtime.session import DecodeSession
from minillm.strategies.generate import generate


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_pair("llama")[1]  # context_length 64, vocab 96


def first_stop(generated: list[int], stops: list[list[int]]) -> int | None:
    """Brute force: the shortest prefix of `generated` that ends with a stop sequence."""
    for n in range(1, len(generated) + 1):
        if any(len(s) <= n and generated[n - len(s):n] == s for s in stops):
            return n
    return None


def test_exercise_1_stop_on_a_token_sequence(answers, tiny_model):
    prompt = [3, 14, 15, 92, 65, 35]
    free = generate(tiny_model, [prompt], max_new_tokens=40).rows[0].token_ids
    calls = []
    hook = tiny_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        cases = [
            [free[12:15]],                      # a 3-gram from the middle
            [free[25:27], free[18:21], [95, 95, 95, 95]],  # the earliest completed one wins
            [[prompt[-1], free[0]]],            # would only match across the prompt: must not
            [[95, 94, 93, 92, 91]],             # never appears: run to max_new_tokens
            [free[:1]],                         # the very first token
        ]
        for stops in cases:
            calls.clear()
            got = answers.generate_until(tiny_model, prompt, stops, 40)
            n = first_stop(free, stops) or len(free)
            assert got == free[:n], f"stop_sequences={stops}"
            assert len(calls) == len(got), f"{len(calls)} forward passes for {len(got)} tokens: stop the loop early"
    finally:
        hook.remove()


def reference_cycle(ids: list[int], w: int):
    """Brute force over every pair of windows."""
    for k in range(w, len(ids) + 1):
        for j in range(w, k):
            if ids[j - w:j] == ids[k - w:k]:
                return j - w, k - j
    return None


def test_exercise_2_predict_where_greedy_loops(answers):
    # Synthetic sequences: a cycle of 3 after a 4-token lead-in, a 1-token loop, no repeat, a window of 1.
    assert answers.find_cycle([9, 8, 7, 6, 1, 2, 3, 1, 2, 3, 1, 2, 3], 2) == reference_cycle(
        [9, 8, 7, 6, 1, 2, 3, 1, 2, 3, 1, 2, 3], 2) == (4, 3)
    for ids, w in (([5, 5, 5, 5], 2), (list(range(12)), 3), ([1, 2, 1, 3, 1, 2], 1), ([4, 4], 3)):
        assert answers.find_cycle(ids, w) == reference_cycle(ids, w), (ids, w)
    # A real greedy run with a 6-token window: find the cycle in the first 200 tokens, then check
    # that the prediction holds on 100 tokens the answer never saw.
    _, model = tiny_pair("llama", seed=0, context_length=6)
    prompt = [5, 17, 42, 8, 3]
    ids = prompt + generate(model, [prompt], max_new_tokens=295).rows[0].token_ids
    seen = ids[:200]
    found = answers.find_cycle(seen, 6)
    assert found == reference_cycle(seen, 6)
    start, period = found
    assert period > 1
    assert all(ids[t + period] == ids[t] for t in range(start, len(ids) - period)), "the loop did not continue"


@pytest.mark.parametrize("prompt_len,max_new_tokens,window_slide", [
    (10, 20, 1),   # never outgrows the window: one prefill
    (60, 4, 1),    # reaches 64 tokens exactly: still fits
    (60, 5, 1),    # the 5th token is the last one: no slide after it
    (60, 6, 1),
    (50, 60, 1),   # slides one token a step
    (50, 60, 16),  # slides 16 at a time
    (64, 30, 7),   # a full prompt
    (1, 150, 40),  # the window moves several times
])
def test_exercise_3_count_the_re_prefills(answers, tiny_model, monkeypatch, prompt_len, max_new_tokens,
                                          window_slide):
    predicted = answers.prefill_cost(prompt_len, max_new_tokens, 64, window_slide)
    prefilled = []
    original = DecodeSession.prefill

    def counting_prefill(self, rows):
        prefilled.append(sum(map(len, rows)))
        return original(self, rows)

    monkeypatch.setattr(DecodeSession, "prefill", counting_prefill)
    prompt = torch.randint(0, 96, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    out = generate(tiny_model, [prompt], max_new_tokens=max_new_tokens, window_slide=window_slide).rows[0]
    assert len(out.token_ids) == max_new_tokens
    assert predicted == (len(prefilled), sum(prefilled)), f"the package prefilled {prefilled} tokens"
