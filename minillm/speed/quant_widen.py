"""Quantized matmuls over many rows: the codes widened to bfloat16 once per call, then one dense matmul (lesson 14).

PyTorch's weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
are built for decoding: they stream the codes once per activation row, so their time
grows with the rows (a 512-token prompt reads every weight 512 times) and never reaches
the CPU's matrix units. A prefill chunk is the opposite case: enough rows that the
matmul, not the weight's bytes, sets the time. There it pays to widen the codes to a
dense bfloat16 matrix once per call (a pass over 2 bytes per weight) and run the same
bfloat16 matmul an unquantized model runs (AMX or AVX-512 BF16 through oneDNN).

Measured on the course's 2-core Xeon, one [1536, 576] weight, 512 rows: the int8 kernel
6.4 ms, widened 0.83 ms; int4 kernel 5.7 ms, widened 1.1 ms. The int8 paths tie at 16
rows (0.20 vs 0.16 ms here, the LM head 7.4 vs 9.9 ms) and widening wins from 32 rows
on, for the head too (14.8 vs 10.2 ms); int4's widening costs more (a nibble split and a
scale per group) and wins from about 64 rows (0.70 vs 0.57 ms). Those are the row counts
from which `Int8WeightLinear` and `Int4WeightLinear` widen. The widened matrix lands in a
buffer kept per thread and reused: allocating it fresh each call page-faults, and
in a VM those faults cost more than the matmul (26 ms instead of 4 for the head).

The values are the ones the kernels compute (the same codes, scales and zeros) rounded
to bfloat16 at a different point, so the two paths differ within bfloat16's rounding,
not more; but the kernels dequantize in float32, and here each int4 weight is rounded to
bfloat16 and int8's product is rounded before its scale: over 1024-token windows of
held-out text, perplexity against float32 went from +0.50% to +0.62% (int8) and from
+0.16% to +0.30% (int4), bfloat16's own error added to the codes' (`bench quant`).
Compiled and exported graphs keep the kernels: `widens` says no while tracing, so a kept
graph's code does not depend on this file.

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

_scratch = threading.local()  # each thread's reusable buffers: {(name, shape, dtype): tensor}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of this shape kept for the calling thread (its contents are whatever the last user left)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (name, shape, dtype)
    if key not in buffers:
        buffers[key] = torch.empty(shape, dtype=dtype)
    return buffers[key]


def widens(x: torch.Tensor, compute_dtype: torch.dtype, from_rows: int) -> bool:
    """Whether a weight-only linear should widen its codes for these activation rows x [rows, K].

    Tracing is asked first: under export the row count is a symbol, and comparing it would
    narrow the exported graph's range of rows to one side of `from_rows`.
    """
    return (not torch.compiler.is_compiling() and compute_dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[0] >= from_rows)


def int8_widened_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] bfloat16, q int8 [N, K], scale [N] -> x · (q · scale)ᵀ [rows, N] bfloat16.

    The codes (|q| <= 127) are exact in bfloat16; the scale is applied to the product's rows
    afterwards, as the kernel does.
    """
    weight = scratch("int8", tuple(q.shape), torch.bfloat16)
    weight.copy_(q)
    return F.linear(x, weight).mul_(scale)


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
    """x [rows, K] bfloat16, the kernel's packed codes and scale_and_zero [K / group, N, 2] -> [rows, N] bfloat16.

    w = (q − 8)·scale + zero per group of K, computed as q·scale + (zero − 8·scale) on the
    transposed weight [K, N], whose groups line up with scale_and_zero's first axis.
    """
    k = x.shape[1]
    block = int4_block()
    weight_t = unpack_int4(packed, n, k, block, out=scratch("int4", (k, n), torch.bfloat16))
    scale, zero = scale_and_zero.unbind(-1)  # [K / group, N] each
    groups = weight_t.view(k // group_size, group_size, n)
    groups.mul_(scale[:, None]).add_((zero.float() - 8 * scale.float())[:, None])
    return x @ weight_t


__all__ = ["widens", "int8_widened_matmul", "int4_block", "unpack_int4", "int4_widened_matmul", "scratch"]
