"""Checks for lesson 07's exercises: each compares your answer with a reference computed here."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from minillm.model.tiny import tiny_pair
from minillm.runtime.batching import length_sorted_chunks, pad_left
from minillm.strategies.generate import generate


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", context_length=128)


def random_prompts(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_exercise_1_packed_prefill(answers, kind):
    _, model = tiny_pair(kind, context_length=128)
    rows = random_prompts([5, 1, 12, 3])
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    try:
        got = answers.packed_prefill(model, rows)
    finally:
        hook.remove()
    assert shapes == [(1, sum(map(len, rows)))], f"expected one forward of [1, {sum(map(len, rows))}], got {shapes}"
    assert len(got) == len(rows)
    with torch.inference_mode():
        for row, logits in zip(rows, got):
            alone = model(torch.tensor([row]), torch.arange(len(row))[None])[0]
            assert logits.shape == alone.shape
            torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)


def padding_of(batches, lengths):
    return sum(max(lengths[i] for i in b) - lengths[i] for b in batches for i in b)


def brute_force_padding(lengths, batch_size):
    """The least padding over every assignment of rows to ceil(n / batch_size) labelled batches."""
    n, k = len(lengths), math.ceil(len(lengths) / batch_size)
    best = math.inf
    for labels in itertools.product(range(k), repeat=n):
        batches = [[i for i in range(n) if labels[i] == j] for j in range(k)]
        if all(0 < len(b) <= batch_size for b in batches):
            best = min(best, padding_of(batches, lengths))
    return best


@pytest.mark.parametrize("lengths,batch_size", [([1, 1, 1, 10, 10], 2), ([7, 3, 9, 1, 4, 4, 8], 3),
                                                ([5, 2, 8, 8, 1, 6], 4), ([3], 2), ([4, 9, 2, 6, 6, 1, 7], 2)])
def test_exercise_2_buckets_with_the_least_padding(answers, lengths, batch_size):
    got = answers.least_padding_batches(lengths, batch_size)
    assert sorted(i for b in got for i in b) == list(range(len(lengths))), "every row exactly once"
    assert len(got) == math.ceil(len(lengths) / batch_size) and all(0 < len(b) <= batch_size for b in got)
    assert padding_of(got, lengths) == brute_force_padding(lengths, batch_size)
    assert padding_of(got, lengths) <= padding_of(length_sorted_chunks(lengths, batch_size), lengths)


def test_exercise_2_beats_length_sorted_chunks(answers):
    lengths = [1, 1, 1, 10, 10]  # sorted chunks of 2: [1, 1], [1, 10], [10] -> 9 padding; optimum 0
    assert padding_of(answers.least_padding_batches(lengths, 2), lengths) == 0


def test_exercise_3_per_row_stops_on_the_session(answers, pair):
    _, model = pair
    prompts = random_prompts([4, 9, 2, 6])
    greedy = [generate(model, p, max_new_tokens=10).token_ids[0] for p in prompts]
    eos_ids = [greedy[0][1], greedy[1][6], 95, greedy[3][3]]  # rows stop after 2, 7, 10 (no EOS), 4 tokens
    eos_ids[2] = next(t for t in range(96) if t not in greedy[2])
    batch_sizes = []
    hook = model.register_forward_pre_hook(lambda m, args: batch_sizes.append(args[0].shape[0]))
    try:
        got = answers.greedy_per_row_eos(model, prompts, eos_ids, 10)
    finally:
        hook.remove()
    want = [generate(model, p, max_new_tokens=10, eos_token_id=e).token_ids[0] for p, e in zip(prompts, eos_ids)]
    assert got == want
    # Forward k (0 = prefill) holds the rows still running after k tokens.
    running = [sum(len(w) > k for w in want) for k in range(max(map(len, want)))]
    assert batch_sizes == running, f"rows per forward {batch_sizes}, unfinished rows {running}"


def test_exercise_4_a_left_padded_cached_loop(answers, pair):
    hf_model, model = pair
    prompts = random_prompts([3, 17, 1, 9], seed=2)
    got = answers.greedy_left_padded(model, prompts, 8)
    assert got == generate(model, prompts, max_new_tokens=8).token_ids
    tokens, valid, _ = pad_left(prompts)
    reference = hf_model.generate(tokens, attention_mask=valid.long(), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[:, tokens.shape[1]:].tolist()
    assert got == reference
