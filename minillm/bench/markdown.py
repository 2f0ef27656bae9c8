"""How the README's generated figures are written: numbers, spans, tables, and where each result came from.

One place decides how each kind of figure reads (a ratio "1.67x", a share "43%", a span
"1.43x-2.35x"), so every section of every README says them alike, and each table names
its machine, library versions and commit (`provenance`).
"""

from __future__ import annotations

import textwrap

from .common import machine_label

WIDTH = 115  # the README's line length
PRECISIONS = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}
CACHES = {"static": "static cache", "dynamic": "dynamic cache", "none": "no cache"}


# --- Formatting: one place decides how each kind of figure is written. --------------------------------------------

def times(ratio: float) -> str:
    return f"{ratio:.2f}x"


def percent(fraction: float) -> str:
    return f"{fraction:.0%}"


def milliseconds(ms: float) -> str:
    """Three significant figures at most: 23.5, 358, 1660."""
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def seconds(value: float) -> str:
    """'0.35 s', and three decimals below a tenth of a second (a GPU's prefill) so it does not round to 0.01."""
    return f"{value:.2f} s" if value >= 0.1 else f"{value:.3f} s"


def span(values, digits: int = 2, unit: str = "", scale: float = 1.0) -> str:
    """'0.80-1.09x': the range of `values` (None, an undefined value, skipped), or one value if both ends agree."""
    values = [v for v in values if v is not None]
    if not values:
        return "undefined"
    low, high = (f"{scale * v:.{digits}f}" for v in (min(values), max(values)))
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def paragraph(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def bullet(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent="- ", subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def bold_max(cells: list[str], values: list[float]) -> list[str]:
    best = values.index(max(values))
    return [f"**{cell}**" if i == best else cell for i, cell in enumerate(cells)]


# --- Where a result came from. --------------------------------------------------------------------------------------

def machine_text(machine: dict) -> str:
    """'AMD EPYC, 2 cores, AVX2, 24 GiB (cpu), torch 2.13.0+cpu, transformers 5.23.0', from what the JSON recorded."""
    text = machine_label(machine)
    if "gpu" in machine:  # the GPU's name, then the host it hangs off
        text += f" (host: {machine_label({k: v for k, v in machine.items() if k != 'gpu'})}"
        text += f", {machine['memory_gib']:.0f} GiB)" if machine.get("memory_gib") else ")"
    else:
        text += f", {machine['memory_gib']:.0f} GiB" if machine.get("memory_gib") else ""
        text += f" ({machine['device']})"
    text += f", torch {machine['torch']}"
    if machine.get("transformers"):
        text += f", transformers {machine['transformers']}"
    return text


def commit_text(data: dict) -> str:
    """'commit 8e06c7e', with '(dirty)' for uncommitted changes; 'unknown commit' for older results."""
    git = data.get("git")
    if not git:
        return "unknown commit"
    return f"commit {git['commit'][:7]}" + (" (dirty)" if git["dirty"] else "")


def provenance(data: dict) -> str:
    """The line under each heading: the command, the machine, the commit, how many repeats."""
    when = f", {data['date'][:10]}" if data.get("date") else ""
    count = data.get("repeats")
    repeats = f"; medians of {count} timed repeats" if count and count > 1 else "; one timed run" if count else ""
    return paragraph(f"_`{data['command']}` on {machine_text(data['machine'])}; {commit_text(data)}{when}"
                     f"{repeats}._")


def heading(title: str, links: dict, text: str) -> str:
    """The bold title, links to the plot and the JSON, and what was measured."""
    return paragraph(f"**{title}** ([plot]({links['png']}), [JSON]({links['json']})): {text}")


def section(title: str, links: dict, text: str, data: dict, header: list[str], rows: list[list[str]],
            notes: list[str]) -> str:
    """A suite's whole section: heading with what was measured, provenance, the table, then the notes."""
    return "\n\n".join([heading(title, links, text), provenance(data), table(header, rows), "\n".join(notes)])
