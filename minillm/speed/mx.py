"""Microscaling (MX) formats as quantize-dequantize codecs for weights (lesson 14).

OCP Microscaling Formats (MX) v1.0: a block of k = 32 elements shares one scale X = 2^(e − 127)
stored as E8M0 (8 exponent bits, no sign, no mantissa; code 255 is NaN). Each element is
a narrow number P_i and stands for X·P_i:

    format      element     bits/elem  largest element  smallest subnormal  emax   bits/weight
    MXFP8       E4M3        8          448              2^-9                8      8.25
    MXFP6       E3M2        6          28               2^-4                4      6.25
    MXFP6       E2M3        6          7.5              2^-3                2      6.25
    MXFP4       E2M1        4          6                0.5                 2      4.25
    MXINT8      int8 ×2^-6  8          127/64           2^-6                0      8.25

Encoding a block (the spec's section 6.3): the shared exponent is floor(log2 max|x|) − emax
(emax: the element format's largest normal exponent), so the block's largest value lands in
the element format's top binade; each x / X is rounded to the nearest element (ties to even)
and clamped to ± the largest element (the top binade can hold up to 2^(emax+1), beyond the
largest element: those saturate). Choices the spec leaves open, made here: an all-zero block
gets e = 0; a block holding NaN or ±inf gets the NaN scale (255) and decodes to NaN; a zero
element is stored as +0; an exponent below −127 is clamped (the block underflows gracefully).

MX9 and MX6 (Rouhani et al. 2023, "Shared Microexponents: A Little Shifting Goes a Long Way";
the Cloud AI 100 recipe compiles to MX6) add a second level: a block of 16 shares an 8-bit
exponent E, each pair of elements shares a 1-bit microexponent β, and each element is a sign
and an m-bit integer magnitude with no implicit leading one:

    x ≈ sign · q · 2^(E − β − (m − 1)),  q in 0..2^m − 1,  E = floor(log2 max|block|),
    β = 1 when the pair's max |x| < 2^E (the pair takes one more bit of precision), else 0

    MX9: m = 7   per 16 elements: 8 (E) + 8 × 1 (β) + 16 × (1 + 7) = 144 bits = 9 bits/weight
    MX6: m = 4   per 16 elements: 8 (E) + 8 × 1 (β) + 16 × (1 + 4) =  96 bits = 6 bits/weight

Rounding there is to nearest, ties to even, clamped to 2^m − 1. These are codecs to measure
accuracy (`apply_mx_to_weights` replaces each weight by its decoded value): no kernel here
computes in them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .quant import QuantizationError
from .quantize_model import linears

SCALE_BIAS = 127
SCALE_NAN = 255


@dataclass(frozen=True)
class ElementFormat:
    """A narrow float: `exponent_bits`, `mantissa_bits`, `bias`; `max_value` its largest finite magnitude."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number: what the shared scale aligns the block's maximum to."""
        return int(torch.tensor(self.max_value).log2().floor())

    @property
    def min_normal_exponent(self) -> int:
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


E4M3 = ElementFormat("E4M3", 4, 3, 7, 448.0)  # exponent 15 with mantissa 111 is NaN: 1.75·2^8 is the top
E3M2 = ElementFormat("E3M2", 3, 2, 3, 28.0)
E2M3 = ElementFormat("E2M3", 2, 3, 1, 7.5)
E2M1 = ElementFormat("E2M1", 2, 1, 1, 6.0)

MX_FORMATS = {"mxfp8": E4M3, "mxfp6_e3m2": E3M2, "mxfp6_e2m3": E2M3, "mxfp4": E2M1, "mxint8": "int8"}
SHARED_MICROEXPONENT = {"mx9": 7, "mx6": 4}  # element magnitude bits m
BLOCK_SIZE = 32
MICRO_BLOCK, MICRO_PAIR = 16, 2


def bits_per_weight(fmt: str) -> float:
    if fmt in SHARED_MICROEXPONENT:
        return 1 + SHARED_MICROEXPONENT[fmt] + 1 / MICRO_PAIR + 8 / MICRO_BLOCK
    element = MX_FORMATS[check_format(fmt)]
    return (8 if element == "int8" else element.bits) + 8 / BLOCK_SIZE


def check_format(fmt: str) -> str:
    if fmt not in MX_FORMATS and fmt not in SHARED_MICROEXPONENT:
        names = ", ".join([*MX_FORMATS, *SHARED_MICROEXPONENT])
        raise QuantizationError(f"unknown MX format {fmt!r}: use one of {names}")
    return fmt


def round_to_element(v: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """Round each (already scaled) value to the nearest element of `element`, ties to even, saturating."""
    a = v.abs()
    exponent = torch.floor(torch.log2(a.clamp(min=2.0 ** element.min_normal_exponent)))  # subnormals share the lowest
    step = torch.exp2(exponent - element.mantissa_bits)
    q = (torch.round(a / step) * step).clamp(max=element.max_value)  # torch.round: half to even
    return torch.where(v < 0, -q, q)


def element_bits(value: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """Representable values -> their bit patterns (sign | exponent field | mantissa field), +0 for zero."""
    a = value.abs()
    normal = a >= 2.0 ** element.min_normal_exponent
    exponent = torch.floor(torch.log2(a.clamp(min=2.0 ** element.min_normal_exponent)))
    mantissa = torch.where(normal, (a / torch.exp2(exponent) - 1), a / 2.0 ** element.min_normal_exponent)
    field = torch.where(normal, exponent + element.bias, torch.zeros_like(exponent))
    code = field.long() << element.mantissa_bits | torch.round(mantissa * 2 ** element.mantissa_bits).long()
    sign = (value < 0).long() << (element.exponent_bits + element.mantissa_bits)
    return (code | sign).to(torch.uint8)


def element_value(code: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    code = code.long()
    sign = torch.where(code >> (element.exponent_bits + element.mantissa_bits) & 1 == 1, -1.0, 1.0)
    field = code >> element.mantissa_bits & ((1 << element.exponent_bits) - 1)
    mantissa = (code & ((1 << element.mantissa_bits) - 1)).float() / 2 ** element.mantissa_bits
    normal = torch.exp2(field.float() - element.bias) * (1 + mantissa)
    subnormal = 2.0 ** element.min_normal_exponent * mantissa
    return sign * torch.where(field > 0, normal, subnormal)


def shared_exponents(blocks: torch.Tensor, element) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 32] blocks -> (shared exponent floor(log2 max|x|) − emax, clamped to E8M0's range;
    whether the block is finite)."""
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0).amax(dim=-1)
    emax = 0 if element == "int8" else element.emax
    shared = torch.where(amax > 0, torch.floor(torch.log2(amax)) - emax, torch.full_like(amax, -SCALE_BIAS))
    return shared.clamp(-SCALE_BIAS, SCALE_BIAS), finite


def ocp_blocks(x: torch.Tensor, fmt: str):
    if check_format(fmt) in SHARED_MICROEXPONENT:
        raise QuantizationError(f"{fmt} has no OCP MX encoding: use shared_microexponent_quantize")
    element = MX_FORMATS[fmt]
    blocks = to_blocks(x.float(), BLOCK_SIZE)  # [..., K/32, 32]
    shared, finite = shared_exponents(blocks, element)
    scaled = torch.nan_to_num(blocks / torch.exp2(shared)[..., None], nan=0.0)
    return element, shared, finite, scaled


def mx_encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (element codes uint8 [..., K] (int8 for mxint8),
    E8M0 scales uint8 [..., K/32])."""
    element, shared, finite, scaled = ocp_blocks(x, fmt)
    scale_code = torch.where(finite, shared + SCALE_BIAS, torch.full_like(shared, SCALE_NAN)).to(torch.uint8)
    if element == "int8":
        codes = torch.round(scaled * 64).clamp(-127, 127).to(torch.int8)
    else:
        codes = element_bits(round_to_element(scaled, element), element)
    return codes.reshape(x.shape), scale_code


def mx_decode(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    element = MX_FORMATS[check_format(fmt)]
    values = codes.float() / 64 if element == "int8" else element_value(codes, element)
    blocks = to_blocks(values, BLOCK_SIZE)
    scale = torch.where(scales == SCALE_NAN, torch.nan, torch.exp2(scales.float() - SCALE_BIAS))
    return (blocks * scale[..., None]).reshape(codes.shape)


def shared_microexponent_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """MX9 / MX6 quantize-dequantize of x [..., K] (K a multiple of 16), per the module docstring's formula."""
    if check_format(fmt) not in SHARED_MICROEXPONENT:
        raise QuantizationError(f"{fmt} is an OCP MX format: use mx_encode / mx_decode")
    m = SHARED_MICROEXPONENT[fmt]
    blocks = to_blocks(x.float(), MICRO_BLOCK)  # [..., K/16, 16]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    shared = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.zeros_like(amax)).clamp(-SCALE_BIAS, SCALE_BIAS)
    pairs = blocks.reshape(*blocks.shape[:-1], MICRO_BLOCK // MICRO_PAIR, MICRO_PAIR)  # [..., K/16, 8, 2]
    beta = (pairs.abs().amax(dim=-1, keepdim=True) < torch.exp2(shared)[..., None]).float()
    step = torch.exp2(shared[..., None] - beta - (m - 1))
    q = (torch.round(pairs.abs() / step)).clamp(max=2 ** m - 1)
    return (torch.sign(pairs) * q * step).reshape(x.shape)


def quantize_dequantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x through `fmt` and back: what a weight stored in that format stands for.

    Equal to `mx_decode(*mx_encode(x, fmt), fmt)` (checked in the tests), without building
    the bit patterns: the rounded values times the scale.
    """
    if fmt in SHARED_MICROEXPONENT:
        return shared_microexponent_quantize(x, fmt)
    element, shared, finite, scaled = ocp_blocks(x, fmt)
    values = torch.round(scaled * 64).clamp(-127, 127) / 64 if element == "int8" else round_to_element(scaled, element)
    values = torch.where(finite[..., None], values * torch.exp2(shared)[..., None], torch.nan)
    return values.reshape(x.shape)


def to_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise QuantizationError(f"MX blocks of {size} do not divide the last dimension {x.shape[-1]}: "
                                f"pad it to a multiple of {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


@torch.no_grad()
def apply_mx_to_weights(model: nn.Module, fmt: str) -> nn.Module:
    """Replace every linear's weight by its `fmt` quantize-dequantize, in place (blocks along K); returns the model.

    The model still computes in its own dtype: this measures the format's accuracy, not its speed.
    A tied LM head changes the embedding with it, as storing the shared matrix in `fmt` would.
    """
    check_format(fmt)
    targets = linears(model)
    size = MICRO_BLOCK if fmt in SHARED_MICROEXPONENT else BLOCK_SIZE
    for name, linear in targets:
        if linear.in_features % size:
            raise QuantizationError(f"{name} has K={linear.in_features}, not a multiple of {fmt}'s block of {size}")
    for _, linear in targets:
        w = linear.weight
        for rows in torch.split(w, 4096):  # a chunk at a time: the intermediates are several times the weight
            rows.copy_(quantize_dequantize(rows.float(), fmt).to(w.dtype))
    return model


__all__ = ["ElementFormat", "E4M3", "E3M2", "E2M3", "E2M1", "MX_FORMATS", "SHARED_MICROEXPONENT", "BLOCK_SIZE",
           "bits_per_weight", "round_to_element", "element_bits", "element_value", "mx_encode", "mx_decode",
           "shared_microexponent_quantize", "shared_exponents", "quantize_dequantize", "apply_mx_to_weights"]
