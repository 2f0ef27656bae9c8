"""The narrow numbers MX blocks are made of: the OCP MX element formats, their values, their bits (lesson 14).

An MX block stores each of its elements in a few bits: a tiny float (sign, `exponent_bits`
with a `bias`, `mantissa_bits`) or, for MXINT8, an 8-bit integer. OCP Microscaling Formats
v1.0 defines them (section 5.3):

    element  bits  bias  emax  largest  smallest subnormal  special codes          MX format
    E5M2     8     15    15    57344    2^-16               inf and NaN (IEEE)     MXFP8 (E5M2)
    E4M3     8     7     8     448      2^-9                S.1111.111 is NaN      MXFP8 (E4M3)
    E3M2     6     3     4     28       2^-4                none                   MXFP6 (E3M2)
    E2M3     6     1     2     7.5      2^-3                none                   MXFP6 (E2M3)
    E2M1     4     1     2     6        0.5                 none                   MXFP4
    INT8     8     -     0     127/64   2^-6                none                   MXINT8

A float element with biased exponent field f > 0 is normal, (−1)^s · 2^(f − bias) · 1.m; with
f = 0 it is subnormal, (−1)^s · 2^(1 − bias) · 0.m. emax, the exponent of the largest normal
number, is what the block's shared scale lines the block's largest value up with. E2M1 has
only eight magnitudes, 0, 0.5, 1, 1.5, 2, 3, 4, 6: that is all of MXFP4's grid. INT8 is two's
complement with an implicit scale 2^-6 (value = int8 / 64); −128 is a valid bit pattern, but
conversions here, like Microsoft's reference library, stop at ±127 so the grid is symmetric.

`round` is the spec's conversion of a (scaled) value: to the nearest element, ties to the one
with an even code (last mantissa bit 0), and values past the largest element clamp to it
(saturation, which the MX conversion applies to every element format, E5M2 included). A
negative value that rounds to zero keeps its sign (−0), as IEEE rounding and `ml_dtypes` do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXPONENT_FIELD = 0x7F800000  # float32's 8 exponent bits: a float with only these kept is 2^floor(log2 a)


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent (float32) for integer exponents, exactly, down to float32's subnormals (a scale can be 2^-127)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def binade(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) of float32 a ≥ 0 (int32), read off its exponent field: exact for a ≥ 2^-126, unlike a float
    log2, which can round up just below a power of two; −127 for zero and float32's subnormals, below every format."""
    return (a.view(torch.int32) >> 23) - 127


@dataclass(frozen=True)
class FloatElement:
    """A tiny float: `exponent_bits` with `bias`, `mantissa_bits`; `specials` says which codes are not numbers:
    "none" (every code is finite), "fn" (only S.1…1.1…1 is NaN, E4M3's choice), "ieee" (exponent all ones)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str = "none"

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_normal_exponent(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        top_field = 2 ** self.exponent_bits - 1 - (self.specials == "ieee")
        return top_field - self.bias

    @property
    def max_value(self) -> float:
        top_mantissa = 2 ** self.mantissa_bits - 1 - (self.specials == "fn")  # E4M3: 1.111 at the top is NaN
        return 2.0 ** self.emax * (1 + top_mantissa / 2 ** self.mantissa_bits)

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """Each (already scaled, finite) value -> the nearest element, ties to even, clamped at ± max_value."""
        # 2^floor(log2 |v|) is v with its sign and mantissa bits cleared; in that binade the elements are
        # 2^(floor(log2 |v|) − m) apart, and the subnormals share the lowest normal binade's spacing
        binade_start = (v.view(torch.int32) & EXPONENT_FIELD).view(torch.float32)
        lowest_step = 2.0 ** (self.min_normal_exponent - self.mantissa_bits)
        step = (binade_start * 2.0 ** -self.mantissa_bits).clamp(min=lowest_step)
        return (torch.round(v / step) * step).clamp(-self.max_value, self.max_value)  # half to even; −0 stays −0

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Element values (the output of `round`) -> their codes uint8: sign | exponent field | mantissa field."""
        a = values.abs()
        normal = a >= 2.0 ** self.min_normal_exponent
        exponent = binade(a).clamp(min=self.min_normal_exponent)
        field = torch.where(normal, exponent + self.bias, 0)
        mantissa = torch.round((a / power_of_two(exponent) - normal.float()) * 2 ** self.mantissa_bits).int()
        sign = torch.signbit(values).int() << (self.bits - 1)
        return (sign | field << self.mantissa_bits | mantissa).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (any integer tensor) -> float32 values; the format's special codes -> inf or NaN."""
        codes = codes.int()
        field = codes >> self.mantissa_bits & (2 ** self.exponent_bits - 1)
        mantissa = (codes & (2 ** self.mantissa_bits - 1)).float() / 2 ** self.mantissa_bits
        magnitude = torch.where(field > 0, power_of_two(field - self.bias) * (1 + mantissa),
                                2.0 ** self.min_normal_exponent * mantissa)
        if self.specials == "ieee":
            top = field == 2 ** self.exponent_bits - 1
            magnitude = torch.where(top, torch.where(mantissa == 0, torch.inf, torch.nan), magnitude)
        elif self.specials == "fn":
            magnitude = torch.where(magnitude > self.max_value, torch.nan, magnitude)
        return torch.where(codes >> (self.bits - 1) & 1 == 1, -magnitude, magnitude)


@dataclass(frozen=True)
class IntElement:
    """MXINT8's element: a two's-complement integer standing for int / 2^fraction_bits."""

    name: str = "INT8"
    bits: int = 8
    fraction_bits: int = 6
    emax: int = 0  # the largest magnitude, 127/64, is below 2: the block max lines up with 2^0

    @property
    def max_value(self) -> float:
        """127/64: the largest magnitude conversions write (−128/64 exists but is left unused)."""
        return (2 ** (self.bits - 1) - 1) / 2 ** self.fraction_bits

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """Each (already scaled) value -> the nearest multiple of 2^-fraction_bits, ties to even, within ±127/64."""
        steps = 2 ** self.fraction_bits
        return torch.round(v * steps).clamp(-self.max_value * steps, self.max_value * steps) / steps

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Values (the output of `round`) -> their two's-complement bytes, as uint8."""
        return torch.round(values * 2 ** self.fraction_bits).to(torch.int8).view(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Bytes -> float32 values; −128 (a pattern conversions never write) reads as −2."""
        return codes.to(torch.uint8).view(torch.int8).float() / 2 ** self.fraction_bits


E5M2 = FloatElement("E5M2", 5, 2, 15, specials="ieee")
E4M3 = FloatElement("E4M3", 4, 3, 7, specials="fn")
E3M2 = FloatElement("E3M2", 3, 2, 3)
E2M3 = FloatElement("E2M3", 2, 3, 1)
E2M1 = FloatElement("E2M1", 2, 1, 1)
INT8 = IntElement()


def finite_grid(element) -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-negative finite value of `element`, ascending, and its code: (values float32, codes uint8)."""
    codes = torch.arange(2 ** (element.bits - 1), dtype=torch.uint8)
    values = element.decode(codes)
    finite = torch.isfinite(values)
    return values[finite], codes[finite]


__all__ = ["FloatElement", "IntElement", "E5M2", "E4M3", "E3M2", "E2M3", "E2M1", "INT8", "finite_grid",
           "power_of_two", "binade"]
