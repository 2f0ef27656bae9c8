"""The norms every family uses (LayerNorm, RMSNorm, Gemma's RMSNorm), their statistics taken in float32.

A norm's statistics are a sum of d squares: in float16 or bfloat16 they lose the
digits that matter, so each norm here computes them in float32 whatever the
weights' dtype and casts back after normalising, as transformers does (lesson 05).
`ModelConfig.norm` picks one (`make_norm`); QK-norm uses the same one over head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like Llama (it matters in fp16/bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), scaled in float32 and only then cast.

    The weight is stored as an offset from 1 (zero-initialised), and Gemma multiplies
    before casting where Llama casts first: in bf16 the two round differently.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose statistics are taken in float32 whatever the weights' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float()
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The config's norm over `dim` features (default d_model; QK-norm uses head_dim)."""
    dim = dim or config.d_model
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    if config.norm == "gemma_rmsnorm":
        return GemmaRMSNorm(dim, config.norm_eps)
    return LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


__all__ = ["GemmaRMSNorm", "LayerNorm", "RMSNorm", "make_norm"]
