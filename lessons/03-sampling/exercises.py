"""Lesson 03 exercises: write your answers here; `pytest lessons/03-sampling` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/03_sampling.py
(try first: `pytest lessons/03-sampling --solutions` runs the checks on them).

Like the processors in `minillm/decoding/sampling.py`, a processor here is a pure function
logits [batch, vocab] -> logits [batch, vocab] that sets removed tokens to -inf and
leaves the others unchanged (and does not modify its input).
"""

from __future__ import annotations

import math  # noqa: F401

import torch  # noqa: F401


def apply_typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Exercise 1: Typical sampling

    Locally typical sampling (Meister et al. 2022), transformers' `TypicalLogitsWarper(mass)`:
    per row, compute the entropy H = -sum p_i log p_i (tokens already at -inf contribute 0), rank
    tokens by how far their surprisal -log p_i is from H (closest first), and keep the shortest
    prefix of that ranking whose probability mass reaches `mass`; tokens exactly as far from H as
    the last kept one are kept too. At least one token always survives.

    logits: float32 [batch, vocab] (may hold -inf); mass in (0, 1).
    Returns float32 [batch, vocab]: kept logits unchanged, the rest -inf.
    """
    raise NotImplementedError


def apply_eta(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Exercise 2: Eta sampling

    Eta sampling (Hewitt et al. 2022), transformers' `EtaLogitsWarper(epsilon)`: remove every token
    whose probability is below eta = min(epsilon, sqrt(epsilon) * exp(-H)), H the row's entropy
    (as in exercise 1). Epsilon sampling would cut at the fixed threshold epsilon; eta lowers the
    cut when the distribution is spread out (high entropy). The most probable token (and any tied
    with it) always survives.

    logits: float32 [batch, vocab] (may hold -inf); epsilon in (0, 1).
    Returns float32 [batch, vocab].
    """
    raise NotImplementedError


def rounding_trap() -> tuple[torch.Tensor, float]:
    """Exercise 3: Inverse-CDF draw

    Part 1, break it. The package's draw (`minillm.decoding.sampling.sample_from_probs`), for one row:
    cdf = probs.cumsum(-1); target = u * cdf[-1], u uniform in [0, 1) as a float32 tensor, scaled by the
    total mass (float32 sums are not exactly 1); token = torch.searchsorted(cdf, target, right=True), the
    first index whose cumulative probability exceeds the target. Its last line, a guard, caps the token at
    the last one with mass. Find what the guard is for.

    First, predict: torch.rand's u is a float32, at most 1 - 2^-24. Can u * cdf[-1], multiplied in float32,
    round onto cdf[-1] when the total is near 1? (The exact product is cdf[-1] - cdf[-1] * 2^-24: compare
    that distance with the float32 spacing just below cdf[-1].) So where must a u come from that does?

    Then return (probs, u): probs float32 [V], non-negative, summing to about 1, its last tokens 0; u a
    Python float with 0 <= u < 1, for which the draw above without the guard (u turned into a float32
    tensor first, as torch does) points past every token with mass: past the end of the vocabulary, or,
    clamped into it, onto a token of probability 0.
    """
    raise NotImplementedError


def draw_token(probs: torch.Tensor, u: float) -> int:
    """Exercise 3: Inverse-CDF draw

    Part 2, guard it. The draw of part 1 for one row (probs float32 [V], zeros for filtered tokens; u a
    Python float in [0, 1), turned into a float32 tensor), with the guard added: a token of probability 0
    must never come out, on your trap of part 1 or anywhere else.

    Returns the token id (an int). For u = torch.rand(1, generator=g).item(), the same token as the
    package's sample_from_probs(probs[None], [g]).
    """
    raise NotImplementedError


def gumbel_max_sample(logits: torch.Tensor, generator: torch.Generator) -> int:
    """Exercise 4: Gumbel-max sampling

    Draw one token from softmax(logits) without a softmax or a cumulative sum: add independent
    Gumbel noise g_i = -log(-log U_i), U_i uniform in (0, 1) from `generator` (one per token), and
    take the argmax of logits + g. Tokens at -inf must never be drawn.

    logits: float32 [vocab] (processed logits, may hold -inf).
    Returns the token id (an int).
    """
    raise NotImplementedError
