"""Microscaling blocks as codecs: OCP MX v1.0, and the shared-microexponent MX9/MX6/MX4 before it (lesson 14).

**OCP Microscaling Formats (MX) v1.0.** A block of k = 32 elements P_i shares one scale X = 2^e,
stored as E8M0: 8 exponent bits, bias 127, no sign, no mantissa (e in −127..127; code 255 is
NaN). Element i stands for X · P_i. Encoding a block V (the spec's section 6.3):

    e   = floor(log2 max_i |V_i|) − emax        emax: the element format's largest normal exponent
    P_i = V_i / 2^e converted to the element format: nearest, ties to even, clamped at ± its largest

so the block's largest value lands in the element format's top binade, [2^emax, 2^(emax+1)).
That binade reaches past the largest element (E2M1's top binade is [4, 8), its largest 6), so
the largest values of a block can saturate. The element formats (FP8 E4M3 / E5M2, FP6 E3M2 /
E2M3, FP4 E2M1, INT8) are in `minillm.speed.mx_elements`:

    format        element  bits/weight        format        element  bits/weight
    mxfp8         E4M3     8.25               mxfp6_e2m3    E2M3     6.25
    mxfp8_e5m2    E5M2     8.25               mxfp4         E2M1     4.25
    mxfp6_e3m2    E3M2     6.25               mxint8        INT8     8.25

What the spec leaves to the implementation, chosen here: an all-zero block gets the smallest
scale (e = −127, code 0), as Microsoft's reference library does; a block holding NaN or ±inf
gets the NaN scale and decodes to NaN (the spec's rule); e below −127 is clamped, so a block of
tiny values underflows towards zero rather than failing. FP4 codes pack two per byte in
`pack_fp4`; the spec fixes no storage layout (gguf's MXFP4 pairs element i with i + 16).

**MX9, MX6, MX4** (Rouhani et al., "With Shared Microexponents, A Little Shifting Goes a Long Way",
ISCA 2023): Microsoft's earlier block formats, with two levels of power-of-two scale. A block of
k1 = 16 shares an 8-bit exponent E; each sub-block of k2 = 2 shares a 1-bit microexponent β;
each element is a sign and an m-bit magnitude q with no implicit leading one:

    x ≈ (−1)^s · q · 2^(E − β − (m − 1)),   q in 0..2^m − 1,   E = floor(log2 max|block|)
    β = 1 when both values of the pair are below 2^E (the pair gets one more bit), else 0
    bits per element: (1 + m) + 8/16 + 1/2 = m + 2:   MX9 m = 7,  MX6 m = 4,  MX4 m = 2

Magnitudes round to nearest, ties to even, clamped at 2^m − 1. These formats are not the OCP
ones: "MX6" is not MXFP6 (see the lesson's README for what Qualcomm's Cloud AI 100 uses).
What this definition rests on: the block sizes, bit widths and β rule as AMD Quark's
documentation of MX4/MX6/MX9 gives them from the paper; the paper's own rounding rule and any
official implementation were not checked. Microsoft's `microxcaling` emulator (read, not
installed) covers the OCP formats only, with no β level, and rounds half away from zero by
default (`round="nearest"`), so its "MXFP4" can differ from this one on ties.

**Qualcomm's Cloud AI 100** compiles with `-mxfp6-matmul` (QEfficient's `mxfp6_matmul=True`:
MXFP6 weight compression for MatMul nodes) and `-mxint8-kv-cache`. The public code does not say
which FP6 element, block size or scale rounding it uses, nor whether the matmul computes on
MXFP6 or decompresses first (those models compile with `-convert-to-fp16`); nothing ties it to
the paper's two-level MX6, so lesson 14 measures both MXFP6 elements and MX6.

No kernel here computes in any of them: `apply_mx_to_weights` replaces each weight by the
value its code stands for, to measure what a format costs in accuracy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .mx_elements import E2M1, E2M3, E3M2, E4M3, E5M2, INT8, binade, power_of_two
from .quant import QuantizationError
from .quantize_model import linears

SCALE_BIAS = 127
SCALE_NAN = 255
BLOCK_SIZE = 32  # OCP MX: elements per E8M0 scale
MX_FORMATS = {"mxfp8": E4M3, "mxfp8_e5m2": E5M2, "mxfp6_e3m2": E3M2, "mxfp6_e2m3": E2M3, "mxfp4": E2M1,
              "mxint8": INT8}
SHARED_MICROEXPONENT = {"mx9": 7, "mx6": 4, "mx4": 2}  # magnitude bits m of each element
MICRO_BLOCK, MICRO_PAIR = 16, 2  # elements per shared 8-bit exponent (k1), per 1-bit microexponent (k2)


def check_format(fmt: str) -> str:
    """`fmt` itself when it names a format here; otherwise one line listing the names that do."""
    if fmt not in MX_FORMATS and fmt not in SHARED_MICROEXPONENT:
        names = ", ".join([*MX_FORMATS, *SHARED_MICROEXPONENT])
        raise QuantizationError(f"unknown MX format {fmt!r}: use one of {names}")
    return fmt


def block_size(fmt: str) -> int:
    """Elements per top-level block: what the last dimension must be a multiple of."""
    return MICRO_BLOCK if check_format(fmt) in SHARED_MICROEXPONENT else BLOCK_SIZE


def bits_per_weight(fmt: str) -> float:
    """What one weight costs in storage: its element's bits plus its share of the block's scale bits."""
    if check_format(fmt) in SHARED_MICROEXPONENT:
        return 1 + SHARED_MICROEXPONENT[fmt] + 1 / MICRO_PAIR + 8 / MICRO_BLOCK
    return MX_FORMATS[fmt].bits + 8 / BLOCK_SIZE


def to_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[..., K] -> [..., K / size, size]."""
    if x.shape[-1] % size:
        raise QuantizationError(f"MX blocks of {size} do not divide the last dimension {x.shape[-1]}: "
                                f"pad it to a multiple of {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def block_exponents(blocks: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., size] blocks -> (floor(log2 max|block|) − offset in −127..127, int32 [...]; whether the block is finite).

    An all-zero block gets −127 (the clamp: `binade` reads zero as −127); a non-finite block's exponent is unused.
    """
    amax = blocks.abs().amax(dim=-1)  # NaN or inf when the block holds one
    finite = torch.isfinite(amax)
    exponent = binade(torch.where(finite, amax, 0)) - offset
    return exponent.clamp(-SCALE_BIAS, SCALE_BIAS), finite


def finite_only(values: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """`values` with the non-finite blocks' entries zeroed (their scale is NaN: what they held no longer matters)."""
    return values if finite.all() else torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


def exponent_codes(exponent: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Exponents -> E8M0 bytes (biased by 127), 255 (NaN) for a non-finite block."""
    return torch.where(finite, exponent + SCALE_BIAS, SCALE_NAN).to(torch.uint8)


def scale_values(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> the scales they stand for, 2^(code − 127) as float32 (exact, 2^-127 included); NaN for 255."""
    codes = codes.int()
    return torch.where(codes == SCALE_NAN, torch.nan, power_of_two(codes - SCALE_BIAS))


# ------------------------------------------------------------------ OCP MX


def ocp_element(fmt: str):
    """The element format of an OCP MX format; a shared-microexponent name is refused (its blocks differ)."""
    if check_format(fmt) in SHARED_MICROEXPONENT:
        raise QuantizationError(f"{fmt} is a shared-microexponent format: use microexponent_encode / _decode")
    return MX_FORMATS[fmt]


def scaled_blocks(x: torch.Tensor, element) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x / X as blocks [..., K/32, 32] (non-finite values as 0), e int32 [..., K/32], finite)."""
    blocks = to_blocks(x.float(), BLOCK_SIZE)
    exponent, finite = block_exponents(blocks, element.emax)
    scaled = blocks / power_of_two(exponent)[..., None]
    return finite_only(scaled, finite), exponent, finite


def mx_encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (element codes uint8 [..., K], E8M0 scales uint8 [..., K/32]).

    An element code is its bit pattern in the low bits of the byte (sign first): E2M1's 4, FP6's 6,
    MXINT8's two's-complement byte.
    """
    element = ocp_element(fmt)
    scaled, exponent, finite = scaled_blocks(x, element)
    codes = element.encode(element.round(scaled))
    return codes.reshape(x.shape), exponent_codes(exponent, finite)


def mx_decode(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """(element codes [..., K], E8M0 scales [..., K/32]) -> float32 values [..., K]: X · P_i."""
    values = to_blocks(ocp_element(fmt).decode(codes), BLOCK_SIZE)
    return (values * scale_values(scales)[..., None]).reshape(codes.shape)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., K] -> [..., K/2] bytes: element 2i in the low nibble, 2i + 1 in the high one."""
    return codes[..., 0::2] | codes[..., 1::2] << 4


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> E2M1 codes uint8 [..., K]: `pack_fp4` undone."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ------------------------------------------------------------------ MX9 / MX6 / MX4: shared microexponents


class MicroexponentBlocks(NamedTuple):
    """A tensor [..., K] in MX9/MX6/MX4 blocks of 16, before its codes are packed into bytes."""

    pairs: torch.Tensor  # the values, [..., K/16, 8, 2]
    shared: torch.Tensor  # E = floor(log2 max|block|), int32 [..., K/16]
    beta: torch.Tensor  # the microexponents, bool [..., K/16, 8]
    q: torch.Tensor  # the magnitudes, 0..2^m − 1, [..., K/16, 8, 2]
    step: torch.Tensor  # what one unit of q stands for, 2^(E − β − (m − 1)), [..., K/16, 8, 1]
    finite: torch.Tensor  # bool [..., K/16]


def microexponent_blocks(x: torch.Tensor, fmt: str) -> MicroexponentBlocks:
    """x [..., K] (K a multiple of 16) encoded in `fmt`: the shared exponents, microexponents and magnitudes."""
    if check_format(fmt) not in SHARED_MICROEXPONENT:
        raise QuantizationError(f"{fmt} is an OCP MX format: use mx_encode / mx_decode")
    m = SHARED_MICROEXPONENT[fmt]
    blocks = to_blocks(x.float(), MICRO_BLOCK)
    shared, finite = block_exponents(blocks, 0)
    pairs = blocks.reshape(*blocks.shape[:-1], MICRO_BLOCK // MICRO_PAIR, MICRO_PAIR)
    magnitudes = finite_only(pairs.abs(), finite)
    block_step = power_of_two(shared - (m - 1))[..., None]  # [..., K/16, 1]: the step of a pair with β = 0
    beta = torch.maximum(magnitudes[..., 0], magnitudes[..., 1]) < block_step * 2 ** (m - 1)  # both below 2^E
    step = torch.where(beta, block_step / 2, block_step)[..., None]  # β = 1 shifts once more: half the step
    q = torch.round(magnitudes / step).clamp(max=2 ** m - 1)  # half to even
    return MicroexponentBlocks(pairs, shared, beta, q, step, finite)


def microexponent_encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 16) -> (codes uint8 [..., K]: sign << m | q; microexponents β uint8
    [..., K/2]; shared exponents uint8 [..., K/16]: E + 127, 255 for a non-finite block)."""
    b = microexponent_blocks(x, fmt)
    codes = (torch.signbit(b.pairs).int() << SHARED_MICROEXPONENT[fmt] | b.q.int()).to(torch.uint8)
    return codes.reshape(x.shape), b.beta.to(torch.uint8).flatten(-2), exponent_codes(b.shared, b.finite)


def microexponent_decode(codes: torch.Tensor, micro: torch.Tensor, shared: torch.Tensor, fmt: str) -> torch.Tensor:
    """(codes [..., K], β [..., K/2], shared exponents [..., K/16]) -> float32 values [..., K]."""
    m = SHARED_MICROEXPONENT[check_format(fmt)]
    pairs = to_blocks(to_blocks(codes.int(), MICRO_BLOCK), MICRO_PAIR)  # [..., K/16, 8, 2]
    beta = to_blocks(micro, MICRO_BLOCK // MICRO_PAIR) == 1  # [..., K/16, 8]
    block_step = scale_values(shared)[..., None] * 2.0 ** -(m - 1)  # 2^(E − (m − 1)): exact, a power of two
    step = torch.where(beta, block_step / 2, block_step)[..., None]  # [..., K/16, 8, 1]
    magnitude = (pairs & (2 ** m - 1)).float() * step
    return torch.where(pairs >> m & 1 == 1, -magnitude, magnitude).reshape(codes.shape)


# ------------------------------------------------------------------ any format, on tensors and on a model


def quantize_dequantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x through `fmt` and back: what a value stored in that format stands for.

    Equal to decoding `fmt`'s encoding (checked in the tests) without building the codes: the
    rounded values times their scale, NaN for a non-finite block.
    """
    if check_format(fmt) in SHARED_MICROEXPONENT:
        b = microexponent_blocks(x, fmt)
        values, finite = torch.copysign(b.q * b.step, b.pairs).flatten(-2), b.finite  # [..., K/16, 16]
    else:
        element = MX_FORMATS[fmt]
        scaled, exponent, finite = scaled_blocks(x, element)
        values = element.round(scaled) * power_of_two(exponent)[..., None]
    if not finite.all():
        values = torch.where(finite[..., None], values, torch.nan)
    return values.reshape(x.shape)


@torch.no_grad()
def apply_mx_to_weights(model: nn.Module, fmt: str) -> nn.Module:
    """Replace every linear's weight by its `fmt` quantize-dequantize, in place (blocks along K); returns the model.

    The model still computes in its own dtype: this measures the format's accuracy, not its speed.
    A tied LM head changes the embedding with it, as storing the shared matrix in `fmt` would.
    """
    size = block_size(fmt)
    targets = linears(model)
    for name, linear in targets:
        if linear.in_features % size:
            raise QuantizationError(f"{name} has K={linear.in_features}, not a multiple of {fmt}'s block of {size}")
    for _, linear in targets:
        w = linear.weight
        for rows in torch.split(w, 1024):  # a chunk at a time: its intermediates, several times it, stay in cache
            rows.copy_(quantize_dequantize(rows.float(), fmt).to(w.dtype))
    return model


__all__ = ["MX_FORMATS", "SHARED_MICROEXPONENT", "BLOCK_SIZE", "MICRO_BLOCK", "MICRO_PAIR", "SCALE_BIAS", "SCALE_NAN",
           "check_format", "block_size", "bits_per_weight", "scale_values", "mx_encode", "mx_decode", "pack_fp4",
           "unpack_fp4", "MicroexponentBlocks", "microexponent_blocks", "microexponent_encode", "microexponent_decode",
           "quantize_dequantize", "apply_mx_to_weights"]
