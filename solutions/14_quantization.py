"""Worked answers for lesson 14's exercises (lessons/14-quantization/exercises.py).

Check them: `pytest lessons/14-quantization --solutions`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ Exercise 1


def decode_q4_1_block(block: bytes) -> np.ndarray:
    """Exercise 1: Decode a Q4_1 block by hand"""
    d, m = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    nibbles = np.frombuffer(block[4:20], dtype=np.uint8)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4])  # weights 0-15 low nibbles, 16-31 high nibbles
    return d * q.astype(np.float32) + m
    # 20 bytes for 32 weights: 5 bits per weight, and the int4 kernel takes q as it is, scale d, zero m + 8d.


# ------------------------------------------------------------------ Exercise 2


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 2: Groupwise int4 in the kernel's form"""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).long()
    # w ≈ q·s + low = (q − 8)·s + (low + 8·s): the kernel's zero is low + 8·s
    return q.reshape(n, k), scale, low + 8 * scale


# ------------------------------------------------------------------ Exercise 3


def mxfp4_quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """Exercise 3: One MXFP4 block"""
    scale = 2.0 ** (torch.floor(torch.log2(x.abs().max())) - 2)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    magnitude = (x.abs() / scale).clamp(max=6)
    nearest = grid[(magnitude[:, None] - grid[None, :]).abs().argmin(dim=1)]
    return torch.sign(x) * nearest * scale
    # The max lands in [4, 8) after scaling, so values above 6 saturate: MXFP4's price for a power-of-two scale.


# ------------------------------------------------------------------ Exercise 4


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Exercise 4: Perplexity from logits"""
    logprobs = F.log_softmax(logits[:-1].float(), dim=-1)  # [T - 1, V]: the predictions with a next token
    nll = -logprobs.gather(1, tokens[1:, None]).mean()
    return float(nll.exp())
