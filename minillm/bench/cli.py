"""`python -m minillm.bench SUITE`: the course's benchmark runner.

The protocol every suite follows (DESIGN.md): the same model, prompts and settings
for minillm and the reference (transformers, or minillm's unoptimised path);
contenders alternate within one run so that drift in the machine's speed hits
them equally; a warm-up call first; medians of several repeats, with every
repeat's time kept so plots can show the spread; results reported as ratios, with
the machine named. Each suite writes `results/<suite>.json` and
`results/<suite>.png`; every JSON records the git commit it measured (and whether
minillm/ had uncommitted changes), so a figure can always be traced to its code.

`python -m minillm.bench report` turns results/*.json into results/README.md's measured
figures (`minillm.bench.report`): they are generated, never typed.

A suite is a module in `minillm.bench` with
    run(args) -> dict        # the measurements (JSON-serialisable)
    plot(data, path) -> None # one PNG (`predict`, whose rows are drawn beside their measurements, has none)
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import shlex
import subprocess
import sys
from pathlib import Path

from ..base.commands import run_command
from ..base.jsonio import write_json
from .common import REPO, RESULTS, SUITES, machine_info
from .llama_bench import QUANTIZED


def git_stamp(repo: Path = REPO) -> dict | None:
    """The commit being measured, and whether minillm/ differs from it; None outside a git checkout.

    A figure is only as good as the code it measured: with the commit recorded, a
    result can be reproduced, and `dirty` flags figures from uncommitted code.
    """
    def git(*command) -> str:
        return subprocess.run(["git", "-C", str(repo), *command], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != repo.resolve():
            return None  # the course sits inside some other repository: its commit says nothing here
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "minillm")
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        return None
    return {"commit": commit, "dirty": bool(changed)}


def write_results(suite: str, data: dict, out_dir: Path = RESULTS) -> Path:
    """`out_dir/<suite>.json`, strict JSON (an undefined value is written as null, never NaN)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_json(out_dir / f"{suite}.json", data)


def draft_lengths(text: str) -> tuple[int, ...]:
    """`--ks 1,2,4,8` -> (1, 2, 4, 8)."""
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--ks {text!r}: expected positive integers separated by commas, "
                                         "e.g. --ks 1,2,4,8")
    return ks


def quantizations(text: str) -> tuple[str, ...]:
    """`--quant int8,gguf` -> ("int8", "gguf"): the decode suite's quantized sections."""
    chosen = tuple(text.split(","))
    if not chosen or any(q not in QUANTIZED for q in chosen) or len(set(chosen)) < len(chosen):
        raise argparse.ArgumentTypeError(f"--quant {text!r}: expected some of {', '.join(QUANTIZED)} separated by "
                                         f"commas, each once, e.g. --quant int8,gguf")
    return chosen


EXAMPLES = """examples:
  python -m minillm.bench predict                # first: the cost model's forecasts, from probes alone
  python -m minillm.bench decode --repeats 5     # measure, write results/decode.json and .png
  python -m minillm.bench speculative --ks 1,4   # fewer draft lengths: a shorter run
  python -m minillm.bench decode --quick --out /tmp/bench
  python -m minillm.bench report                 # README figures from results/*.json
  python -m minillm.bench report --check         # is the README up to date?
"""
# Options that only some commands use, and those commands: giving one elsewhere is an error, not a no-op.
OPTION_COMMANDS = {**{name: set(SUITES) for name in ("model", "device", "quick", "repeats")},
                   "ks": {"speculative"}, "drafts": {"speculative"}, "against": {"regression"},
                   "threads": {"serve-vs-llamacpp"}, "llama_bench": {"decode"}, "quant": {"decode"},
                   "readme": {"report"}, "check": {"report"}, "plots": {"report"}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("suite", choices=[*SUITES, "report"],
                   help="which benchmark to run, or `report`: rewrite the README's measured figures from the JSON")
    suite = p.add_argument_group("measuring (every suite)")
    suite.add_argument("--model", default="default", help="model name or path (default: SmolLM2-135M-Instruct)")
    suite.add_argument("--device", default="cpu", help="cpu or cuda")
    suite.add_argument("--quick", action="store_true",
                       help="a small, fast version (what the notebooks and tests run)")
    suite.add_argument("--repeats", type=int, default=3,
                       help="timed rounds per contender after one warm-up (median reported, every round kept)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder the suites write their JSON and PNG to, and `report` reads them from "
                        "(default: results/, and results/cuda/ for a suite run with --device cuda)")
    speculative = p.add_argument_group("speculative only")
    speculative.add_argument("--ks", type=draft_lengths, default=None, metavar="K,K,...",
                             help="draft lengths to measure, comma-separated (default: 1,2,4,8); "
                                  "each k adds one run per drafter and library")
    speculative.add_argument("--drafts", type=lambda text: tuple(text.split(",")), default=None,
                             metavar="SPEC,SPEC,...",
                             help="draft models, comma-separated: dtype:bfloat16 (the target in BF16), "
                                  "layers:N (its first N blocks) (default: dtype:bfloat16,layers:24; "
                                  "with --quick: dtype:bfloat16)")
    decode = p.add_argument_group("decode only")
    decode.add_argument("--llama-bench", type=Path, default=None, metavar="PATH",
                        help="llama.cpp's benchmark program (llama-bench): time llama.cpp in the same rounds, on the "
                             "GGUF as F32 and BF16, where llama-cpp-python is not built (a GPU machine: "
                             "../shared/gpu/llama_src.sh stages its source)")
    decode.add_argument("--quant", type=quantizations, default=(), metavar="Q,Q,...",
                        help="also measure these quantizations (int8, int4, gguf; comma-separated), each a section of "
                             "its own: eager and compiled (on a GPU captured) minillm, and with --llama-bench "
                             "llama.cpp on the GGUF as Q8_0 (int8) or as stored, Q4_1 (int4, gguf)")
    servers = p.add_argument_group("serve-vs-llamacpp only")
    servers.add_argument("--threads", type=int, default=None, metavar="N",
                         help="threads each server computes with (minillm through OMP_NUM_THREADS, llama.cpp through "
                              "--n_threads; default: torch's count here). On a machine other work keeps busy, "
                              "llama.cpp's spinning thread pool slows down many times over once its threads outnumber "
                              "the free cores: fewer threads keep the comparison about the engines")
    regression = p.add_argument_group("regression only")
    regression.add_argument("--against", metavar="REV", default=None,
                            help="the commit to compare this checkout with (a hash, tag or branch); both run "
                                 "alternately, each measurement in its own process")
    report = p.add_argument_group("report only")
    report.add_argument("--readme", type=Path, default=RESULTS / "README.md",
                        help="the Markdown file whose generated section to rewrite, beside the lessons' "
                             "(default: results/README.md)")
    report.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and show the difference if the README is out of date")
    report.add_argument("--plots", action="store_true",
                        help="also redraw each suite's PNG from its JSON (after changing a plot, without "
                             "measuring again)")
    return p


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, commands in OPTION_COMMANDS.items():
        if args.suite not in commands and getattr(args, name) != parser.get_default(name):
            parser.error(f"--{name} does nothing for `{args.suite}`; it applies to: {', '.join(sorted(commands))}")


def provenance(argv: list[str]) -> dict:
    """What a result needs to be traced: the command, the commit (and dirtiness) and the date."""
    stamp = git_stamp()
    if stamp is None:
        print("minillm.bench: not in a git checkout, so the results record no commit", file=sys.stderr)
    elif stamp["dirty"]:
        print("minillm.bench: minillm/ has uncommitted changes; the results are marked dirty", file=sys.stderr)
    return {"command": shlex.join(["python", "-m", "minillm.bench", *argv]), "git": stamp,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    """Run a suite (or `report`); a failure is one line on stderr, as with every `python -m minillm...` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    return run_command(parser, lambda args: run(parser, args, argv), argv)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    check_options(parser, args)
    if args.out is None:  # a GPU's figures beside the CPU's, never over them
        args.out = RESULTS / "cuda" if args.device.startswith("cuda") else RESULTS
    if args.suite == "report":
        from . import report

        return report.main(args)
    module = importlib.import_module(SUITES[args.suite])
    stamp = provenance(argv)  # before the run: the code that is measured
    data = module.run(args)
    data = {"suite": args.suite, "machine": machine_info(args.device), **stamp, **data}
    json_path = write_results(getattr(module, "RESULTS_NAME", args.suite), data, args.out)
    if not hasattr(module, "plot"):  # `predict`: its figures are drawn beside their measurements
        print(f"wrote {json_path}")
        return 0
    png_path = args.out / f"{args.suite}.png"
    module.plot(data, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0

