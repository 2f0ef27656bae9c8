"""Quantized linears: int8 and int4 weight codes, the kernels' limits, and the modules that run them (lesson 14).

At batch 1 a decode step reads every weight once and does two flops per weight: it is
bound by the bytes it reads. Storing weights in 8 or 4 bits instead of 32 reads 4-8x fewer
bytes per token. Each module here stands in for one `nn.Linear` (`from_linear` quantizes
it) and gives back the float32 weight it stands for (`dequantized_weight`): the reference
it is checked against. `minillm.speed.quantize_model` swaps them into a whole model.

    weight-only int8   w ≈ q·s, q int8, one scale per output channel (symmetric)
    weight-only int4   w ≈ (q − 8)·s + z, q in 0..15, a scale and a zero per group of
                       32-256 weights along K (asymmetric): PyTorch's packed CPU kernel's form
    dynamic int8       the weight as above, and each activation row quantized at run time
                       (its own scale); an int8 × int8 → int32 matmul, then both scales
    static int8        the same, with one activation scale per linear fixed in advance
                       from sample text (calibration): no per-step max, but outliers clip

Weight-only kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`) are
fast only with bfloat16 activations: with float32 ones they take a slow reference path.
So a weight-only linear computes in `compute_dtype` (bfloat16 by default) whatever the
model's dtype, and returns the model's dtype. Pass `compute_dtype=torch.float32` to check
the kernels exactly. The kernels' limits are refused with one line each (`check_int4_shape`,
`check_int8_shape`): int4 groups of 32/64/128/256 dividing K, N a multiple of 16; bfloat16
int8 needs K a multiple of 16 (otherwise it returns garbage).

On a GPU the same modules run other kernels, chosen by where their codes lie when they are
made (quantize after the model is on its device): int4 on the tinygemm kernel
(`aten._weight_int4pack_mm`, bfloat16 activations, its own tile layout from
`_convert_weight_to_int4pack`, the same (q − 8)·s + z); int8 as the dequantization and a
matmul written out (`int8_dequantizing_matmul`), which Inductor fuses into one kernel that
reads the int8 codes once a batch-1 step is compiled (gpt-fast's recipe; ATen's CUDA int8
kernel, in the pytorch source read for this, gives each output one thread that walks its row
alone, so neighbouring threads read addresses a row apart). Dynamic and static int8 stay
on the CPU: `torch._int_mm` on a GPU needs more than 16 rows, and a decode step has one.

The kernels stream the codes once per activation row: right for decoding, slow for a
prefill chunk of hundreds of rows. From `widen_rows` rows on, an eager bfloat16 call
widens the codes to a dense matrix (bfloat16 where the CPU multiplies it in hardware,
float32 elsewhere) and runs one matmul instead; dynamic int8 on a CPU without int8 dot
products computes its exact integer product through float32 (`minillm.speed.quant_widen`,
with the measurements behind the thresholds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quant_widen import (int4_block, int4_widened_matmul, int8_product, int8_product_here, int8_widened_matmul,
                          widen_from_rows, widens)

INT4_GROUP_SIZES = (32, 64, 128, 256)


class QuantizationError(ValueError):
    """A quantization the kernels cannot run, or a bad setting: the message names the value and the fix."""


# ------------------------------------------------------------------ formats: quantize and dequantize


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]) with weight ≈ q · scale[:, None].

    Symmetric: the largest |w| of each row maps to 127 (−128 stays unused, so the grid is
    symmetric around zero). An all-zero row gets scale 1 rather than a division by zero.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q uint8 [N, K] in 0..15, scale, zero float32 [N, K / group_size]).

    Asymmetric per group: the group's minimum maps to q = 0 and its maximum to 15, so
    w ≈ q·s + min. Written in the kernel's form w ≈ (q − 8)·s + z, the zero is z = min + 8·s.
    """
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise QuantizationError(f"int4 group size {group_size} does not fit K={k}: use one of "
                                f"{', '.join(str(g) for g in INT4_GROUP_SIZES)} that divides K")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, q = 0
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, low + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q − 8)·scale + zero, each group of K sharing its scale and zero: the kernel's formula, in float32."""
    n, k = q.shape
    groups = scale.shape[1]
    w = (q.float().reshape(n, groups, k // groups) - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.reshape(n, k)


# ------------------------------------------------------------------ what the kernels accept


def check_int4_shape(n: int, k: int, group_size: int, name: str = "weight") -> None:
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        fits = [g for g in INT4_GROUP_SIZES if k % g == 0]
        raise QuantizationError(f"int4 group size {group_size} does not fit {name} (K={k}): use "
                                f"{' or '.join(map(str, fits)) if fits else 'int8 (no int4 group size divides K)'}")
    if n % 16:
        raise QuantizationError(f"int4 needs output features N a multiple of 16; {name} has N={n}: use int8 for it")


def check_int8_shape(k: int, compute_dtype: torch.dtype, name: str = "weight") -> None:
    if compute_dtype != torch.float32 and k % 16:
        raise QuantizationError(f"int8 with {compute_dtype} activations needs K a multiple of 16 (the kernel returns "
                                f"garbage otherwise); {name} has K={k}: use compute_dtype=torch.float32")


GPU_METHODS = ("int8", "int4")  # the weight-only forms with GPU kernels here (and the GGUF's blocks, on them)


def check_device(module: nn.Module, name: str, method: str) -> None:
    device = next(module.parameters()).device
    if device.type == "cuda" and method not in GPU_METHODS:
        raise QuantizationError(f"{name} is on {device}: {method} multiplies int8 activations with torch._int_mm, "
                                f"which on a GPU needs more than 16 rows; use int8 or int4 weights there")
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"{name} is on {device}: the quantized kernels run on a CPU or a CUDA GPU")


def check_int4_dtype(device: torch.device, compute_dtype: torch.dtype) -> None:
    if device.type == "cuda" and compute_dtype != torch.bfloat16:
        raise QuantizationError(f"int4 on a GPU computes in bfloat16 (the tinygemm kernel's activations), not "
                                f"{compute_dtype}: use compute_dtype=torch.bfloat16")


def int8_dequantizing_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] @ (q [N, K] · scale [N])ᵀ as the widening and a matmul, in x's dtype: a GPU's int8 path.

    Eagerly this widens the whole weight at every call; in a compiled batch-1 step Inductor turns
    the matrix-vector product into a reduction (`minillm.speed.inductor`: "generated" on a GPU)
    and fuses the widening into it, so the step reads one byte per weight.
    """
    return F.linear(x, q.to(x.dtype)) * scale


def int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 -> uint8 [N, K / 2], code 2j in the high nibble and 2j + 1 in the low one: the form
    the GPU kernel's packing (`_convert_weight_to_int4pack`) reads."""
    q = q.to(torch.uint8)
    return (q[:, ::2] << 4 | q[:, 1::2]).contiguous()


def inner_k_tiles(k: int) -> int:
    """How many 16-wide K tiles the GPU int4 layout puts side by side: the most of 8, 4 or 2 that K fills (every
    group size here makes K a multiple of 32, so 2 always fits)."""
    return next(tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0)


# ------------------------------------------------------------------ the quantized linears


class QuantizedLinear(nn.Module):
    """What every quantized linear shares: the input width, an optional bias, and a flatten/unflatten."""

    widen_kind: str | None = None  # "int8" / "int4": the codes an eager bfloat16 call widens over many rows

    @property
    def widen_rows(self) -> int:
        """Rows from which a bfloat16 call widens the codes on this CPU (quant_widen: from there widening wins)."""
        return widen_from_rows(self.widen_kind)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).to(x.dtype)  # [rows, N]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this linear stands for: what `dequantize_model` puts back."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of weight data (codes, scales, zeros) a forward reads."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightLinear(QuantizedLinear):
    """Weight-only int8 (per output channel), on `aten._weight_int8pack_mm`; widened over many rows."""

    widen_kind = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias=None, compute_dtype=torch.bfloat16):
        super().__init__(q.shape[1], q.shape[0], bias)
        check_int8_shape(q.shape[1], compute_dtype)
        self.compute_dtype = compute_dtype
        self.register_buffer("weight_int8", q.contiguous())  # [N, K]
        self.register_buffer("scale", scale.to(compute_dtype))  # [N]

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype=torch.bfloat16) -> "Int8WeightLinear":
        return cls(*quantize_int8_per_channel(linear.weight), linear.bias, compute_dtype)

    def matmul(self, x):
        x = x.to(self.compute_dtype)
        if self.weight_int8.is_cuda:
            return int8_dequantizing_matmul(x, self.weight_int8, self.scale)
        if widens(x, self.compute_dtype, self.widen_kind):
            return int8_widened_matmul(x, self.weight_int8, self.scale)
        return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scale)

    def dequantized_weight(self):
        return dequantize_int8(self.weight_int8, self.scale)


class Int4WeightLinear(QuantizedLinear):
    """Weight-only int4 (groupwise, asymmetric), on `aten._weight_int4pack_mm_for_cpu` (a GPU: `_weight_int4pack_mm`).

    The kernel reads q packed two to a byte in its own layout (`_convert_weight_to_int4pack_for_cpu`;
    on a GPU tiles of `inner_k_tiles`, `_convert_weight_to_int4pack`), made on the device q lies
    on, and scale and zero interleaved as [K / group_size, N, 2]. Widened over many rows, where
    this CPU's packed layout is one `quant_widen` reads (N a multiple of its block).
    """

    widen_kind = "int4"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias=None,
                 compute_dtype=torch.bfloat16):
        n, k = q.shape
        super().__init__(k, n, bias)
        self.group_size = k // scale.shape[1]
        check_int4_shape(n, k, self.group_size)
        check_int4_dtype(q.device, compute_dtype)
        self.compute_dtype = compute_dtype
        packed = (torch.ops.aten._convert_weight_to_int4pack(int4_pairs(q), inner_k_tiles(k)) if q.is_cuda
                  else torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        self.register_buffer("weight_int4", packed)
        scale_and_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # [K / group_size, N, 2]
        self.register_buffer("scale_and_zero", scale_and_zero.to(compute_dtype).contiguous())

    def _apply(self, fn, recurse=True):
        """Moving the module keeps its packed codes' layout, which is the device's own: refused across devices."""
        before = self.weight_int4.device.type
        moved = super()._apply(fn, recurse)
        if self.weight_int4.device.type != before:
            raise QuantizationError(f"int4 codes packed for the {before} cannot run on {self.weight_int4.device}: "
                                    f"move the model first, then quantize it")
        return moved

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, compute_dtype=torch.bfloat16) -> "Int4WeightLinear":
        check_int4_shape(linear.out_features, linear.in_features, group_size)
        return cls(*quantize_int4_groupwise(linear.weight, group_size), linear.bias, compute_dtype)

    def matmul(self, x):
        x = x.to(self.compute_dtype)
        if self.weight_int4.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.weight_int4, self.group_size, self.scale_and_zero)
        # `widens` first: it says no while a graph is traced, and `int4_block`'s probe (a data-dependent
        # comparison) must not be traced into one; export fails on it if no eager call has cached it.
        if widens(x, self.compute_dtype, self.widen_kind):
            block = int4_block()
            if block and self.out_features % block == 0:
                return int4_widened_matmul(x, self.weight_int4, self.scale_and_zero, self.out_features,
                                           self.group_size)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_int4, self.group_size, self.scale_and_zero)

    def dequantized_weight(self):
        """Read back through the kernel itself: x = I gives wᵀ exactly (one product per output, in float32; on a
        GPU the bfloat16 weight the kernel multiplies, its only precision)."""
        if self.weight_int4.is_cuda:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight_int4.device)
            return self.matmul(eye).float().t().contiguous()
        eye = torch.eye(self.in_features)
        sz = self.scale_and_zero.float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, self.group_size, sz).t().contiguous()

    def extra_repr(self):
        return super().extra_repr() + f", group_size={self.group_size}"


def quantize_rows_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8)


class DynamicInt8Linear(QuantizedLinear):
    """int8 weights (per channel) × int8 activations (per row, scaled at run time) → int32, on `torch._int_mm`.

    y = (q_x · q_wᵀ) · s_x · s_w: the integer product is exact, so the only errors are the
    two roundings. Each row's scale is its own max |x| / 127, computed every step. On a CPU
    without int8 dot products, several rows take `int8_product`: the same integers through
    float32, many times faster there.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias=None):
        super().__init__(q.shape[1], q.shape[0], bias)
        self.register_buffer("weight_int8", q.contiguous())  # [N, K]; the kernel reads its transpose
        self.register_buffer("scale", scale.float())  # [N]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DynamicInt8Linear":
        return cls(*quantize_int8_per_channel(linear.weight), linear.bias)

    def input_scale(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(dim=1, keepdim=True) / 127  # [rows, 1]
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def matmul(self, x):
        x = x.float()
        x_scale = self.input_scale(x)
        x_codes = quantize_rows_int8(x, x_scale)
        acc = (int8_product(x_codes, self.weight_int8) if int8_product_here(x.shape[0])
               else torch._int_mm(x_codes, self.weight_int8.t()))  # int32 [rows, N]
        return acc.float() * x_scale * self.scale

    def dequantized_weight(self):
        return dequantize_int8(self.weight_int8, self.scale)


class StaticInt8Linear(DynamicInt8Linear):
    """Dynamic int8 with the activation scale fixed once, from calibration (`calibrate_input_ranges`).

    Values beyond the calibrated range saturate at ±127: the price of skipping the per-step max.
    """

    def __init__(self, q, scale, input_absmax: float, bias=None):
        super().__init__(q, scale, bias)
        self.register_buffer("static_scale", torch.tensor(max(input_absmax, 1e-12) / 127))

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_absmax: float) -> "StaticInt8Linear":
        return cls(*quantize_int8_per_channel(linear.weight), input_absmax, linear.bias)

    def input_scale(self, x):
        return self.static_scale


__all__ = ["INT4_GROUP_SIZES", "QuantizationError", "QuantizedLinear", "Int8WeightLinear", "Int4WeightLinear",
           "DynamicInt8Linear", "StaticInt8Linear", "quantize_int8_per_channel", "dequantize_int8",
           "quantize_int4_groupwise", "dequantize_int4", "quantize_rows_int8", "check_int4_shape", "check_int8_shape",
           "check_device", "check_int4_dtype", "GPU_METHODS", "int8_dequantizing_matmul", "int4_pairs", "inner_k_tiles"]
