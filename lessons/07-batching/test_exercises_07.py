"""Checks for lesson 07's exercises: each compares your answer with a reference computed here."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from minillm.model.attention import AttentionStep, causal_mask_lower_right, set_attention_backend
from minillm.model.tiny import tiny_pair
from minillm.runtime.batching import attention_mask, length_sorted_chunks, pad_left
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


NAN_PROMPTS = random_prompts([3, 17, 1, 9], seed=2)  # the batch of exercise 4: row 1 is the longest, unpadded


def textbook_attention(q, k, v, step):
    """The check's own unguarded softmax attention, so that the predictions are checked against the truth even
    while your `softmax_attention` is unwritten or wrong."""
    H, KV, T, S = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    mask = step.mask[:, None] if step.mask is not None else causal_mask_lower_right(T, S, q.device)
    weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf")).softmax(-1)
    return weights @ v


def left_padded_prefill(model, prompts, mask_rule):
    """One forward of the left-padded batch with the mask `mask_rule(valid, L)` builds: logits [B, L, V]."""
    tokens, valid, positions = pad_left(prompts)
    with torch.inference_mode():
        return model(tokens, positions, mask=mask_rule(valid, tokens.shape[1])), valid


def nan_rows(logits, valid):
    """Which rows hold a NaN among the logits at their real tokens."""
    return [bool(row[real].isnan().any()) for row, real in zip(logits, valid)]


def brute_force_mask_without_own_column(valid, num_queries):
    B, S = valid.shape
    mask = torch.zeros(B, num_queries, S, dtype=torch.bool)
    for b, t, s in itertools.product(range(B), range(num_queries), range(S)):
        mask[b, t, s] = s <= S - num_queries + t and bool(valid[b, s])
    return mask


def test_exercise_4_predict_where_the_nan_goes(answers):
    predicted = answers.predicted_nan_rows()
    truth = {}
    for case, layers, backend in [("sdpa, 2 layers", 2, None), ("softmax, 1 layer", 1, textbook_attention),
                                  ("softmax, 2 layers", 2, textbook_attention)]:
        _, model = tiny_pair("llama", context_length=128, n_layer=layers)
        if backend is not None:
            set_attention_backend(model, backend)
        logits, valid = left_padded_prefill(model, NAN_PROMPTS, brute_force_mask_without_own_column)
        truth[case] = nan_rows(logits, valid)
    assert set(predicted) == set(truth), f"predict exactly these cases: {sorted(truth)}"
    wrong = {case: (predicted[case], truth[case]) for case in truth if list(predicted[case]) != truth[case]}
    assert not wrong, "predicted vs measured NaN rows: " + "; ".join(f"{c}: {p} vs {t}" for c, (p, t) in wrong.items())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # grouped-query heads (4 query heads on 2 KV heads) and not
def test_exercise_4_softmax_attention_is_attention(answers, kind):
    _, model = tiny_pair(kind, context_length=128)
    sdpa_logits, _ = left_padded_prefill(model, NAN_PROMPTS, attention_mask)
    sdpa_tokens = generate(model, NAN_PROMPTS, max_new_tokens=8).token_ids  # session: mask None and [B, 1, S] masks
    set_attention_backend(model, answers.softmax_attention)
    logits, _ = left_padded_prefill(model, NAN_PROMPTS, attention_mask)
    torch.testing.assert_close(logits, sdpa_logits, atol=1e-4, rtol=1e-4)  # every position: padding ones too
    assert generate(model, NAN_PROMPTS, max_new_tokens=8).token_ids == sdpa_tokens
    # No guard: a query that may see no key at all comes out NaN (SDPA would give zeros).
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    empty = AttentionStep(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[[True, False, False], [False] * 3]]))
    out = answers.softmax_attention(q, k, v, empty)
    assert out.shape == (1, 4, 2, 8) and out[:, :, 1].isnan().all() and not out[:, :, 0].isnan().any()


def test_exercise_4_break_the_diagonal(answers):
    tokens, valid, _ = pad_left(NAN_PROMPTS)
    L = tokens.shape[1]
    for num_queries in (L, 3, 1):
        broken = answers.mask_without_own_column(valid, num_queries)
        assert torch.equal(broken, brute_force_mask_without_own_column(valid, num_queries)), num_queries
    # A decode step's new column is real in every row: there, dropping the term changes nothing.
    grown = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
    assert torch.equal(answers.mask_without_own_column(grown, 1), attention_mask(grown, 1))
    # The prefill with your backend and your broken mask: the padded rows' real logits are NaN, the longest row's
    # are untouched; with the s = t term back, every row's exact logits and tokens return.
    hf_model, model = tiny_pair("llama", context_length=128)
    reference, _ = left_padded_prefill(model, NAN_PROMPTS, attention_mask)
    set_attention_backend(model, answers.softmax_attention)
    logits, _ = left_padded_prefill(model, NAN_PROMPTS, answers.mask_without_own_column)
    assert nan_rows(logits, valid) == [True, False, True, True], "the padded rows (3, 1, 9 tokens) turn NaN"
    assert logits[:, L - 1].isnan().any(dim=-1).tolist() == [True, False, True, True]  # even the next-token logits
    torch.testing.assert_close(logits[1], reference[1], atol=1e-4, rtol=1e-4)
    fixed, _ = left_padded_prefill(model, NAN_PROMPTS, attention_mask)
    assert not fixed.isnan().any()
    first = [row[0] for row in generate(model, NAN_PROMPTS, max_new_tokens=1).token_ids]
    assert fixed[:, L - 1].argmax(dim=-1).tolist() == first
    theirs = hf_model.generate(tokens, attention_mask=valid.long(), max_new_tokens=1, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[:, L].tolist()
    assert first == theirs
