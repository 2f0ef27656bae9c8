"""Quantized matmuls over many rows: the codes widened once per call, then one dense matmul (lesson 14).

PyTorch's weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
are built for decoding: they stream the codes once per activation row, so their time
grows with the rows (a 512-token prompt reads every weight 512 times) and never reaches
the CPU's matrix units. A prefill chunk is the opposite case: enough rows that the
matmul, not the weight's bytes, sets the time. There it pays to widen the codes to a
dense matrix once per call and run the matmul an unquantized model runs.

Widened to what depends on the CPU (`widened_dtype`). With bfloat16 dot products (AVX-512
BF16 or AMX: the course's Xeon) to bfloat16, 2 bytes per weight, through oneDNN. Measured
there, one [1536, 576] weight, 512 rows: the int8 kernel 6.4 ms, widened 0.83 ms; int4
kernel 5.7 ms, widened 1.1 ms; widening wins from 32 rows (int8) and about 64 (int4: a
nibble split and a scale per group cost more). Without them (the AMD EPYC, AVX2 only)
PyTorch's bfloat16 matmul is a generic loop, and a bfloat16 widening made prefill 10-40x
slower than the kernels (397 against 9.8 ms for int4 at 256 rows); there the codes widen
to float32 instead: at 256 rows int8 4.8 against the kernel's 7.9 ms, int4 6.8 against
8.8, winning from about 64 rows (int8) and 192 (int4) (`WIDEN_FROM_ROWS`). The widened
matrix lands in a buffer kept per thread and reused: allocating it fresh each call
page-faults, and in a VM those faults cost more than the matmul (26 ms instead of 4 for
the head).

The values are the ones the kernels compute (the same codes, scales and zeros) rounded
at a different point, so the two paths differ within bfloat16's rounding, not more; the
bfloat16 widening rounds each int4 weight to bfloat16 and int8's product before its scale:
over 1024-token windows of held-out text, perplexity against float32 went from +0.50% to
+0.62% (int8) and from +0.16% to +0.30% (int4) on the Xeon, bfloat16's own error added to
the codes' (`bench quant`). Compiled and exported graphs keep the kernels: `widens` says no
while tracing, so a kept graph's code does not depend on this file.

Dynamic int8 multiplies int8 activations by int8 weights (`torch._int_mm`). Without int8
dot-product instructions (VNNI or AMX) that product is a generic loop too, about 0.3 ms a
row for a [1536, 576] weight on the EPYC. `int8_product` computes the same integers
through a float32 matmul instead: a product of two int8 codes is at most 127² = 16129 and
a float32 holds every integer below 2²⁴, so a sum over at most `EXACT_K` = 1040 such
products is exact in any order; longer rows are cut into pieces of `EXACT_K`, each exact,
added as int32. The result equals `torch._int_mm`'s bit for bit, 25x faster at 64 rows.

int4 codes sit in the kernel's packed layout, which this CPU's kernel chose: for a block
of B output rows (B = 64 with AVX-512, 32 with AVX2) and each input column, B/2 bytes
hold rows 0..B/2-1 in their low nibbles and B/2..B-1 in their high ones. `int4_block`
finds B by packing a probe and reading it back, and returns None where neither layout
matches (then the kernel runs at every row count).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from ..base.machine import bfloat16_dot_products, int8_dot_products

# Rows from which a widened matmul beats the kernel, by the dtype the codes widen to (measurements above).
WIDEN_FROM_ROWS = {torch.bfloat16: {"int8": 32, "int4": 64}, torch.float32: {"int8": 64, "int4": 192}}
EXACT_K = (2 ** 24) // (127 * 127)  # 1040: int8 products a float32 sum holds exactly
INT8_PRODUCT_FROM_ROWS = 8  # rows from which `int8_product` beats `torch._int_mm` without int8 dot products

_scratch = threading.local()  # each thread's reusable buffers: {(name, shape, dtype): tensor}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of this shape kept for the calling thread (its contents are whatever the last user left)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (name, shape, dtype)
    if key not in buffers:
        buffers[key] = torch.empty(shape, dtype=dtype)
    return buffers[key]


def widened_dtype() -> torch.dtype:
    """What codes widen to here: bfloat16 where the CPU multiplies it in hardware, float32 elsewhere."""
    return torch.bfloat16 if bfloat16_dot_products() else torch.float32


def widen_from_rows(kind: str) -> int:
    """Rows from which a weight-only linear of `kind` ("int8" or "int4") widens its codes on this CPU."""
    return WIDEN_FROM_ROWS[widened_dtype()][kind]


def widens(x: torch.Tensor, compute_dtype: torch.dtype, kind: str) -> bool:
    """Whether a weight-only linear of `kind` ("int8" or "int4") should widen its codes for these activation
    rows x [rows, K].

    Tracing is asked first, and the CPU's threshold last: under export the row count is a symbol, and
    comparing it would narrow the exported graph's range of rows to one side of the threshold; under
    torch.compile the threshold's look-up (the CPU's flags, read from a file) cannot be traced.
    """
    return (not torch.compiler.is_compiling() and compute_dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[0] >= widen_from_rows(kind))


def int8_widened_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K], q int8 [N, K], scale [N] -> x · (q · scale)ᵀ [rows, N], in `widened_dtype()`.

    The codes (|q| <= 127) are exact in bfloat16 and float32; the scale is applied to the
    product's rows afterwards, as the kernel does.
    """
    dtype = widened_dtype()
    weight = scratch("int8", tuple(q.shape), dtype)
    weight.copy_(q)
    return F.linear(x.to(dtype), weight).mul_(scale.to(dtype))


def int8_product(x_codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """int8 x [rows, K] times int8 w [N, K] transposed -> int32 [rows, N], equal to `torch._int_mm(x, w.t())`:
    float32 matmuls over pieces of at most `EXACT_K` columns, each sum exact, added as int32."""
    k = x_codes.shape[1]
    weight = scratch("int8-product", tuple(w_codes.shape), torch.float32)
    weight.copy_(w_codes)
    x = x_codes.float()
    total = None
    for start in range(0, k, EXACT_K):
        piece = (x[:, start:start + EXACT_K] @ weight[:, start:start + EXACT_K].t()).to(torch.int32)
        total = piece if total is None else total.add_(piece)
    return total


def int8_product_here(rows: int) -> bool:
    """Whether `int8_product` should replace `torch._int_mm` for this many rows on this CPU (not while tracing)."""
    return not torch.compiler.is_compiling() and not int8_dot_products() and rows >= INT8_PRODUCT_FROM_ROWS


@functools.cache
def int4_block() -> int | None:
    """The output rows per block of this CPU's int4 packed layout (64 or 32), or None if it is neither."""
    n, k = 128, 64
    probe = torch.arange(n * k, dtype=torch.int32).reshape(n, k).mul(7).remainder(16)  # every code, no pattern
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for block in (64, 32):
        if torch.equal(unpack_int4(packed, n, k, block).t(), probe.to(torch.uint8)):
            return block
    return None


def unpack_int4(packed: torch.Tensor, n: int, k: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's packed codes -> codes [K, N] (uint8 0..15, or into `out` in its dtype): the weight's transpose."""
    halves = packed.view(n // block, k, block // 2).permute(1, 0, 2)  # [K, N / B, B / 2] bytes
    codes = torch.empty(k, n, dtype=torch.uint8) if out is None else out
    rows = codes.view(k, n // block, block)  # [K, N / B, B]
    rows[..., :block // 2].copy_(halves & 15)
    rows[..., block // 2:].copy_(halves >> 4)
    return codes


def int4_widened_matmul(x: torch.Tensor, packed: torch.Tensor, scale_and_zero: torch.Tensor, n: int,
                        group_size: int) -> torch.Tensor:
    """x [rows, K], the kernel's packed codes and scale_and_zero [K / group, N, 2] -> [rows, N] in `widened_dtype()`.

    w = (q − 8)·scale + zero per group of K, computed as q·scale + (zero − 8·scale) on the
    transposed weight [K, N], whose groups line up with scale_and_zero's first axis.
    """
    k = x.shape[1]
    dtype = widened_dtype()
    weight_t = unpack_int4(packed, n, k, int4_block(), out=scratch("int4", (k, n), dtype))
    scale, zero = scale_and_zero.float().unbind(-1)  # [K / group, N] each
    groups = weight_t.view(k // group_size, group_size, n)
    groups.mul_(scale[:, None].to(dtype)).add_((zero - 8 * scale)[:, None].to(dtype))
    return x.to(dtype) @ weight_t


__all__ = ["WIDEN_FROM_ROWS", "EXACT_K", "widened_dtype", "widen_from_rows", "widens", "int8_widened_matmul",
           "int8_product", "int8_product_here", "int4_block", "unpack_int4", "int4_widened_matmul", "scratch"]
