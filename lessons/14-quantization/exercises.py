"""Lesson 14 exercises: write your answers here; `pytest lessons/14-quantization` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/14_quantization.py (try first!).

Conventions: weights are [N, K] (output features, input features), blocks and groups run along K; float32.
"""

from __future__ import annotations

import numpy as np  # noqa: F401
import torch  # noqa: F401


def decode_q4_1_block(block: bytes) -> np.ndarray:
    """Exercise 1: Decode a Q4_1 block by hand

    `block` is 20 bytes: float16 d (bytes 0-1, little-endian), float16 m (bytes 2-3), then 16 bytes of
    nibbles: weight i (i < 16) is the low nibble of byte 4 + i, weight i + 16 its high nibble.
    Return the 32 weights d·q + m as float32 [32].

    Hint: np.frombuffer(block[:4], dtype=np.float16) gives d and m.
    """
    raise NotImplementedError


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 2: Groupwise int4 in the kernel's form

    weight [N, K], K a multiple of group_size. For each group of `group_size` weights along K, map the
    group's minimum to q = 0 and its maximum to q = 15 (asymmetric, round to nearest). Return
    (q int64 [N, K] in 0..15, scale [N, K / group_size], zero [N, K / group_size]) such that
    weight ≈ (q − 8)·scale + zero, PyTorch's int4 kernel's formula. A constant group (max = min) must not
    divide by zero: give it scale 1.
    """
    raise NotImplementedError


def e2m1_tie_predictions() -> dict[float, float]:
    """Exercise 3: One MXFP4 block, ties to even

    Part 1, predict. Each value below lies exactly halfway between two E2M1 magnitudes. OCP MX rounds
    to nearest, ties to even: a tie goes to the neighbour whose code ends in 0. The codes:

        0 -> 000   0.5 -> 001   1 -> 010   1.5 -> 011   2 -> 100   3 -> 101   4 -> 110   6 -> 111

    Write down by hand, without running any rounding code, what each tie becomes, as
    {0.25: ..., 0.75: ..., 1.25: ..., 1.75: ..., 2.5: ..., 3.5: ..., 5.0: ...}. Which go up, which down?
    """
    raise NotImplementedError


def mxfp4_quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """Exercise 3: One MXFP4 block, ties to even

    Part 2, build. x [32] (finite, not all zero). The block shares a scale X = 2^(floor(log2 max|x|) − 2)
    (2 is E2M1's largest exponent); each x / X rounds to the nearest E2M1 value ±{0, 0.5, 1, 1.5, 2, 3, 4, 6},
    ties to even as you predicted, and beyond 6 saturates at 6. Return the decoded block X · P [32].

    Hint: an argmin over the eight values breaks ties towards the first one, always down. Instead, scale each
    value by the spacing of its binade (0.5 below 2, 1 in [2, 4), 2 from 4 on): torch.round rounds half to even.
    """
    raise NotImplementedError


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Exercise 4: Perplexity from logits

    logits [T, V]: the model's scores at each position of `tokens` [T] (logits[t] predicts tokens[t + 1]).
    Return exp(mean over t < T − 1 of −log softmax(logits[t])[tokens[t + 1]]): the T − 1 predictions the
    text allows. Work in float32 with log_softmax (never log(softmax(...)), which underflows).
    """
    raise NotImplementedError


def int4_error_bounds(weight: torch.Tensor, group_size: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5: Predict int4's worst-case error

    Predict, without quantizing anything, how far groupwise int4 (exercise 2's scheme: each group's minimum at
    q = 0, its maximum at q = 15, round to nearest) can move
      - each weight: return a bound per group, float32 [N, K / group_size], that |w - ŵ| never exceeds for any
        weight of the group, from the group's values alone;
      - each output of x @ weight.T for the inputs x [B, K]: a bound [B, N] on |x @ w.T - x @ ŵ.T|.
    Both bounds must be the tightest that hold whatever the rounding does (a constant group has no error).

    The check quantizes with the package (`minillm.speed.quant.quantize_int4_groupwise`, then `dequantize_int4`):
    no error exceeds your bounds, the weight bound is reached (nearly, by some weight of a large matrix), and the
    output bound is reached within 10% by the worst input for each output (x = ± the sign of each weight's error)
    on weights placed half a step between two levels.
    """
    raise NotImplementedError
