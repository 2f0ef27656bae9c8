"""K-quant blocks decoded by hand: the Q4_K and Q6_K super-blocks of a Q4_K_M file, and the Q5_0 / Q5_1 blocks
llama.cpp falls back to (lesson 14).

A Q4_K_M file (what llama.cpp users download; Gemma 3 270M ships as one) stores most
matrices as Q4_K and some (the value and down projections, the head) as Q6_K, in
super-blocks of 256 weights. Where a row is not a multiple of 256 (the default model's
576), llama.cpp's quantizer falls back to the legacy 32-weight blocks Q5_0 / Q5_1 (or
Q8_0). Each layout, byte by byte, as llama.cpp's `dequantize_row_*` reads it:

    Q4_K (144 bytes / 256)  d, dmin: float16; 12 bytes of eight 6-bit scales and eight 6-bit
                            mins, packed; 128 bytes of 4-bit codes. Sub-block j of 32 weights:
                            w = (d·scale_j)·q − (dmin·min_j), q in 0..15
    Q6_K (210 bytes / 256)  128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen int8
                            scales, d: float16. Sub-block j of 16: w = d·scale_j·(q − 32), q in 0..63
    Q5_0 (22 bytes / 32)    d: float16; 32 high bits; 16 bytes of low nibbles. w = d·(q − 16)
    Q5_1 (24 bytes / 32)    d, m: float16; 32 high bits; 16 bytes of low nibbles. w = d·q + m

`decode_kquant` keeps the codes as codes, with one scale (and offset) per group, the form
a kernel multiplies; `dequantize_kquant` multiplies them out. Both are checked weight for
weight against the `gguf` package's own decoder (tests/test_14_quantization.py).
"""

from __future__ import annotations

import numpy as np

KQUANT_BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q5_0": (32, 22), "Q5_1": (32, 24)}  # weights, bytes


def float16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 (a little-endian float16 each) -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, 12] uint8 -> the eight 6-bit scales and eight 6-bit mins [N, 8] each (llama.cpp's `get_scale_min_k4`):
    sub-blocks 0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their
    low 4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7."""
    p = packed.astype(np.uint8)
    low_scales, low_mins = p[:, 0:4] & 63, p[:, 4:8] & 63
    high_scales = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    high_mins = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return np.concatenate([low_scales, high_scales], 1), np.concatenate([low_mins, high_mins], 1)


def decode_kquant(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows of `kind` blocks (uint8 [N, K / weights_per_block * bytes]) -> (codes [N, K], scale [N, groups], offset
    [N, groups] or None) with w = scale·code + offset in each group: Q4_K groups of 32 (codes 0..15), Q6_K groups of
    16 (codes −32..31), Q5_0 groups of 32 (codes −16..15, no offset), Q5_1 groups of 32 (codes 0..31)."""
    if kind not in KQUANT_BLOCK:
        raise ValueError(f"{kind} is not a K-quant or Q5 block: decode one of {', '.join(KQUANT_BLOCK)}")
    weights, size = KQUANT_BLOCK[kind]
    n = data.shape[0]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)  # every block of every row
    if kind == "Q4_K":
        d, dmin = float16(b[:, 0:2])[:, None], float16(b[:, 2:4])[:, None]
        scales, mins = q4_k_scales_and_mins(b[:, 4:16])
        qs = b[:, 16:144].reshape(-1, 4, 32)  # four chunks of 32 bytes: sub-blocks 2c (low nibbles), 2c + 1 (high)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, weights)
        scale, offset = d * scales.astype(np.float32), -(dmin * mins.astype(np.float32))
    elif kind == "Q6_K":
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)  # two halves of 128 weights
        d = float16(b[:, 208:210])[:, None]
        low = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
        high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], 2)  # [blocks, half, quarter, 32]
        codes = ((low | (high << 4)).astype(np.int16) - 32).reshape(-1, weights)
        scale, offset = d * b[:, 192:208].view(np.int8).astype(np.float32), None
    else:
        d = float16(b[:, 0:2])[:, None]
        at = 2 if kind == "Q5_0" else 4
        high_bits = b[:, at:at + 4].copy().view("<u4")  # [blocks, 1]: bit j is weight j's fifth bit
        qs = b[:, at + 4:at + 20]
        fifth = (high_bits >> np.arange(32, dtype=np.uint32)) & 1  # [blocks, 32]
        codes = np.concatenate([qs & 0x0F, qs >> 4], 1) | (fifth.astype(np.uint8) << 4)
        if kind == "Q5_0":
            codes, offset = codes.astype(np.int16) - 16, None
        else:
            offset = float16(b[:, 2:4])[:, None]
        scale = d
    offset = None if offset is None else np.broadcast_to(offset, scale.shape).reshape(n, -1)
    return codes.reshape(n, -1), scale.reshape(n, -1), offset


def dequantize_kquant(data: np.ndarray, kind: str) -> np.ndarray:
    """The weights the blocks stand for, float32 [N, K]: each group's scale times its codes, plus its offset."""
    codes, scale, offset = decode_kquant(data, kind)
    n, k = codes.shape
    grouped = codes.reshape(n, scale.shape[1], -1).astype(np.float32) * scale[..., None]
    if offset is not None:
        grouped = grouped + offset[..., None]
    return grouped.reshape(n, k)


__all__ = ["KQUANT_BLOCK", "decode_kquant", "dequantize_kquant", "q4_k_scales_and_mins"]
