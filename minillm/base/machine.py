"""What this machine's CPU is, as the kernel reports it: fields of /proc/cpuinfo.

Read by the benchmarks (to name the machine a figure comes from), by the kept graphs' keys
(a package's code is compiled for one CPU), by the autotuning rule (which libraries are
fast here) and by the quantized matmuls (which products this CPU has instructions for).
"""

from __future__ import annotations

import functools
from pathlib import Path


def cpuinfo_field(*keys: str) -> str | None:
    """The first /proc/cpuinfo value under one of `keys` (None off Linux, or when no line has one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys:
                return value.strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel lists for this CPU (empty off Linux)."""
    return frozenset((cpuinfo_field("flags") or "").split())


@functools.cache
def bfloat16_dot_products() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX): without, PyTorch's bfloat16
    matmuls take a generic path, 5-6x slower than float32's over hundreds of rows (on the AMD EPYC)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def int8_dot_products() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI or AMX): without, `torch._int_mm` runs
    about 0.3 ms per row of a [1536, 576] weight (on the AMD EPYC), 10-25x float32's matmul."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


__all__ = ["cpuinfo_field", "cpu_flags", "bfloat16_dot_products", "int8_dot_products"]
