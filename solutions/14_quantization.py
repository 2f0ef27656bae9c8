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


def e2m1_tie_predictions() -> dict[float, float]:
    """Exercise 3: One MXFP4 block, ties to even"""
    # Each tie sits between an even code and an odd one; the even one wins, so ties alternate:
    #   0.25: 0 (000) or 0.5 (001)  -> 0, down      0.75: 0.5 (001) or 1 (010) -> 1, up
    #   1.25: 1 (010) or 1.5 (011)  -> 1, down      1.75: 1.5 (011) or 2 (100) -> 2, up
    #   2.5:  2 (100) or 3 (101)    -> 2, down      3.5:  3 (101) or 4 (110)   -> 4, up
    #   5:    4 (110) or 6 (111)    -> 4, down
    return {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def mxfp4_quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """Exercise 3: One MXFP4 block, ties to even"""
    shared = torch.frexp(x.abs().max())[1] - 1 - 2  # floor(log2 max|x|) − emax, exactly (log2 can round up)
    scale = 2.0 ** shared.item()
    a = (x / scale).abs()  # the block's max is now in [4, 8)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))  # E2M1's spacing in a's binade
    nearest = (torch.round(a / step) * step).clamp(max=6)  # a / step counts steps from 0: round half to even
    return torch.sign(x) * nearest * scale
    # a / step counts steps from 0, and that count's parity is the code's last bit (4 = 2 steps of 2: code 110), so
    # rounding the count half to even is ties to even. Values past 6 saturate: the price of a power-of-two scale.


# ------------------------------------------------------------------ Exercise 4


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Exercise 4: Perplexity from logits"""
    logprobs = F.log_softmax(logits[:-1].float(), dim=-1)  # [T - 1, V]: the predictions with a next token
    nll = -logprobs.gather(1, tokens[1:, None]).mean()
    return float(nll.exp())


# ------------------------------------------------------------------ Exercise 5


def int4_error_bounds(weight: torch.Tensor, group_size: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5: Predict int4's worst-case error"""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    step = (w.amax(-1) - w.amin(-1)) / 15  # 16 levels span the group's range: 15 steps between them
    weight_bound = step / 2  # round to nearest: never more than half a step away ([N, K / group_size])
    per_weight = weight_bound.repeat_interleave(group_size, dim=1)  # [N, K]: each weight's own group bound
    output_bound = x.float().abs() @ per_weight.T  # |Σ_k x_k e_k| <= Σ_k |x_k| |e_k| <= Σ_k |x_k| step_k / 2
    return weight_bound, output_bound
    # Both bounds are reached: a weight halfway between two levels is off by exactly half a step, and an input
    # whose signs follow the errors' signs adds every error up with the same sign. For a random input the errors
    # mostly cancel: they behave like independent draws from [-step/2, step/2] (standard deviation step/√12), so
    # the typical output error grows like √K, not K. What sets the error is the group's range: one outlier
    # weight widens its group's step for all the others, which is why smaller groups lose less (at the price of
    # more scales: a float32 scale and zero per group are 2 extra bits per weight at 32, 0.5 at 128), and why
    # int8's 255 steps are 17x finer than int4's 15.
