"""Rotary position embeddings (RoPE): the cos/sin table and the rotation that q and k go through.

A position is not added to the token's vector: q and k are rotated, pair of dims by
pair of dims, by angles proportional to the position, so a score q·k depends on how
far apart two tokens are. `RopeTable` holds the angles (plain, partial and long-RoPE,
lessons 06 and 17); `apply_rope` rotates with them. Both compute as transformers does,
so that a model here and its transformers twin can be compared exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import ModelConfig


def rope_inv_freq(rotary_dim: int, theta: float, factors=None) -> torch.Tensor:
    """[rotary_dim / 2] rotation speeds, theta^(-2i/rotary_dim); long-RoPE divides each by its factor.

    Written as transformers writes it, so that float32 gives the same bits.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if factors is None:
        return 1.0 / (theta ** exponents)
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


def yarn_inv_freq(rotary_dim: int, theta: float, factor: float, betas: tuple[float, float], original_max: int,
                  truncate: bool) -> torch.Tensor:
    """[rotary_dim / 2] YaRN's speeds (Peng et al., 2023): a pair that turns more than beta_fast times over the
    pretraining context keeps its speed, one that turns fewer than beta_slow times is slowed by `factor` (stretched
    to the longer context), and the pairs between blend linearly by their index. As transformers computes it.
    """
    def pair_turning(rotations: float) -> float:  # the (fractional) pair index that turns this often over the context
        return rotary_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(betas[0]), pair_turning(betas[1])
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: keep speed
    speeds = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return 1.0 / (factor * speeds) * ramp + 1.0 / speeds * (1 - ramp)


class RopeTable:
    """cos and sin for positions 0..n-1, computed once per dtype and device.

    Decoding one token would otherwise recompute ~10 small tensors per step; a
    lookup is one gather. `sin` has the rotate-half sign folded in (its first half
    negated), so rotating needs no negation: x * cos + swap_halves(x) * sin.

    The table starts at `context_length` positions and grows on demand (doubling) when a
    larger position is asked for: RoPE itself has no last position, and keeping a
    cache while sliding past the context (lesson 06) numbers tokens beyond
    context_length. Each position's angles are computed independently, so growing
    changes no entry that was already there.

    Partial RoPE (`rotary_dim` < head_dim) rotates pairs (i, i + head_dim/2) for
    i < rotary_dim/2 and gives the other dims angle 0 (cos 1, sin 0: x passes
    unchanged, exactly). The loader reorders each head's q/k rows so the rotating
    dims sit there (`minillm.model.weight_names.rotary_order`); a dot product does not care
    how the dims of q and k are ordered, as long as both are ordered alike.

    Long-RoPE (Phi-3) divides each speed by a factor, one set for contexts up to
    the pretraining length and one beyond, and scales cos and sin. Like transformers,
    each forward picks the set by its largest position. YaRN (gpt-oss) slows only the
    slow pairs, at every position alike (`yarn_inv_freq`), and scales cos and sin too.
    """

    def __init__(self, config: ModelConfig, theta: float | None = None):
        self.context_length, self.head_dim = config.context_length, config.head_size
        self.theta = config.rope_theta if theta is None else theta
        self.rotary_dim = config.rotary_dim or config.head_size
        self.original_max = config.rope_original_max if config.rope_long_factor is not None else None
        self.factors = {False: config.rope_short_factor, True: config.rope_long_factor}
        self.scale = config.rope_attention_factor
        self.yarn = config if config.rope_yarn_factor is not None else None
        self.tables: dict = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, T, 1, head_dim] (broadcast over heads)."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        long = self.original_max is not None and needed > self.original_max
        key = (dtype, positions.device, "long") if long else (dtype, positions.device)
        table = self.tables.get(key)
        size = len(table[0]) if table is not None else 0
        if table is None or needed > size:
            self.tables[key] = self.build(max(self.context_length, needed, 2 * size), dtype, positions.device, long)
        cos, sin = self.tables[key]
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def build(self, size: int, dtype: torch.dtype, device, long: bool):
        """cos, signed sin [size, head_dim]; angles in float32 (bf16 positions lose whole tokens), cast at the end."""
        if self.yarn is not None:
            c = self.yarn
            inv_freq = yarn_inv_freq(self.rotary_dim, self.theta, c.rope_yarn_factor, c.rope_yarn_betas,
                                     c.rope_original_max, c.rope_yarn_truncate).to(device)
        else:
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.factors[long]).to(device)
        angles = torch.arange(size, device=device).float()[:, None] * inv_freq  # [size, rotary_dim/2]
        cos, sin = angles.cos() * self.scale, angles.sin() * self.scale
        still = (self.head_dim - self.rotary_dim) // 2  # dims per half that do not rotate
        cos, sin = F.pad(cos, (0, still), value=1.0), F.pad(sin, (0, still))  # [size, head_dim/2]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of x [..., head_dim] by its position's angle.

    Same numbers as transformers' x * cos + rotate_half(x) * sin: negating is exact,
    so folding the sign of rotate_half into `signed_sin` changes no bit.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


__all__ = ["RopeTable", "apply_rope", "rope_inv_freq", "yarn_inv_freq"]
