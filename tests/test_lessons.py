"""The course's shape: notebooks committed executed, exercises listed alike and checked, solutions that pass.

A learner reads the notebooks on GitHub without running them, so a notebook
committed without outputs is a defect; each lesson's exercises must appear,
with the same titles, in its README, its notebook and its answer file, and
each must have a check that skips until answered and passes on the worked
solution.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(path for path in (ROOT / "lessons").iterdir() if path.is_dir() and path.name[:2].isdigit())
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXERCISE = re.compile(r"^#+ Exercise (\d+): (.+?)\s*$", re.MULTILINE)
MAX_IMAGE_BYTES = 200_000
MAX_NOTEBOOK_BYTES = 600_000


def notebook_for(lesson: Path) -> Path:
    return ROOT / "notebooks" / (lesson.name.replace("-", "_") + ".ipynb")


def markdown_of(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")


def test_every_lesson_has_its_parts():
    assert len(LESSONS) >= 10 and len(NOTEBOOKS) == len(LESSONS)
    for lesson in LESSONS:
        for part in (lesson / "README.md", lesson / "exercises.py", notebook_for(lesson),
                     lesson / f"test_exercises_{lesson.name[:2]}.py",
                     ROOT / "solutions" / (lesson.name.replace("-", "_") + ".py")):
            assert part.exists(), f"{lesson.name} lacks {part.relative_to(ROOT)}"


def test_readme_lesson_table_gives_time_and_prerequisites():
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| \d\d \|", line)}
    for lesson in LESSONS:
        cells = rows.get(lesson.name[:2])
        assert cells, f"README's lesson table lacks {lesson.name}"
        title, time, needs, notebook = cells[:4]
        assert f"lessons/{lesson.name}/README.md" in title and notebook_for(lesson).name in notebook
        assert re.fullmatch(r"[\d.]+ (h|min)", time) and needs, f"{lesson.name}: give its time and prerequisites"


# --- Notebooks read on GitHub. ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_committed_executed(notebook):
    """Every code cell ran, in order, without an error; the notebook draws at least one figure; outputs stay small."""
    assert notebook.stat().st_size <= MAX_NOTEBOOK_BYTES, f"{notebook.name} is over {MAX_NOTEBOOK_BYTES} bytes"
    code = [cell for cell in json.loads(notebook.read_text())["cells"] if cell["cell_type"] == "code"]
    counts = [cell["execution_count"] for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"{notebook.name}: run it top to bottom and commit the outputs"
    outputs = [output for cell in code for output in cell["outputs"]]
    assert not [output for output in outputs if output["output_type"] == "error"], f"{notebook.name} has an error"
    images = [output["data"]["image/png"] for output in outputs if "image/png" in output.get("data", {})]
    assert images, f"{notebook.name} has no figure: run it with a plotting backend (unset MPLBACKEND)"
    for image in images:
        assert len(base64.b64decode(image)) <= MAX_IMAGE_BYTES, f"{notebook.name}: an image is over 200 kB"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_outputs_are_clean(notebook):
    """Nothing a learner would wonder about: no stderr (warnings, progress bars frozen mid-way, probe lines), and no
    progress-bar widget, which a stored notebook shows frozen at 0% (`python notebooks/run.py` leaves them out)."""
    stored = json.loads(notebook.read_text())
    assert "widgets" not in stored["metadata"], f"{notebook.name} stores widget state: re-run it with notebooks/run.py"
    for index, cell in enumerate(stored["cells"]):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            assert "application/vnd.jupyter.widget-view+json" not in data, \
                f"{notebook.name} cell {index} stores a progress-bar widget: re-run it with notebooks/run.py"
            text = "".join(output.get("text", "")) + "".join(data.get("text/plain", ""))
            assert not (output["output_type"] == "stream" and output["name"] == "stderr"), \
                f"{notebook.name} cell {index} stores stderr: {text[:120]!r}; silence it at its cause and re-run"
            assert not NOISE.search(text), f"{notebook.name} cell {index} stores {NOISE.search(text).group()!r}"


# --- Stored numbers: where they come from. ----------------------------------------------------------------------------

RAN_ON = re.compile(r"^ran on: (.+) \(torch ([^)]+)\)$", re.MULTILINE)  # what `bench.common.ran_on` prints
READS_RESULTS = re.compile(r"results/[\w{}-]+\.json|RESULTS /")
NOISE = re.compile(r"\bWarning\b|USDT|\s0%\|")


def stale_quotes(notebook: Path, results: Path) -> list[str]:
    """Why `notebook`'s stored outputs and the `results` files it quotes may not belong together ([] if they do).

    Its first cell prints the machine it ran on; each cell that reads results/ names the files in its
    metadata (`quotes`), and each of those files must come from that same machine and torch. The
    numbers themselves are tied when the notebook runs: `run_notebook` (conftest) fails when a quoting
    cell prints anything other than what it stored.
    """
    from minillm.bench.common import machine_label

    ran = ran_on_of(notebook)
    if not ran:
        return [f"{notebook.name}: its first cell does not print `ran_on()`: the machine its outputs come from"]
    problems = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        quotes = cell["metadata"].get("quotes", [])
        if READS_RESULTS.search("".join(cell["source"])) and not quotes:
            problems.append(f"{notebook.name}: a cell reads results/ without naming them in metadata['quotes']")
        for name in quotes:
            machine = json.loads((results / f"{name}.json").read_text())["machine"]
            stamp = (machine_label(machine), machine["torch"])
            if stamp != ran:
                problems.append(f"{notebook.name} ran on {ran[0]} (torch {ran[1]}) but quotes "
                                f"results/{name}.json from {stamp[0]} (torch {stamp[1]}): re-run one of them")
    return problems


# Suites whose results/ come from another machine than the notebooks' (the course's 2-core AMD EPYC of CPU family 26,
# AVX-512, where the forecast, every suite and every notebook were re-run on 2026-11-30). A suite re-measured elsewhere
# goes here until the notebooks and the other suites follow it, so that no notebook quotes figures from another
# machine than its own.
AWAITING_RERUN: set[str] = set()


def ran_on_of(notebook: Path) -> tuple[str, str] | None:
    code = [cell for cell in json.loads(notebook.read_text())["cells"] if cell["cell_type"] == "code"]
    ran = RAN_ON.search("".join("".join(output.get("text", "")) for output in code[0]["outputs"]))
    return ran.groups() if ran else None


def test_notebooks_ran_on_one_machine_and_results_await_only_the_listed_reruns():
    """All notebooks ran on one machine; the results not measured on it are exactly AWAITING_RERUN."""
    from minillm.bench.common import machine_label

    machines = {ran_on_of(notebook) for notebook in NOTEBOOKS}
    assert len(machines) == 1 and None not in machines, f"notebooks ran on several machines: {machines}"
    course = machines.pop()
    elsewhere = set()
    for path in (ROOT / "results").glob("*.json"):
        machine = json.loads(path.read_text())["machine"]
        if (machine_label(machine), machine["torch"]) != course:
            elsewhere.add(path.stem)
    assert elsewhere == AWAITING_RERUN, f"results from another machine than the notebooks' {course}: {elsewhere}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_names_its_machine_and_quotes_results_from_it(notebook):
    awaited = [f"results/{name}.json" for name in AWAITING_RERUN]
    assert [problem for problem in stale_quotes(notebook, ROOT / "results")
            if not any(name in problem for name in awaited)] == []


def test_a_stale_quote_is_caught(tmp_path):
    """A results file re-measured on another machine, with the notebook not re-run, is named."""
    notebook = next(path for path in NOTEBOOKS if "quotes" in path.read_text())
    quoted = [name for cell in json.loads(notebook.read_text())["cells"]
              for name in cell["metadata"].get("quotes", [])]  # one problem per quote, a file quoted twice twice
    for name in set(quoted):
        data = json.loads((ROOT / "results" / f"{name}.json").read_text())
        data["machine"]["cpu"] = "Another CPU"
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    problems = stale_quotes(notebook, tmp_path)
    assert len(problems) == len(quoted) and all("Another CPU" in problem for problem in problems)


def test_a_stale_stored_number_fails_the_notebook_run(run_notebook, tmp_path):
    """A quoting cell whose stored output no longer matches its results file fails when the notebook runs."""
    import nbformat

    (tmp_path / "speed.json").write_text(json.dumps({"tokens_per_second": 42.0}))
    cell = nbformat.v4.new_code_cell('import json\nprint(json.load(open("speed.json"))["tokens_per_second"])',
                                     metadata={"quotes": ["speed"]})
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="41.0\n")]  # planted: measured before
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "planted.ipynb")
    with pytest.raises(AssertionError, match="stores other numbers"):
        run_notebook("planted.ipynb", folder=tmp_path)
    cell.outputs[0].text = "42.0\n"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "planted.ipynb")
    run_notebook("planted.ipynb", folder=tmp_path)  # up to date: passes


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_states_what_it_needs_and_how_long_it_runs(notebook):
    """On top: what it needs, and how long it runs, its stored run's time being the one its cells' timestamps
    give (`python notebooks/run.py` writes it)."""
    sys.path.insert(0, str(ROOT / "notebooks"))
    from run import stored_run_seconds

    stored = json.loads(notebook.read_text())
    first = "".join(stored["cells"][0]["source"])
    assert "**Needs:**" in first and "**Runs in:**" in first, f"{notebook.name}: state needs and run time on top"
    stated = re.search(r"Its stored run's cells took (\d+) s\.", first)
    assert stated and int(stated[1]) == stored_run_seconds(stored), (
        f"{notebook.name}: its first cell must state the stored run's time its cells' timestamps give "
        f"({stored_run_seconds(stored)} s): run it with `python notebooks/run.py`")


# --- Exercises: listed alike, checked, answered. ----------------------------------------------------------------------

def exercises_in_answer_file(path: Path) -> list[tuple[int, str]]:
    """(number, title) from each stub's docstring, whose first line reads 'Exercise N: Title'."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
            match = EXERCISE.match("# " + doc.splitlines()[0])
            if match:
                found.append((int(match.group(1)), match.group(2)))
    return sorted(set(found))


def exercises_in(text: str) -> list[tuple[int, str]]:
    return sorted({(int(number), title) for number, title in EXERCISE.findall(text)})


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_exercises_are_listed_alike(lesson):
    """README, notebook and answer file name the same exercises, at least three; each has a check."""
    in_readme = exercises_in((lesson / "README.md").read_text())
    assert len(in_readme) >= 3, f"{lesson.name}: at least three '### Exercise N: Title' headings in the README"
    assert [number for number, _ in in_readme] == list(range(1, len(in_readme) + 1))
    assert exercises_in(markdown_of(notebook_for(lesson))) == in_readme, f"{lesson.name}: notebook differs"
    assert exercises_in_answer_file(lesson / "exercises.py") == in_readme, f"{lesson.name}: exercises.py differs"
    checks = (lesson / f"test_exercises_{lesson.name[:2]}.py").read_text()
    for number, _ in in_readme:
        assert re.search(rf"def test_exercise_{number}(_\w*)?\(", checks), f"{lesson.name}: no check for {number}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_lesson_readme_opens_with_the_goal_and_ends_with_the_check(lesson):
    text = (lesson / "README.md").read_text()
    assert "**What you will build.**" in text.split("\n## ")[0], f"{lesson.name}: open with what you will build"
    assert text.split("\n## ")[-1].startswith("Check yourself"), f"{lesson.name}: end with '## Check yourself'"


def run_checks(*options: str) -> dict[str, int]:
    """Run every lesson's exercise checks in a fresh interpreter; the outcome counts from its summary line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "pytest", "lessons", "-q", "-p", "no:cacheprovider", "-n", "0",
                             *options],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    return counts | {"output": result.stdout[-5000:]}


@pytest.mark.slow
def test_every_check_passes_on_the_worked_solutions():
    counts = run_checks("--solutions")
    assert not counts.get("failed") and not counts.get("errors") and not counts.get("error"), counts["output"]
    assert not counts.get("skipped"), counts["output"]
    assert counts.get("passed", 0) >= 3 * len(LESSONS), counts["output"]


@pytest.mark.slow
def test_every_check_skips_without_an_answer():
    """The committed answer files are stubs: every check skips (a check that passes on a stub cannot fail)."""
    counts = run_checks()
    assert set(counts) == {"skipped", "output"}, counts["output"]
    assert counts["skipped"] >= 3 * len(LESSONS)
