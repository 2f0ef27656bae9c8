"""How far a lower-precision model drifts from float32.

Halving the bytes per weight halves what a memory-bound decoder reads per token,
but every matmul then rounds to 8 (bf16) or 11 (fp16) significant bits instead of
24. Whether that matters is an empirical question, answered on the real model by
three numbers:

* top-1 agreement: how often the low-precision model's most likely next token is
  float32's, over every position of a teacher-forced text;
* KL(p32 || p_low): how much probability mass moves, per position (nats);
* first divergence: the first generated token where greedy decoding in the two
  precisions parts ways (after that the texts are simply different continuations).

    reference = next_token_logits(model32, ids)
    drift(reference, next_token_logits(model16, ids)).top1_agreement
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from ..model.loading import resolve_dtype
from ..model.transformer import causal_positions


def with_dtype(model, dtype):
    """A copy of `model` whose weights (and hence activations) are in `dtype`; the original is untouched."""
    return copy.deepcopy(model).to(resolve_dtype(dtype))


@torch.inference_mode()
def next_token_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits [T, vocab] at every position of one teacher-forced sequence (one forward)."""
    tokens = torch.tensor([token_ids], device=model.device)
    return model(tokens, causal_positions(1, len(token_ids), model.device))[0].float()


@dataclass
class Drift:
    positions: int
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    mean_kl: float  # mean over positions of KL(reference || other), nats
    max_kl: float

    def to_dict(self) -> dict:
        return asdict(self)


def drift(reference_logits: torch.Tensor, logits: torch.Tensor) -> Drift:
    """Compare next-token distributions position by position: [T, V] each."""
    ref_logp = reference_logits.float().log_softmax(-1)
    logp = logits.float().log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [T]
    agree = (reference_logits.argmax(-1) == logits.argmax(-1)).float().mean()
    return Drift(positions=len(kl), top1_agreement=float(agree), mean_kl=float(kl.mean()), max_kl=float(kl.max()))


def first_divergence(reference_ids: list[int], other_ids: list[int]) -> int | None:
    """Index of the first differing token of two generations, or None if one is a prefix of the other."""
    for i, (a, b) in enumerate(zip(reference_ids, other_ids)):
        if a != b:
            return i
    return None


__all__ = ["Drift", "drift", "first_divergence", "next_token_logits", "with_dtype"]
