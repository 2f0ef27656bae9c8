"""Worked answers for lesson 14's exercises (lessons/14-quantization/exercises.py).

Check them: `pytest lessons/14-quantization --solutions`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ Exercise 1


def decode_q4_0_block(block: bytes) -> np.ndarray:
    """Exercise 1: Decode a Q4_0 block by hand"""
    d = np.frombuffer(block[:2], dtype="<f2").astype(np.float32)[0]
    nibbles = np.frombuffer(block[2:18], dtype=np.uint8)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.int8)  # weights 0-15 low, 16-31 high nibbles
    return d * (q - 8).astype(np.float32)  # q - 8 in int8: in uint8, q < 8 would wrap round to 248..255
    # 18 bytes for 32 weights: 4.5 bits per weight, half a bit less than Q4_1, for a grid centred on zero (d times
    # −8 .. 7) instead of one spanning the block's own minimum to maximum. It is the int4 kernel's formula with
    # scale d and zero 0. llama.cpp's quantizer sets d = (the weight of largest magnitude) / −8, so that weight is
    # exactly −8·d, at q = 0: the grid's one extra level (−8 has no +8) goes to the largest weight whatever its
    # sign, which is why d is negative whenever that weight is positive.


# ------------------------------------------------------------------ Exercise 2


def quantize_int4_clipped(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 2: Clip the range, cut the error"""
    # The prediction: with one outlier the step is about (outlier − rest)/15, so the 31 small weights share the two
    # or three levels nearest them, and most of their own values become rounding error. Cutting the outlier's end
    # gives them finer levels; the outlier saturates and pays an error that grows with the cut, so the best cut
    # balances 31 small errors against one large one. An outlier sits at one end: cut each end on its own. The cut
    # (0, 0) is min-max itself, so the search never does worse than it.
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    span = high - low
    best = None
    cuts = torch.linspace(0, 0.25, 11).tolist()
    for cut_low in cuts:
        for cut_high in cuts:
            bottom, top = low + cut_low * span, high - cut_high * span
            scale = (top - bottom) / 15
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round((w - bottom[..., None]) / scale[..., None]).clamp(0, 15)  # outside the range: saturated
            error = ((q * scale[..., None] + bottom[..., None] - w) ** 2).sum(dim=2)  # [N, K / group_size]
            if best is None:
                best = [error, q, scale, bottom]
                continue
            better = error < best[0]
            best = [torch.where(better, error, best[0]), torch.where(better[..., None], q, best[1]),
                    torch.where(better, scale, best[2]), torch.where(better, bottom, best[3])]
    _, q, scale, bottom = best
    # w ≈ q·s + bottom = (q − 8)·s + (bottom + 8·s): the kernel's zero is bottom + 8·s
    return q.long().reshape(n, k), scale, bottom + 8 * scale


# ------------------------------------------------------------------ Exercise 3


def e2m3_tie_predictions() -> dict[str, list[float]]:
    """Exercise 3: One MXFP4 block, ties to even"""
    # The 32 magnitudes, in code order: four binades of eight values each (the subnormals 0 .. 7/8 share the
    # spacing of the binade above them), spaced 1/8, 1/8, 1/4, 1/2:
    #   f = 0: 0 0.125 ... 0.875   f = 1: 1 1.125 ... 1.875   f = 2: 2 2.25 ... 3.75   f = 3: 4 4.5 ... 7.5
    # The tie between codes i and i + 1 goes to whichever of them is even: down when i is even, up when i is odd.
    # 31 ties, codes 0 .. 30 below them: 16 go down, 15 up. A binade ends on mantissa 111 (odd) and the next starts
    # on 000 (even), so every tie across a binade boundary (0.9375, 1.9375, 3.875) rounds up.
    values = [m / 8 for m in range(8)] + [2.0 ** (f - 1) * (1 + m / 8) for f in (1, 2, 3) for m in range(8)]
    ties = [(low + high) / 2 for low, high in zip(values, values[1:])]  # ties[i]: between codes i and i + 1
    return {"up": ties[1::2], "down": ties[0::2]}
    # Ties alternate within a binade in every format, so a block of real weights with many ties is not biased
    # up or down on average; an argmin over the values (round every tie down) is: it shrinks 15 of E2M3's 31 ties
    # by one step, always towards zero.


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


# ------------------------------------------------------------------ Exercise 6


def decode_q4_k_block(block: bytes) -> np.ndarray:
    """Exercise 6: A Q4_K super-block by hand"""
    b = np.frombuffer(block, dtype=np.uint8)
    d, dmin = b[0:4].view(np.float16).astype(np.float32)
    packed = b[4:16]
    scales = np.concatenate([packed[0:4] & 63, (packed[8:12] & 0x0F) | ((packed[0:4] >> 6) << 4)])
    mins = np.concatenate([packed[4:8] & 63, (packed[8:12] >> 4) | ((packed[4:8] >> 6) << 4)])
    chunks = b[16:144].reshape(4, 32)
    codes = np.stack([chunks & 0x0F, chunks >> 4], axis=1).reshape(8, 32)  # sub-blocks 2c, 2c + 1 from chunk c
    weights = (d * scales.astype(np.float32))[:, None] * codes - (dmin * mins.astype(np.float32))[:, None]
    return weights.reshape(256).astype(np.float32)
    # 144 bytes for 256 weights: 4.5 bits per weight. A float16 scale and min per 32-weight sub-block would cost
    # 1 bit per weight on their own; 6-bit scales and mins under one float16 step for the whole super-block cost
    # 12 bits per 32 weights (0.375 bits per weight) plus 32 bits per 256, and lose little: the sub-blocks of one
    # super-block have scales of the same size, so 64 levels of one step resolve them well.


# ------------------------------------------------------------------ Exercise 7


def smoothquant_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """Exercise 7: Move the outliers into the weights"""
    a, w = act_absmax.float(), weight.detach().float().abs().amax(0)
    live = (a > 0) & (w > 0)
    return torch.where(live, a.clamp(min=1e-12) ** alpha / w.clamp(min=1e-12) ** (1 - alpha), torch.ones_like(a))
    # With one channel 50 times the others, static int8's single activation step is set by that channel: the
    # others, 50 times smaller, use only about 2-3 of the 127 positive levels. Smoothing with alpha = 0.5 divides
    # the outlier channel by about √50 / (its weight range) and multiplies its weights by the same: the largest
    # activation falls by about 7 times (√50), so every other channel's step is about 7 times finer, while the
    # weights, quantized per output row, take the outlier's range on one column only. alpha trades the two:
    # toward 1 everything moves into the weights (whose per-row int8 then suffers), toward 0 nothing moves.
