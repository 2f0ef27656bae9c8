"""Checks for lesson 03's exercises: transformers' warpers, the package's sampler, and a chi-square test."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import EtaLogitsWarper, TypicalLogitsWarper

from minillm.decoding.sampling import SamplingConfig, process_logits, sample_from_probs

NO_IDS = torch.zeros(1, 0, dtype=torch.long)  # the warpers ignore input_ids


def edge_logits() -> torch.Tensor:
    """Random rows, plus rows that trip up filters: -inf entries, many ties, one finite token, all equal."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3.0
    partly_inf = logits[0].clone()
    partly_inf[::3] = -math.inf
    ties = torch.randint(-2, 3, (50,), generator=torch.Generator().manual_seed(1)).float()
    one_finite = torch.full((50,), -math.inf)
    one_finite[25] = 0.5
    return torch.cat([logits, torch.stack([partly_inf, ties, one_finite, torch.zeros(50)])])


LOGITS = edge_logits()


def check_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    kept_ours, kept_theirs = ours > -math.inf, theirs > -math.inf
    assert torch.equal(kept_ours, kept_theirs), f"kept per row: yours {kept_ours.sum(-1).tolist()}, " \
                                                f"transformers' {kept_theirs.sum(-1).tolist()}"
    assert torch.equal(ours, theirs), "kept tokens must keep their logits unchanged"


@pytest.mark.parametrize("mass", [0.1, 0.3, 0.5, 0.77, 0.9, 0.97])
def test_exercise_1_typical_sampling(answers, mass):
    logits = LOGITS.clone()
    ours = answers.apply_typical(logits, mass)
    assert torch.equal(logits, LOGITS), "the input was modified"
    theirs = TypicalLogitsWarper(mass)(NO_IDS, LOGITS.clone())
    check_same(ours, theirs)
    assert bool((ours > -math.inf).any(-1).all()), "a row lost every token"


def test_exercise_1_typical_drops_the_most_likely_token_when_it_is_atypical(answers):
    # One likely token (p = 0.38) and a flat tail of 400: the best token's surprisal is further from
    # the entropy than the tail's, so typical sampling keeps the tail instead (top-p never would).
    logits = torch.cat([torch.tensor([[5.5]]), torch.zeros(1, 400)], dim=-1)
    ours = answers.apply_typical(logits, 0.5)
    check_same(ours, TypicalLogitsWarper(0.5)(NO_IDS, logits.clone()))
    assert ours[0, 0] == -math.inf


@pytest.mark.parametrize("epsilon", [3e-4, 1e-3, 3e-3, 0.01, 0.05, 0.2])
def test_exercise_2_eta_sampling(answers, epsilon):
    logits = LOGITS.clone()
    ours = answers.apply_eta(logits, epsilon)
    assert torch.equal(logits, LOGITS), "the input was modified"
    check_same(ours, EtaLogitsWarper(epsilon)(NO_IDS, LOGITS.clone()))
    assert bool((ours > -math.inf).any(-1).all()), "a row lost every token"


def test_exercise_2_eta_cuts_lower_when_entropy_is_high(answers):
    flat = torch.zeros(1, 1000)  # H = log 1000: eta = min(0.01, 0.1 / 1000) = 1e-4 < 1/1000, all survive
    assert bool((answers.apply_eta(flat, 0.01) > -math.inf).all())
    peaked = torch.cat([torch.tensor([[10.0]]), torch.zeros(1, 999)], dim=-1)
    check_same(answers.apply_eta(peaked, 0.01), EtaLogitsWarper(0.01)(NO_IDS, peaked.clone()))


def unguarded_draw(probs: torch.Tensor, u: float) -> int:
    """`sample_from_probs` for one row without its last line: may point past every token with mass."""
    cdf = probs.cumsum(dim=-1)
    return int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float32) * cdf[-1], right=True))


def test_exercise_3_the_unguarded_draw_falls_into_your_trap(answers):
    probs, u = answers.rounding_trap()
    assert isinstance(u, float) and 0.0 <= u < 1.0, "u: a Python float in [0, 1)"
    assert probs.dtype == torch.float32 and probs.dim() == 1 and bool((probs >= 0).all())
    assert abs(float(probs.sum()) - 1.0) < 1e-3, "probs should sum to about 1"
    assert probs[-1] == 0, "the last tokens of probs should have probability 0"
    token = unguarded_draw(probs, u)
    assert probs[min(token, len(probs) - 1)] == 0, f"the unguarded draw picks token {token}, which has mass"
    largest = float(torch.tensor(1 - 2 ** -24))  # the largest u torch.rand returns
    assert probs[unguarded_draw(probs, largest)] > 0, "torch.rand's largest u should not spring it"
    ours = answers.draw_token(probs, u)
    assert 0 <= ours < len(probs) and probs[ours] > 0, f"your draw fell into your own trap: token {ours}"


def test_exercise_3_the_guarded_draw_is_the_packages(answers):
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2)) * 2.0
    config = SamplingConfig(do_sample=True, temperature=0.8, top_p=0.7)
    probs = process_logits(logits, config, None).softmax(-1)  # [1, V], zeros outside the nucleus
    for seed in (0, 1):
        g_ours, g_package = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        ours = [answers.draw_token(probs[0], torch.rand(1, generator=g_ours).item()) for _ in range(2000)]
        package = [int(sample_from_probs(probs, [g_package])) for _ in range(2000)]
        assert ours == package, "not the package's token for the same random number"
        assert all(probs[0, t] > 0 for t in ours), "a filtered-out token was drawn"
    # One token with mass, at the start, and the largest u: every draw is that token, however the rounding falls.
    one = torch.zeros(50)
    one[0] = 1.0
    drawn = {answers.draw_token(one, u) for u in (0.0, 0.5, 1 - 2 ** -24, 1 - 2 ** -40)}
    assert drawn == {0}, f"only token 0 has mass; drawn: {sorted(drawn)}"


def test_exercise_4_gumbel_max_sampling(answers):
    vocab, n = 10, 20_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    processed = process_logits(logits, SamplingConfig(do_sample=True, temperature=0.9, top_k=7), None)[0]
    probs = processed.softmax(-1).double()
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([answers.gumbel_max_sample(processed, g) for _ in range(n)])
    counts = torch.bincount(draws, minlength=vocab).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a token at -inf was drawn"
    result = chisquare(counts[kept].numpy(), (probs[kept] / probs[kept].sum() * n).numpy())
    assert result.pvalue > 1e-3, f"draws do not follow softmax(logits): {result}, counts {counts.tolist()}"
    again = [answers.gumbel_max_sample(processed, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(again)) == 1, "the draw must come from the generator you are given"
