"""Lesson 14 exercises: write your answers here; `pytest lessons/14-quantization` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/14_quantization.py (try first!).

Conventions: weights are [N, K] (output features, input features), blocks and groups run along K; float32.
"""

from __future__ import annotations

import numpy as np  # noqa: F401
import torch  # noqa: F401


def decode_q4_0_block(block: bytes) -> np.ndarray:
    """Exercise 1: Decode a Q4_0 block by hand

    The notebook decodes the default model's Q4_1 blocks; many GGUFs ship Q4_0 instead, which drops the
    minimum. `block` is one Q4_0 block of 18 bytes, as ggml defines it:

        bytes 0-1    d (float16, little-endian)   the step; it can be negative
        bytes 2-17   nibbles                      weight i (i < 16): the low nibble of byte 2 + i,
                                                  weight i + 16: the high nibble of the same byte
        w = d·(q − 8),   q in 0..15

    Return the 32 weights as float32 [32]. Mind the types: a nibble read from a uint8 array is still uint8.
    Then answer for yourself: how many bits per weight is that, and what scale and zero would hand these
    codes to PyTorch's int4 kernel, w = (q − 8)·scale + zero, as they are?
    """
    raise NotImplementedError


def quantize_int4_clipped(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 2: Clip the range, cut the error

    weight [N, K], K a multiple of group_size. The package's groupwise int4 (`quantize_int4_groupwise`) spends
    its 16 levels on each group's whole range, min to max: one outlier stretches the step for all 32 weights.
    Predict first: in a group of 31 small weights and one outlier, how many levels do the small ones use, and
    what does shrinking the range (the outlier then saturates at q = 0 or 15) trade against what?

    Then build it: for each group, try every range [min + a·(max − min), max − b·(max − min)], cutting each end
    on its own by a and b from 0 to 0.25 in steps of 0.025 (121 ranges; a = b = 0 is min-max), round every weight
    to the nearest of each range's 16 levels (what falls outside saturates at q = 0 or 15), and keep the range
    whose squared error Σ(w − ŵ)² over the group is least.
    Return (q int64 [N, K] in 0..15, scale [N, K / group_size], zero [N, K / group_size]) in the kernel's form,
    weight ≈ (q − 8)·scale + zero. A constant group must not divide by zero: give it scale 1.
    """
    raise NotImplementedError


def e2m3_tie_predictions() -> dict[str, list[float]]:
    """Exercise 3: One MXFP4 block, ties to even

    Part 1, predict. The README lists every E2M1 tie and where it goes; do the same for E2M3, MXFP6's finer
    element, which nothing in the lesson lists. E2M3 is a sign, 2 exponent bits f (bias 1) and 3 mantissa bits
    m: 2^(f − 1)·(1 + m/8) when f > 0, the subnormal m/8 when f = 0; its 32 magnitude codes 00000 to 11111
    run from 0 to 7.5 in ascending order, with no infinity or NaN.

    Between each pair of adjacent positive E2M3 values lies one tie, their midpoint. Under round to nearest,
    ties to even, a tie goes to the neighbour whose code ends in 0. Work out, from the codes and without running
    any rounding code (no ml_dtypes, no minillm.speed.mx_elements), which ties round up and which down, and
    return them as {"up": [ties that round up], "down": [ties that round down]}, each tie as a float.
    Before you list them: how many go each way, and which way does a tie between the last value of one binade
    and the first of the next go (0.875 | 1, 1.875 | 2, 3.75 | 4)?
    """
    raise NotImplementedError


def mxfp4_quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """Exercise 3: One MXFP4 block, ties to even

    Part 2, build. x [32] (finite, not all zero). The block shares a scale X = 2^(floor(log2 max|x|) − 2)
    (2 is E2M1's largest exponent); each x / X rounds to the nearest E2M1 value ±{0, 0.5, 1, 1.5, 2, 3, 4, 6},
    ties to even (the rule of part 1, on E2M1's codes 000 to 111), and beyond 6 saturates at 6. Return the
    decoded block X · P [32].

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

    Predict, without quantizing anything, how far groupwise int4 (the package's min-max scheme: each group's
    minimum at q = 0, its maximum at q = 15, round to nearest) can move
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


def decode_q4_k_block(block: bytes) -> np.ndarray:
    """Exercise 6: A Q4_K super-block by hand

    The files llama.cpp users download are K-quants: a Q4_K_M (Gemma 3 270M ships as one) stores most matrices
    as Q4_K, super-blocks of 256 weights in 144 bytes, as llama.cpp's `dequantize_row_q4_K` reads them:

        bytes 0-1      d      (float16)  the step of the sub-block scales
        bytes 2-3      dmin   (float16)  the step of the sub-block minimums
        bytes 4-15     eight 6-bit scales and eight 6-bit mins, packed: sub-block j < 4 keeps its scale in the low
                       6 bits of byte 4 + j and its min in the low 6 bits of byte 8 + j; sub-block j >= 4 takes the
                       low 4 bits of its scale from the low nibble of byte 12 + (j - 4), the low 4 bits of its min
                       from that byte's high nibble, and the top 2 bits of each from the top 2 bits of bytes
                       4 + (j - 4) (scale) and 8 + (j - 4) (min)
        bytes 16-143   the 4-bit codes in four chunks of 32 bytes: chunk c holds sub-block 2c in its low nibbles and
                       sub-block 2c + 1 in its high nibbles (weight i of a sub-block in byte i of its chunk)
        sub-block j (32 weights):  w = d·scale_j·q − dmin·min_j,   q in 0..15

    Return the 256 weights as float32 [256]. Then answer for yourself: how many bits per weight is that, and why
    do the scales themselves get quantized (to 6 bits, under one float16 step) rather than stored as float16?
    """
    raise NotImplementedError


def smoothquant_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """Exercise 7: Move the outliers into the weights

    A language model's activations have a few input channels far larger than the rest (the notebook draws
    max|x| per channel), so one int8 scale per activation row or per tensor spends its 255 levels on them and
    rounds every other channel coarsely. Weights have no such channels. SmoothQuant (Xiao et al., 2023) divides
    each input channel j of x by s_j and multiplies column j of W by it: (x / s) · (W · s)ᵀ = x · Wᵀ exactly,
    and picks

        s_j = max|x_j|^alpha / max_n |W[n, j]|^(1 − alpha)

    so that alpha = 0.5 gives channel j the same largest magnitude in x / s as in W · s. act_absmax [K]: max|x_j|
    over calibration text; weight [N, K]. Return s [K] (float32; a channel that is zero in x or W gets s = 1).
    Predict first: with one channel 50 times the others, how much finer does static int8 quantize the other
    channels after smoothing with alpha = 0.5? The check migrates the scales and runs the package's static int8
    linear on both.
    """
    raise NotImplementedError
