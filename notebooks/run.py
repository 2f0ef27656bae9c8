"""Execute notebooks in place to commit them: top to bottom, with no progress-bar widget left in the stored outputs.

    python notebooks/run.py notebooks/06_kv_cache.ipynb notebooks/07_batching.ipynb

Run every notebook on one machine: each first cell prints the machine, and tests/test_lessons.py
checks it against every results/ file the notebook quotes. A progress bar in a notebook is a
widget whose state is not saved, so a stored one shows frozen at 0%; this drops those outputs
(a learner running the notebook still sees them move) and keeps everything a cell prints. The first
cell's "**Runs in:**" paragraph then states how long the stored run's cells took, from the timestamps
Jupyter stored with them (`stamp_run_time`), so that figure is measured, not typed.
"""

from __future__ import annotations

import datetime
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

WIDGET = "application/vnd.jupyter.widget-view+json"
RUNS_IN = re.compile(r"(\*\*Runs in:\*\*.*?)(?: Its stored run's cells took \d+ s\.)?(?=\n\n|\n\*\*|\Z)", re.DOTALL)


def stored_run_seconds(notebook: dict) -> int:
    """Seconds from the first code cell's start to the last one's end, from the execution timestamps stored in
    the cells' metadata (a dict as json.load gives it, or a NotebookNode)."""
    stamps = [datetime.datetime.fromisoformat(cell["metadata"]["execution"][key].replace("Z", "+00:00"))
              for cell in notebook["cells"] if cell["cell_type"] == "code"
              for key in ("iopub.execute_input", "iopub.status.idle")]
    return round((max(stamps) - min(stamps)).total_seconds())


def stamp_run_time(notebook: dict) -> None:
    """End the first cell's "**Runs in:**" paragraph with the stored run's time (`stored_run_seconds`)."""
    first = notebook["cells"][0]
    text = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
    sentence = f" Its stored run's cells took {stored_run_seconds(notebook)} s."
    text = RUNS_IN.sub(lambda match: match.group(1).rstrip(" .") + "." + sentence, text, count=1)
    first["source"] = text.splitlines(keepends=True) if isinstance(first["source"], list) else text


def run(path: Path, timeout: int = 1800) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    notebook.metadata.pop("widgets", None)  # the widgets' saved state: the same frozen bars
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if WIDGET not in output.get("data", {})]
    stamp_run_time(notebook)
    nbformat.write(notebook, path)


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: python notebooks/run.py NOTEBOOK.ipynb [...]", file=sys.stderr)
        return 2
    for name in paths:
        start = time.perf_counter()
        run(Path(name).resolve())
        print(f"{name}: executed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
