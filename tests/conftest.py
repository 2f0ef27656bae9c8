"""Shared fixtures: tiny random models (fast, exact references) and the real default model."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from minillm.model.tiny import TINY_KINDS, tiny_pair

# Under pytest-xdist (pytest.ini runs two workers) each worker computes with its share of the cores, and so do
# the notebook kernels and command lines it starts (OMP_NUM_THREADS): two workers each running every core's
# OpenMP team would oversubscribe the cores, and a team whose threads wait on a descheduled sibling crawls.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Property tests draw the same examples on every run (CI must not turn red by chance); set
# HYPOTHESIS_PROFILE=explore to let hypothesis search new examples locally.
settings.register_profile("repeatable", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


# Markers follow from what a test uses, so a new test is marked without anyone remembering to:
#   real_model  loads a real model (SmolLM2-135M-Instruct or Gemma 3 270M, through their fixtures)
#   notebook    executes a notebook top to bottom (`run_notebook`)
#   slow        either of those, or marked by hand: `python -m pytest -m "not slow"` is the quick half
#   gpu         needs CUDA; skipped with a reason where there is none
REAL_MODEL_FIXTURES = {"default_model", "reference_default_model", "gemma"}  # gemma: Gemma 3 270M (test_17)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
        if "run_notebook" in fixtures:
            item.add_marker(pytest.mark.notebook)
        if item.get_closest_marker("real_model") or item.get_closest_marker("notebook"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)"))


def _return_freed_memory() -> None:
    """Collect cycles and hand the C heap's free pages back to the system (glibc's malloc keeps them otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test (its module fixtures gone), free what it held before the next file runs.

    Two workers each hold what their files loaded (real models, notebook kernels), on a 24 GiB machine:
    memory a finished file keeps counts against the next file of both, and once a worker was killed
    for it (the suite then waited on its replacement to the CI's limit)."""
    result = yield
    if (nextitem is None or nextitem.path != item.path) and _resident_bytes() > 1 << 30:
        _return_freed_memory()
    return result


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere, where nothing is handed back)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@pytest.fixture(params=TINY_KINDS)
def tiny_kind(request) -> str:
    return request.param


@pytest.fixture
def tiny(tiny_kind):
    """(transformers model, minillm model) with identical random weights, for each tiny architecture."""
    return tiny_pair(tiny_kind)


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct in float32, loaded once per test session: (model, tokenizer)."""
    from minillm import load_model

    return load_model("default", dtype="float32")


@pytest.fixture(scope="session")
def reference_default_model():
    """transformers' LlamaForCausalLM holding the same dequantized weights as `default_model`."""
    from transformers import AutoModelForCausalLM

    from minillm.model.loading import resolve_checkpoint_folder

    return AutoModelForCausalLM.from_pretrained(resolve_checkpoint_folder("default"), dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_notebook():
    """Execute notebooks/<name> top to bottom in a fresh kernel; a failing cell fails the test.

    `timeout` bounds each cell (seconds). Returns the executed notebook. A cell that quotes results/
    (its metadata names them under `quotes`) must print again exactly what it stored: a number edited
    by hand, or a results file re-measured without re-running the notebook, fails here.
    """
    import nbformat
    from nbclient import NotebookClient

    def printed(cell) -> str:
        """What the cell printed and returned as text; displayed figures depend on the plotting backend."""
        return "".join(output.get("text", "") + output.get("data", {}).get("text/plain", "")
                       for output in cell.get("outputs", []) if output["output_type"] != "display_data")

    def run(name: str, timeout: int = 300, folder: Path = ROOT / "notebooks"):
        nb = nbformat.read(folder / name, as_version=4)
        stored = {index: printed(cell) for index, cell in enumerate(nb.cells) if cell.metadata.get("quotes")}
        env_path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env_path if env_path else "")
        os.environ.setdefault("MPLBACKEND", "Agg")
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(folder)}}).execute()
        finally:
            os.environ["PYTHONPATH"] = env_path
        for index, text in stored.items():
            assert printed(nb.cells[index]) == text, (
                f"{name} cell {index} stores other numbers than results/ {nb.cells[index].metadata['quotes']} give "
                f"now: re-run the notebook (jupyter nbconvert --execute --inplace) and commit it")
        return nb

    return run
