"""Checks for lesson 04's exercises: transformers' processors and generate(), and the package's own penalties."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from minillm.decoding.sampling import SamplingConfig, TokenHistory, process_logits, process_rows
from minillm.model.tiny import tiny_pair
from minillm.strategies.generate import generate

VOCAB = 12


def random_rows(batch: int, length: int, seed: int) -> torch.Tensor:
    """Rows over a small vocabulary, so n-grams repeat often. long [batch, length]."""
    return torch.randint(0, 5, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [2, 3, 9, 30])
def test_exercise_1_no_repeat_ngram_matches_transformers(answers, n, length):
    input_ids = random_rows(4, length, seed=n * 100 + length)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(length))
    original = logits.clone()
    ours = answers.apply_no_repeat_ngram(logits, input_ids.tolist(), n)
    assert torch.equal(logits, original), "the input logits were modified"
    theirs = NoRepeatNGramLogitsProcessor(n)(input_ids, logits.clone())
    assert torch.equal(ours, theirs), f"banned per row: yours {(ours == -math.inf).sum(-1).tolist()}, " \
                                      f"transformers' {(theirs == -math.inf).sum(-1).tolist()}"


def test_exercise_1_rows_of_different_lengths(answers):
    rows = [[1, 2, 3, 1, 2], [4, 4], [7, 8, 9, 7, 8, 9, 7]]
    out = answers.apply_no_repeat_ngram(torch.zeros(3, VOCAB), rows, 3)
    banned = [set(torch.nonzero(r == -math.inf).flatten().tolist()) for r in out]
    assert banned == [{3}, set(), {8}]


def tiny_llama():
    hf_model, model = tiny_pair("llama", seed=2)
    hf_model.generation_config.eos_token_id = None  # both sides generate exactly max_new_tokens
    return hf_model, model


PROMPTS = [[5, 17, 5, 17, 3], [40, 2, 9, 11, 60, 1, 8]]
NEW = 20


@pytest.mark.parametrize("n", [2, 3])
def test_exercise_2_loop_with_no_repeat_ngram_matches_transformers_generate(answers, n):
    hf_model, model = tiny_llama()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                     no_repeat_ngram_size=n, pad_token_id=0)[0, len(prompt):].tolist()
        ours = answers.greedy_with_processor(model, prompt, NEW, NoRepeatNGramLogitsProcessor(n))
        assert ours == expected, prompt


def test_exercise_2_loop_with_repetition_penalty_matches_minillm_generate(answers):
    _, model = tiny_llama()
    changed = 0
    for prompt in PROMPTS:
        config = SamplingConfig(max_new_tokens=NEW, eos_token_id=())
        expected = generate(model, prompt, config, repetition_penalty=1.5).rows[0].token_ids
        ours = answers.greedy_with_processor(model, prompt, NEW, RepetitionPenaltyLogitsProcessor(1.5))
        assert ours == expected, prompt
        plain = answers.greedy_with_processor(model, prompt, NEW, lambda input_ids, scores: scores)
        assert plain == generate(model, prompt, config).rows[0].token_ids, "with no processor: plain greedy"
        changed += plain != ours
    assert changed, "the penalty never changed the output: this check could not notice it missing"


def batch_with_history(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 30, (n,), generator=g).tolist() for n in (4, 9, 1, 6, 12)]
    history = TokenHistory.from_prompts(prompts, 30)
    for _ in range(15):
        history.add(torch.randint(0, 10, (len(prompts),), generator=g))  # small range: repeats
    logits = torch.randn(len(prompts), 30, generator=g) * 4
    logits[:, 0] = 0.0
    logits[1, 3] = -math.inf
    return logits, history


def test_exercise_3_per_row_penalties_match_the_package(answers):
    logits, history = batch_with_history(seed=3)
    settings = [(1.0, 0.0, 0.0), (1.3, 0.5, 0.0), (0.8, 0.0, 1.0), (2.0, 1.5, 0.25), (1.3, 0.5, 0.0)]
    configs = [SamplingConfig(repetition_penalty=r, presence_penalty=p, frequency_penalty=f) for r, p, f in settings]
    original = logits.clone()
    ours = answers.penalise_rows(logits, history, *(torch.tensor(column) for column in zip(*settings)))
    assert torch.equal(logits, original), "the input logits were modified"
    assert torch.equal(ours, process_rows(logits, configs, history))
    for row, config in enumerate(configs):  # and each row is what it would be alone
        alone = process_logits(logits[row:row + 1], config, history.select(torch.tensor([row])))
        assert torch.equal(ours[row:row + 1], alone)


def simulate(lead: float, presence: float, frequency: float, steps: int) -> int | None:
    """Greedy on fixed logits [lead, 0] through the package's penalties: picks of token 0 before token 1 wins."""
    logits = torch.tensor([[lead, 0.0]])
    history = TokenHistory.from_prompts([[]], 2)
    config = SamplingConfig(presence_penalty=presence, frequency_penalty=frequency)
    for picks in range(steps + 1):
        token = process_logits(logits, config, history).argmax(-1)
        if int(token) == 1:
            return picks
        history.add(token)
    return None


@pytest.mark.parametrize("lead,presence,frequency", [
    (6.0, 0.0, 2.0), (6.0, 0.5, 2.0), (6.0, 2.0, 0.5), (0.25, 0.5, 0.0), (3.0, 0.0, 0.25), (1.0, 1.0, 0.0),
    (5.5, 1.5, 1.0), (8.0, 0.0, 0.0), (-0.5, 1.0, 1.0), (0.0, 0.0, 0.5), (2.0, 0.0, 0.75),
])
def test_exercise_4_leader_keeps_the_argmax(answers, lead, presence, frequency):
    assert answers.picks_before_overtaken(lead, presence, frequency, max_uses=200) == \
        simulate(lead, presence, frequency, steps=200)
