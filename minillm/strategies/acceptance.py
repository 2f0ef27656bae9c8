"""The speculative acceptance rule, and the cost model that says what drafting buys (lesson 08).

- Greedy: a drafted token is accepted while it equals the target's argmax; the first
  mismatch is replaced by the argmax. Output is identical to plain greedy decoding.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): accept drafted token x with
  probability min(1, p(x)/q(x)); on rejection draw from normalise(max(0, p - q)); after
  a fully accepted draft draw a bonus token from p. The emitted token is distributed
  exactly as p: P(y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y). p and q are the
  target's and the drafter's distributions after the same logits processors plain
  sampling uses (`minillm.decoding.sampling.process_logits`). A deterministic drafter has a
  one-hot q, so the rule becomes "accept x with probability p(x), else draw from p
  without x".

The cost model. With acceptance rate a per drafted token (each accepted independently)
and k drafted tokens, a round emits on average (1 - a^(k+1)) / (1 - a) tokens. If a
draft forward costs c target forwards (and a (k+1)-token verify costs one), a round
costs k c + 1, so the expected speedup over plain decoding is
(1 - a^(k+1)) / ((1 - a)(k c + 1)).
"""

from __future__ import annotations

import torch

from ..decoding.sampling import SamplingConfig, sample_from_probs


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) elementwise: how likely a token drafted from q survives a target with p."""
    return torch.where(q > 0, (p / q).clamp(max=1.0), torch.ones_like(p))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)): where to draw from after a rejection (the mass q lacks)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # A rejection implies p(x) < q(x), hence mass elsewhere; only rounding can leave none.
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def verify_token(target_logits: torch.Tensor, draft_token: int, q: torch.Tensor | None, config: SamplingConfig,
                 generator: torch.Generator | None) -> tuple[int, bool]:
    """Judge one drafted token against the target's processed logits [V].

    Returns (the token to emit, whether it is the drafted one). q [V] is the drafter's
    distribution; None means a deterministic drafter (q is one-hot on `draft_token`).
    """
    if config.greedy:
        best = int(target_logits.argmax())
        return best, best == draft_token
    p = target_logits.softmax(-1)
    if q is None:
        q = torch.zeros_like(p)
        q[draft_token] = 1.0
    u = torch.rand((), generator=generator, device=generator.device)
    if u < acceptance_probability(p[draft_token], q[draft_token]):
        return draft_token, True
    return int(sample_from_probs(residual_distribution(p, q)[None], [generator])), False


def expected_tokens_per_round(acceptance_rate: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one target forward yields, drafts accepted independently."""
    a = acceptance_rate
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def acceptance_from_share(accepted_share: float, k: int) -> float:
    """The per-token acceptance probability a that makes a fraction `accepted_share` of k drafted tokens accepted.

    What a run measures is accepted / drafted. Under the model (each drafted token accepted with
    probability a, independently, until the first rejection) a round accepts a + a² + ... + a^k
    tokens on average, so accepted / drafted = a(1 - a^k) / (k(1 - a)), which is below a for k > 1.
    Feeding the measured share to `expected_tokens_per_round` as if it were a would predict too few
    tokens; this inverts the relation (bisection), and then expected_tokens_per_round(a, k) = 1 + k·share.
    """
    if not 0.0 <= accepted_share <= 1.0:
        raise ValueError(f"accepted_share={accepted_share}: a share of drafted tokens lies in [0, 1]")
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        share = (expected_tokens_per_round(a, k) - 1) / k
        low, high = (a, high) if share < accepted_share else (low, a)
    return (low + high) / 2


def predicted_speedup(acceptance_rate: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding when a draft forward costs `cost_ratio` target forwards
    and verifying k + 1 tokens costs `verify_cost` one-token target forwards (1 when weight
    reads dominate; more on a CPU, where k + 1 rows of arithmetic are not free)."""
    return expected_tokens_per_round(acceptance_rate, k) / (k * cost_ratio + verify_cost)


__all__ = ["acceptance_probability", "residual_distribution", "verify_token", "expected_tokens_per_round",
           "acceptance_from_share", "predicted_speedup"]
