"""Predicted beside measured: results/predictions.json's forecasts against what the suites then stored.

`python -m minillm.bench predict` forecast each row before the suites ran (`predict.py`); here each row
is read back from the results file it named, through its figure expression (`figures.py`), and judged
against the one band the forecast stated for the whole course. A row counts only if its measurement is
later than the forecast and from the same machine: a results file measured before the forecast, or on
another machine, is named as such, never compared. `python -m minillm.bench report` writes the verdicts to
results/predicted-vs-measured.json; a notebook prints its lesson's forecast with
`table(rows("06"), measured=False)` before it shows the measurement, and the verdicts with
`table(rows("06"))` after it.

A miss stays a miss. Its reason is the term the cost model lacks, written in `MISSING_TERMS` once it is
understood, and the fix is a new term in the model for the whole course, never a wider band for one lesson.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from ..base.jsonio import read_json
from . import figures
from .common import RESULTS, machine_label

# What the cost model does not (yet) count, by the start of a row's `what`: shown beside a row outside the band.
# Empty while no miss is understood: the terms found so far (the library's speed on the model's shapes, attention
# per call, the dispatch of the model's own code, the compiled kernels per format) are probes now (`costmodel`).
MISSING_TERMS: dict[str, str] = {}
NOT_MEASURED, EARLIER, ELSEWHERE = "not measured", "measured before the forecast", "measured on another machine"


def when(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp)


def verdicts(folder: Path = RESULTS) -> dict | None:
    """The forecast's rows, each with its measurement, measured / predicted and its verdict; None before any
    `python -m minillm.bench predict`. Stamped with the forecast's machine: only measurements from it are compared."""
    folder = Path(folder)
    if not (folder / "predictions.json").exists():
        return None
    forecast = read_json(folder / "predictions.json")
    low, high = forecast["band"]
    names = figures.results_names(folder)
    sources = {name: read_json(folder / f"{name}.json") for name in {row["source"] for row in forecast["rows"]}
               if (folder / f"{name}.json").exists()}
    rows = [{**row, **judged(row, forecast, sources.get(row["source"]), names, low, high)} for row in forecast["rows"]]
    return {"machine": forecast["machine"],
            "predicted": {"date": forecast["date"], "git": forecast["git"], "machine": forecast["machine"]},
            "band": [low, high], "rows": rows, **tally(rows),
            "lessons": {lesson: tally([r for r in rows if r["lesson"] == lesson])
                        for lesson in sorted({r["lesson"] for r in rows})}}


def tally(rows: list[dict]) -> dict:
    """How many of `rows` were compared and how many landed inside the band: the course's count, and each
    lesson's (`lessons["06"]`), which a lesson's prose quotes in a figure span."""
    compared = [r for r in rows if r["verdict"] in ("inside", "outside")]
    inside = sum(r["verdict"] == "inside" for r in compared)
    return {"compared": len(compared), "inside": inside, "inside_share": inside / len(compared) if compared else None}


def judged(row: dict, forecast: dict, source: dict | None, names: dict, low: float, high: float) -> dict:
    """One row's measurement and verdict: inside, outside (with the missing term, where known), or why not
    compared. `source` is the results file the row names (None where it has not been written)."""
    if source is None:
        return {"measured": None, "ratio": None, "verdict": NOT_MEASURED}
    if machine_label(source["machine"]) != machine_label(forecast["machine"]):
        return {"measured": None, "ratio": None, "verdict": ELSEWHERE}
    if when(source["date"]) <= when(forecast["date"]):
        return {"measured": None, "ratio": None, "verdict": EARLIER}
    try:
        measured = float(figures.evaluate(row["measured"], names))
    except figures.FigureError:
        return {"measured": None, "ratio": None, "verdict": NOT_MEASURED}
    ratio = measured / row["predicted"]  # a time above 1 or a speed below 1: slower than forecast
    inside = low <= ratio <= high
    missing = next((why for start, why in MISSING_TERMS.items() if row["what"].startswith(start)), "")
    return {"measured": measured, "ratio": ratio, "verdict": "inside" if inside else "outside",
            **({} if inside else {"missing_term": missing or "not yet understood"})}


def rows(lesson: str, folder: Path = RESULTS) -> list[dict]:
    """One lesson's rows ('05', '06', '07', '08', '14', '15'), or [] before any forecast."""
    data = verdicts(folder)
    return [] if data is None else [r for r in data["rows"] if r["lesson"] == lesson]


def forecast_note(folder: Path = RESULTS) -> str:
    """When and where the forecast was made, and its one band: the line a notebook prints above its rows."""
    path = Path(folder) / "predictions.json"
    if not path.exists():
        return "no forecast yet: run `python -m minillm.bench predict`, then the suites"
    forecast = read_json(path)
    low, high = forecast["band"]
    commit = (forecast.get("git") or {}).get("commit")
    at_commit = f" at commit {commit[:7]}" if commit else ""
    return (f"forecast made {forecast['date'][:16].replace('T', ' ')} UTC{at_commit} "
            f"on {machine_label(forecast['machine'])}, before the suites ran; a row is inside when measured / "
            f"predicted lies in {low}-{high}")


def table(lesson_rows: list[dict], measured: bool = True) -> str:
    """Fixed-width: predicted, and (with `measured`) the measurement, measured / predicted and the verdict; without
    it, the forecast alone, for a notebook to print before it shows the measurement."""
    if not lesson_rows:
        return "no forecast yet: run `python -m minillm.bench predict`, then the suites"
    if not measured:
        return "\n".join([f"{'what':44s} {'unit':5s} {'predicted':>10s}",
                          *(f"{r['what']:44s} {r['unit']:5s} {r['predicted']:10.2f}" for r in lesson_rows)])
    lines = [f"{'what':44s} {'unit':5s} {'predicted':>10s} {'measured':>10s} {'measured/predicted':>18s}  verdict"]
    for r in lesson_rows:
        value = "" if r["measured"] is None else f"{r['measured']:10.2f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:18.2f}"
        lines.append(f"{r['what']:44s} {r['unit']:5s} {r['predicted']:10.2f} {value:>10s} {ratio:>18s}  "
                     f"{r['verdict']}{': ' + r['missing_term'] if r.get('missing_term') else ''}")
    return "\n".join(lines)


def plot(data: dict, path: Path | None = None, ax=None):
    """Each compared row's measured / predicted on a log axis, the band shaded: `data` is `verdicts()`. Drawn on
    `ax`, or on a new figure saved to `path` (report's results/predicted-vs-measured.png)."""
    import matplotlib.pyplot as plt

    compared = [r for r in data["rows"] if r["ratio"] is not None]
    figure = None
    if ax is None:
        figure, ax = plt.subplots(figsize=(9, 0.26 * len(compared) + 1.4))
    low, high = data["band"]
    ax.axvspan(low, high, color="tab:green", alpha=0.12, label=f"the band, {low}-{high}")
    ax.axvline(1.0, color="gray", linewidth=0.8)
    y = range(len(compared))
    colours = ["tab:green" if r["verdict"] == "inside" else "tab:red" for r in compared]
    ax.scatter([r["ratio"] for r in compared], y, c=colours, zorder=3)
    ax.set_yticks(list(y), [f"{r['lesson']}: {r['what']}" for r in compared], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("measured / predicted (a time above 1 or a speed below 1: slower than forecast)")
    ax.set_title(f"{data['inside']} of {data['compared']} rows inside the band "
                 f"(forecast on {machine_label(data['predicted']['machine'])})", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    if figure is not None and path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
    return ax


__all__ = ["verdicts", "rows", "forecast_note", "table", "plot", "MISSING_TERMS"]
