"""What every benchmark suite shares: the machine's description, the timing protocol, plot helpers.

`python -m minillm.bench` (the runner) and every suite import from here; nothing here
imports a suite or the runner, so the benchmarks form no import cycle.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..base.machine import cpuinfo_field

SUITES = {
    "predict": "minillm.bench.predict",  # first: the forecasts, before the suites below measure them
    "decode": "minillm.bench.decode",
    "cache-scaling": "minillm.bench.cache_scaling",
    "batch": "minillm.bench.batch",
    "speculative": "minillm.bench.speculative",
    "lookahead": "minillm.bench.lookahead",
    "serving": "minillm.bench.serving",
    "server": "minillm.bench.server",
    "serve-vs-llamacpp": "minillm.bench.serve_vs_llamacpp",
    "attention": "minillm.bench.attention",
    "compile": "minillm.bench.compile",
    "quant": "minillm.bench.quant",
    "regression": "minillm.bench.regression",
    "cli": "minillm.bench.processes",
    "parallel": "minillm.bench.parallel",
}
REPO = Path(__file__).resolve().parent.parent.parent
RESULTS = REPO / "results"
COMPILED_SUFFIX = ", compiled"  # a contender run compiled (lesson 15): its eager variant's name + this
# Instruction-set extensions that decide which kernels a CPU can run (x86 `flags`, Arm `Features`).
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8",
             "asimd", "asimddp", "bf16", "i8mm", "sve")


def cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The ISA_FLAGS this CPU reports: whether BF16 or int8 can be fast depends on them (lesson 05)."""
    reported = set((cpuinfo_field("flags", "Features") or "").split())
    return [flag for flag in ISA_FLAGS if flag in reported]


def memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def machine_info(device: str = "cpu") -> dict:
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": memory_gib(), "cpu_flags": cpu_flags(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def vector_isa(flags) -> str | None:
    """The widest vector instructions among `flags` ('AMX', 'AVX-512', 'AVX2', 'SVE', 'NEON'), None if unknown.

    Two machines with the same CPU name can differ here (the same cloud's EPYCs come with and without AVX-512),
    and it decides how fast int8 and bfloat16 kernels run, so a number is only comparable within one level.
    """
    flags = set(flags or ())
    for level, needs in (("AMX", "amx_bf16"), ("AVX-512", "avx512f"), ("AVX2", "avx2"), ("SVE", "sve"),
                         ("NEON", "asimd")):
        if needs in flags:
            return level
    return None


def machine_label(info: dict) -> str:
    """Short machine name for titles and stamps: 'AMD EPYC, 2 cores, AVX2' (a GPU by its name)."""
    if "gpu" in info:
        return info["gpu"]
    label = f"{info['cpu'].replace('(R)', '').replace('Intel Xeon', 'Xeon')}, {info['cores']} cores"
    isa = vector_isa(info.get("cpu_flags"))
    return f"{label}, {isa}" if isa else label


def ran_on(device: str = "cpu") -> str:
    """The line a notebook's first cell prints, so its stored outputs name the machine they came from.

    `tests/test_lessons.py` reads it back and checks it against the machine of every results file the
    notebook quotes.
    """
    return f"ran on: {machine_label(machine_info(device))} (torch {torch.__version__})"


def model_label(name: str) -> str:
    """The model's name for titles and tables: the default model by its real name, a path by its folder."""
    from ..model.loading import DEFAULT_ALIASES

    return "SmolLM2-135M-Instruct" if name in DEFAULT_ALIASES else Path(name).name or name


def plot_title(subject: str, data: dict, dtype: str) -> str:
    """`subject`, model, dtype, device and machine: what a figure needs to be read on its own."""
    machine = data.get("machine") or machine_info()
    return f"{subject}: {model_label(data['model'])}, {dtype}, {machine['device']} ({machine_label(machine)})"


def spread(centres, samples):
    """matplotlib `yerr` reaching from each centre (a median) down to its samples' min and up to their max.

    None unless every point has samples (results written before every repeat was kept have none).
    """
    if not all(samples):
        return None
    return [[c - min(s) for c, s in zip(centres, samples)], [max(s) - c for c, s in zip(centres, samples)]]


def spread_band(ax, xs, samples, color) -> None:
    """Shade from the min to the max of each point's samples; nothing for results without them."""
    if all(samples):
        ax.fill_between(xs, [min(s) for s in samples], [max(s) for s in samples], color=color, alpha=0.2,
                        linewidth=0)


def save_png(fig, path, dpi: int = 100) -> None:
    """Save a figure as a PNG with a 256-colour palette.

    A plot has few distinct colours, so the palette changes nothing visible and
    makes the file about three times smaller; results/ is committed, and every
    redrawn figure stays in the repository's history.
    """
    import io

    from PIL import Image  # a dependency of matplotlib

    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=dpi)
    Image.open(rendered).convert("RGB").quantize(colors=256).save(path, format="png", optimize=True)


def finish_figure(fig, path=None):
    """Lay the figure out; with a path, save it as a PNG (`save_png`) and close it.

    Returns the figure, which a notebook displays."""
    fig.tight_layout()
    if path is not None:
        import matplotlib.pyplot as plt

        save_png(fig, path)
        plt.close(fig)
    return fig


def alternate(contenders: dict, repeats: int = 3, warmup: int = 1,
              desc: str = "benchmark runs") -> dict[str, list[float]]:
    """Call each contender (a no-argument function returning seconds or None) in turn.

    Round-robin over `repeats` rounds after `warmup` rounds, so slow drift in the
    machine's speed affects every contender alike. A contender that returns a number
    reports its own time (e.g. decode time without prefill); otherwise wall time is used.
    """
    times = {name: [] for name in contenders}
    # A progress bar on a terminal only (disable=None): notebooks and logs stay clean.
    with tqdm(total=(warmup + repeats) * len(contenders), desc=desc, leave=False,
              disable=None) as progress:
        for round_ in range(warmup + repeats):
            for name, fn in contenders.items():
                progress.set_postfix_str(f"round {round_ + 1}/{warmup + repeats}: {name}")
                t = time.perf_counter()
                reported = fn()
                elapsed = time.perf_counter() - t
                if round_ >= warmup:
                    times[name].append(reported if isinstance(reported, (int, float)) else elapsed)
                progress.update()
    return times


@contextmanager
def stderr_silenced():
    """Point file descriptor 2 at /dev/null for the block (C++ code writes there, below Python's sys.stderr)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def quiet_profile(**options):
    """`torch.profiler.profile(**options)` without the two `USDT: ... profiler_start / profiler_stop` lines that
    torch 2.13's profiler writes from C++ as it starts and stops (they say nothing about the code profiled, and a
    notebook would store them). Only the start and the stop are silenced: errors inside the block still show."""
    from torch.profiler import profile

    prof = profile(**options)
    with stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with stderr_silenced():
            prof.__exit__(None, None, None)


def median(values) -> float:
    return statistics.median(values)
