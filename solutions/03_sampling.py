"""Worked answers for lesson 03 (checked by `pytest lessons/03-sampling --solutions`)."""

from __future__ import annotations

import math

import torch


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum p log p per row, [batch, 1]. A token at -inf has p = 0 and log p = -inf: 0 * -inf is
    NaN in floating point, while its true contribution is 0, hence nansum."""
    log_probs = logits.log_softmax(dim=-1)
    return -(log_probs.exp() * log_probs).nansum(dim=-1, keepdim=True)


def apply_typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Exercise 1: Typical sampling"""
    log_probs = logits.log_softmax(dim=-1)  # [B, V]
    distance = (-log_probs - entropy(logits)).abs()  # how atypical each token is: |surprisal - H|
    sorted_distance, order = distance.sort(dim=-1)  # most typical first
    cumulative = log_probs.exp().gather(-1, order).cumsum(dim=-1)  # mass of the i most typical tokens
    # The first position where the mass reaches `mass` (clamped: rounding may leave it just short).
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    cutoff = sorted_distance.gather(-1, last)  # [B, 1]: the distance of the last token needed
    remove = distance > cutoff  # ties with the last needed token stay, as in transformers
    remove.scatter_(-1, order[:, :1], False)  # the most typical token always survives
    return logits.masked_fill(remove, -math.inf)


def apply_eta(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Exercise 2: Eta sampling"""
    probs = logits.softmax(dim=-1)
    eps = torch.tensor(epsilon, dtype=logits.dtype)
    eta = torch.minimum(eps, eps.sqrt() * torch.exp(-entropy(logits)))  # [B, 1]: lower when H is high
    remove = probs < eta
    remove &= logits < logits.amax(dim=-1, keepdim=True)  # never the best token (nor one tied with it)
    return logits.masked_fill(remove, -math.inf)


def rounding_trap() -> tuple[torch.Tensor, float]:
    """Exercise 3: Inverse-CDF draw"""
    # torch.rand's u is at most 1 - 2^-24, and for a total c near 1 the product c - c * 2^-24 lies at least
    # half a float32 spacing below c, so it rounds below c: torch.rand alone never springs the trap. A u with
    # more bits (Python's random.random(), numpy's float64) can sit closer to 1 than a float32 can: 1 - 2^-30
    # becomes 1.0 when it is turned into a float32 tensor, and the target lands on cdf[-1] itself. The cdf is
    # flat over the trailing zeros, so no index has cdf > target: searchsorted returns V, past the end, and
    # clamping that into the vocabulary picks the last token, of probability 0.
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0])
    return probs, 1 - 2 ** -30


def draw_token(probs: torch.Tensor, u: float) -> int:
    """Exercise 3: Inverse-CDF draw"""
    cdf = probs.cumsum(dim=-1)  # [V]; cdf[i] - cdf[i-1] = probs[i]: an empty interval when probs[i] = 0
    target = torch.tensor([u], dtype=torch.float32) * cdf[-1]  # scaled to the total, as float32 sums are not 1
    token = int(torch.searchsorted(cdf, target, right=True))  # first index with cdf > target
    # The guard: a target on cdf[-1] (part 1) finds no such index; fall back to the last token that has mass.
    last_with_mass = int(torch.nonzero(probs > 0).max())
    return min(token, last_with_mass)


def gumbel_max_sample(logits: torch.Tensor, generator: torch.Generator) -> int:
    """Exercise 4: Gumbel-max sampling"""
    # torch.rand draws from [0, 1); keep U away from 0 so that -log(-log U) stays finite.
    u = torch.rand(logits.shape, generator=generator).clamp_min(torch.finfo(torch.float32).tiny)
    gumbel = -torch.log(-torch.log(u))
    # argmax_i (z_i + g_i) equals i with probability softmax(z)_i: the max of Gumbels shifted by z_i
    # is again Gumbel, shifted by logsumexp(z). A -inf logit stays -inf and can never win.
    return int((logits + gumbel).argmax())
