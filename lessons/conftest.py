"""The exercise checks: `pytest lessons/NN-name` checks your answers, `--solutions` checks the worked ones.

Each lesson folder holds `exercises.py`, where you write your answers (every
function there starts as a stub raising NotImplementedError), and
`test_exercises_NN.py`, the checks. A check whose exercise is still a stub is
skipped with a line saying where to write the answer, so the course's suite
stays green before you start. `solutions/NN_name.py` holds worked answers with
the same names; `pytest lessons --solutions` runs every check against them (the
course's own suite does, in tests/test_lessons.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--solutions", action="store_true",
                     help="check the worked solutions in solutions/ instead of your answers in "
                          "lessons/*/exercises.py")


def answer_file(lesson: Path, solutions: bool) -> Path:
    """lessons/06-kv-cache -> lessons/06-kv-cache/exercises.py, or solutions/06_kv_cache.py."""
    if solutions:
        return ROOT / "solutions" / (lesson.name.replace("-", "_") + ".py")
    return lesson / "exercises.py"


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"answers_{path.parent.name}_{path.stem}".replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Answers:
    """The answers module, with each function wrapped so that a stub skips its check instead of failing it."""

    def __init__(self, module, path: Path, solutions: bool):
        self._module, self._path, self._solutions = module, path, solutions

    def __getattr__(self, name: str):
        function = getattr(self._module, name)
        relative = self._path.relative_to(ROOT)

        def attempt(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except NotImplementedError:
                if self._solutions:
                    raise AssertionError(f"{relative}: {name} is still a stub")
                pytest.skip(f"not answered yet: write `{name}` in {relative}")

        return attempt


@pytest.fixture
def answers(request) -> Answers:
    """This lesson's answers: yours (lessons/NN-name/exercises.py), or the worked ones with --solutions."""
    solutions = request.config.getoption("--solutions")
    path = answer_file(Path(request.node.path).parent, solutions)
    return Answers(load_module(path), path, solutions)
