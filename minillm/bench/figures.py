"""Figures in prose: a number a sentence quotes, written from results/*.json and checked against it.

A lesson's sentence that reports a measurement holds it in a span naming where it comes from:

    ONNX Runtime decodes at <!-- figure: compile.results.float32.contenders["onnx"].tokens_per_second | .1f -->22.0<!-- /figure --> tok/s

Markdown hides the comments, so a reader sees "22.0 tok/s"; `python -m minillm.bench report` rewrites the
text between the markers from the JSON, and `tests/test_prose_figures.py` fails, naming the file and the
figure, wherever the text differs from what the JSON gives. So a figure cannot drift from its source: a
re-measured suite changes the sentence, or the check says which sentence to re-read.

The expression is a small Python expression over the results files, each a name (`cli` for results/cli.json,
`cache_scaling` for cache-scaling.json, `cuda_decode` for results/cuda/decode.json): attributes and `[...]`
read keys and list items, `.find(key=value)` picks the one row of a list whose key has that value, and
arithmetic, comparisons, `x if c else y`, `min`, `max`, `abs`, `round` and `len` combine them, so a ratio,
a difference or a word ("faster" / "slower") comes from the same numbers as the tables. After ` | ` comes a
format spec (`.1f`, `.0%`, `.2f`); without one a float prints with three significant digits.

The same spans work in lesson READMEs, the course README and results/README.md, notebook Markdown cells,
and the comments of solutions/*.py.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from ..base.jsonio import read_json

SPAN = re.compile(r"<!-- figure: (?P<expr>.+?)(?: \| (?P<spec>[^|]*?))? -->(?P<text>.*?)<!-- /figure -->",
                  re.DOTALL)
FUNCTIONS = {"min": min, "max": max, "abs": abs, "round": round, "len": len}
ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.BoolOp, ast.Attribute,
           ast.Subscript, ast.Constant, ast.Name, ast.Load, ast.Call, ast.keyword, ast.Slice, ast.Tuple,
           ast.operator, ast.unaryop, ast.cmpop, ast.boolop)


class FigureError(ValueError):
    """A span whose expression cannot be read from the results: a missing file or key, or a disallowed form."""


class Node:
    """A dict or list from a results file, read by attribute, subscript or `find`; leaves come back bare."""

    def __init__(self, value, where: str):
        self._value, self._where = value, where

    def _child(self, value, where: str):
        return Node(value, where) if isinstance(value, (dict, list)) else value

    def __getattr__(self, key: str):
        if key.startswith("_"):
            raise AttributeError(key)
        return self[key]

    def __getitem__(self, key):
        try:
            value = self._value[key]
        except (KeyError, IndexError, TypeError):
            raise FigureError(f"{self._where} has no [{key!r}]") from None
        return self._child(value, f"{self._where}[{key!r}]")

    def find(self, **match):
        rows = [row for row in self._value if all(row.get(k) == v for k, v in match.items())]
        if len(rows) != 1:
            raise FigureError(f"{self._where} has {len(rows)} rows with {match}, not one")
        return self._child(rows[0], f"{self._where}.find({match})")

    def __len__(self):
        return len(self._value)

    def __contains__(self, item) -> bool:  # `"amx_bf16" in decode.machine.cpu_flags`
        return item in self._value


def results_names(folder: Path) -> dict[str, Node]:
    """Every results file in `folder` (and a device's subfolder) under the name an expression uses."""
    names = {}
    for path in sorted(Path(folder).glob("*.json")) + sorted(Path(folder).glob("*/*.json")):
        name = path.relative_to(folder).with_suffix("").as_posix().replace("/", "_").replace("-", "_")
        names[name] = Node(read_json(path), f"results/{path.relative_to(folder).as_posix()}")
    return names


def evaluate(expr: str, names: dict[str, Node]):
    """The value of one span's expression; FigureError says what is missing or not allowed."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as error:
        raise FigureError(f"not an expression: {error.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED):
            raise FigureError(f"{type(node).__name__} is not allowed in a figure")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise FigureError(f"private name {node.attr!r}")
        if isinstance(node, ast.Name) and node.id not in names and node.id not in FUNCTIONS:
            raise FigureError(f"no results file {node.id!r} (have {', '.join(sorted(names))})")
    try:
        return eval(compile(tree, "<figure>", "eval"), {"__builtins__": {}}, {**FUNCTIONS, **names})  # noqa: S307
    except FigureError:
        raise
    except (TypeError, ZeroDivisionError, ValueError) as error:
        raise FigureError(str(error)) from None


def formatted(value, spec: str | None) -> str:
    if isinstance(value, Node):
        raise FigureError("the expression names a table, not a value")
    if spec:
        return format(value, spec)
    if isinstance(value, float):
        return format(value, ".3g")
    return str(value)


def rendered(text: str, names: dict[str, Node]) -> tuple[str, list[tuple[str, str, str]]]:
    """`text` with every span's figure rewritten, and (expression, written, from the results) where they differ."""
    differences = []

    def refill(match) -> str:
        expr, spec, written = match["expr"], match["spec"], match["text"]
        try:
            value = formatted(evaluate(expr, names), spec)
        except (FigureError, ValueError) as error:
            raise FigureError(f"figure `{expr}`: {error}") from None
        if value != written:
            differences.append((expr, written, value))
        head = match.group(0)[:match.start("text") - match.start(0)]
        return f"{head}{value}<!-- /figure -->"

    return SPAN.sub(refill, text), differences


def prose_files(root: Path) -> list[Path]:
    """Every file whose prose may quote a figure: the READMEs, the lessons, the notebooks, the solutions."""
    root = Path(root)
    return ([root / "README.md", root / "results" / "README.md"] + sorted(root.glob("lessons/*/README.md"))
            + sorted(root.glob("notebooks/*.ipynb")) + sorted(root.glob("solutions/*.py")))


def rewrite_notebook(text: str, names: dict[str, Node]) -> tuple[str, list]:
    """A notebook's JSON with its Markdown cells' spans rewritten (code cells and outputs untouched)."""
    notebook, differences = json.loads(text), []
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "<!-- figure:" not in source:
            continue
        new, found = rendered(source, names)
        differences += found
        cell["source"] = new.splitlines(keepends=True)
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", differences


def refresh(path: Path, names: dict[str, Node]) -> tuple[str, list[str], str | None]:
    """The file's text with its figures rewritten from `names`, one line per figure that differed, and the
    error of a figure that cannot be read (then nothing is rewritten)."""
    text = Path(path).read_text()
    if "<!-- figure:" not in text:
        return text, [], None
    try:
        new, differences = (rewrite_notebook if Path(path).suffix == ".ipynb" else rendered)(text, names)
    except FigureError as error:
        return text, [], f"{path}: {error}"
    return new, [f"{path}: figure `{expr}` reads {written!r}, the results give {value!r}"
                 for expr, written, value in differences], None


def stale_figures(root: Path, folder: Path) -> list[str]:
    """One line per figure in the course's prose that its results file no longer gives, or cannot give."""
    names, lines = results_names(folder), []
    for path in prose_files(root):
        if path.exists():
            _, differences, error = refresh(path, names)
            lines += differences + ([error] if error else [])
    return lines
