"""Lesson 04: repetition, presence and frequency penalties.

References: transformers' RepetitionPenaltyLogitsProcessor (exact tensors, and greedy
generate() with repetition_penalty token for token on tiny models); OpenAI's documented
formula for presence/frequency, checked on logits and through a brute-force decode loop.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from minillm.decoding.sampling import (
    SamplingConfig,
    TokenHistory,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    process_logits,
)
from minillm.model.tiny import tiny_pair
from minillm.strategies.generate import generate

VOCAB = 40


def logits_with_edges(batch: int, seed: int = 0) -> torch.Tensor:
    """Random logits with zeros, exact negatives and -inf sprinkled in (the sign decides the rule)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=g) * 3
    logits[:, 0] = 0.0
    logits[:, 1] = -math.inf
    logits[0, 5:9] = -math.inf
    return logits


def histories(seed: int = 0):
    """Rows with different prompts and different generated tokens, repeats included.

    Returns (prompts, generated, TokenHistory) where generated[b] lists row b's generated tokens.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 12, 1, 7)]
    generated = torch.randint(0, 12, (len(prompts), 15), generator=g)  # small range: many repeats
    generated[1] = 1  # row 1 repeats a single token (already -inf) every step
    generated[2, :10] = 7  # row 2 repeats 7 ten times
    history = TokenHistory.from_prompts(prompts, VOCAB)
    for step in range(generated.shape[1]):
        history.add(generated[:, step])
    return prompts, generated.tolist(), history


# ------------------------------------------------------------------ repetition penalty == transformers


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.1, 1.3, 2.0, 10.0])
def test_repetition_penalty_matches_transformers(penalty):
    prompts, generated, history = histories()
    logits = logits_with_edges(len(prompts))
    # transformers sees each row's whole sequence [B, L]; pad the shorter prompts by repeating their first token
    longest = max(len(p) + len(g) for p, g in zip(prompts, generated))
    sequences = [p + g for p, g in zip(prompts, generated)]
    input_ids = torch.tensor([[s[0]] * (longest - len(s)) + s for s in sequences])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    ours = apply_repetition_penalty(logits, history.seen, penalty)
    assert torch.equal(ours, expected)
    if penalty != 1.0:  # each row was penalised on its own history
        changed = ours != logits
        for row, seq in enumerate(sequences):
            finite_nonzero = {t for t in range(VOCAB) if abs(logits[row, t].item()) not in (0.0, math.inf)}
            assert set(torch.nonzero(changed[row]).flatten().tolist()) == set(seq) & finite_nonzero


def test_repetition_penalty_counts_the_prompt_once_per_token():
    logits = torch.tensor([[2.0, -2.0, 4.0, 1.0]])
    history = TokenHistory.from_prompts([[0, 0, 0, 1]], 4)
    history.add(torch.tensor([2]))
    history.add(torch.tensor([2]))
    assert apply_repetition_penalty(logits, history.seen, 2.0).tolist() == [[1.0, -4.0, 2.0, 1.0]]


# ------------------------------------------------------------------ presence / frequency == OpenAI's formula


def openai_formula(logits, generated, presence, frequency):
    """logits[t] -= frequency * count[t] + presence * (count[t] > 0), counting generated tokens only."""
    out = logits.clone()
    for row, tokens in enumerate(generated):
        for token, count in Counter(tokens).items():
            out[row, token] -= frequency * count + presence * (count > 0)
    return out


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.5), (1.0, 0.3), (-0.5, 2.0),
                                                (2.0, -2.0)])
def test_presence_frequency_follow_the_openai_formula(presence, frequency):
    prompts, generated, history = histories(seed=1)
    logits = logits_with_edges(len(prompts), seed=1)
    ours = apply_presence_frequency_penalty(logits, history.generated_counts, presence, frequency)
    torch.testing.assert_close(ours, openai_formula(logits, generated, presence, frequency), rtol=0, atol=1e-5)


def test_prompt_tokens_are_not_counted_by_presence_frequency():
    history = TokenHistory.from_prompts([[3, 3, 3], [0]], 5)
    history.add(torch.tensor([3, 4]))
    history.add(torch.tensor([1, 4]))
    assert history.generated_counts.tolist() == [[0, 1, 0, 1, 0], [0, 0, 0, 0, 2]]
    assert history.seen.tolist() == [[False, True, False, True, False], [True, False, False, False, True]]
    logits = torch.zeros(2, 5)
    out = apply_presence_frequency_penalty(logits, history.generated_counts, presence=1.0, frequency=0.25)
    assert out.tolist() == [[0, -1.25, 0, -1.25, 0], [0, 0, 0, 0, -1.5]]


def test_history_select_keeps_each_rows_own_counts():
    _, generated, history = histories(seed=2)
    picked = history.select(torch.tensor([2, 0]))
    for new_row, old_row in enumerate([2, 0]):
        assert picked.generated_counts[new_row].tolist() == [generated[old_row].count(t) for t in range(VOCAB)]


def test_penalties_apply_in_greedy_mode_and_compose_in_order():
    """Greedy: penalties only (no warpers). Order: repetition first, then presence/frequency."""
    prompts, generated, history = histories(seed=3)
    logits = logits_with_edges(len(prompts), seed=3)
    config = SamplingConfig(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.2, top_k=1, top_p=0.1)
    expected = openai_formula(apply_repetition_penalty(logits, history.seen, 1.4), generated, 0.6, 0.2)
    torch.testing.assert_close(process_logits(logits, config, history), expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ wired into generate()


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(length),), generator=g).tolist() for length in torch.randint(4, 14, (n,),
                                                                                                       generator=g)]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_greedy_repetition_penalty_matches_transformers_generate(tiny, penalty):
    hf_model, model = tiny
    config = SamplingConfig(max_new_tokens=30, eos_token_id=hf_model.generation_config.eos_token_id)  # both stop alike
    changed = 0
    for prompt in random_prompts(3, model.config.vocab_size, seed=4):
        ids = torch.tensor([prompt])
        reference = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      repetition_penalty=penalty, max_new_tokens=config.max_new_tokens,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        ours = generate(model, prompt, config, repetition_penalty=penalty).rows[0].token_ids
        assert ours == reference
        changed += ours != generate(model, prompt, config).rows[0].token_ids
    assert changed > 0, "the penalty never changed the output: the check would not notice it missing"


def brute_force_penalised_greedy(model, prompt, n, repetition, presence, frequency) -> list[int]:
    """No cache, one row, penalties written out from the lists themselves."""
    sequence, generated = list(prompt), []
    for _ in range(n):
        tokens = torch.tensor([sequence])
        logits = model(tokens, torch.arange(len(sequence))[None])[0, -1].clone()
        for t in set(sequence):
            logits[t] = logits[t] * repetition if logits[t] < 0 else logits[t] / repetition
        for t, count in Counter(generated).items():
            logits[t] -= frequency * count + presence
        token = int(logits.argmax())
        sequence.append(token)
        generated.append(token)
    return generated


@torch.inference_mode()
def test_batched_penalised_generation_matches_a_brute_force_loop():
    """Each row of a left-padded batch keeps its own history; generated tokens only for presence/frequency."""
    _, model = tiny_pair("llama", seed=1)
    prompts = random_prompts(3, model.config.vocab_size, seed=5)
    settings = dict(repetition_penalty=1.2, presence_penalty=0.8, frequency_penalty=0.4)
    out = generate(model, prompts, max_new_tokens=25, cache="static", **settings)
    for prompt, row in zip(prompts, out.rows):
        assert row.token_ids == brute_force_penalised_greedy(model, prompt, 25, 1.2, 0.8, 0.4)


def test_notebook_runs(run_notebook):
    run_notebook("04_penalties.ipynb")
