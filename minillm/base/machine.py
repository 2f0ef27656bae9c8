"""What this machine's CPU is, as the kernel reports it: fields of /proc/cpuinfo.

Read by the benchmarks (to name the machine a figure comes from), by the kept graphs' keys
(a package's code is compiled for one CPU) and by the autotuning rule (which libraries are
fast here).
"""

from __future__ import annotations

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


__all__ = ["cpuinfo_field"]
