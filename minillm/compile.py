"""`python -m minillm.compile`: build the compiled decode graphs ahead of time, so every later run loads them.

The graphs are AOTInductor packages kept under $MINILLM_HOME (`minillm.speed.graph_store`),
one per model, quantization and batch size, each serving every cache length up to the model's
context (the length is symbolic in the package), and with --serve the server engine's one decode
step over its paged cache. `python -m minillm.infer`,
`generate` and the server use one whenever it is already built for their run. A CPU's: on a
GPU the runner records its step as a CUDA graph in each run instead (`minillm.speed.cuda_graph`).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .base.commands import OneLineParser, add_model_flags, add_quant_flag, run_command

# The verify graph the default build adds beside the decode graph: the command line's speculative defaults draft
# up to 7 tokens (`python -m minillm.infer --speculative`), verified with the newest in one forward. One graph
# serves every shorter draft (padded to it). Measured through kept graphs on the 2-core AMD EPYC with AVX-512: a
# 4-token verify 20.9 ms, 8 tokens 26.0, 9 33 (the generated matmul kernels run 8 rows, then the ninth alone), 16
# 44.6, a decode step 13.5; since the generated kernels prefetch their weight rows, 8 tokens 23.3 ms against a
# decode step's 8.0 (`minillm.speed.inductor.weights_prefetched`).
DEFAULT_VERIFY_TOKENS = 8

EPILOG = """examples:
  python -m minillm.compile                                # the default model, batch 1, runs of any length, and
                                                           # the verify graph of speculative decoding's defaults
  python -m minillm.compile --quant gguf                   # the same, on the GGUF's own 4-bit blocks
  python -m minillm.compile --batch-size 1 --batch-size 8  # batch 1 and batch 8
  python -m minillm.compile --serve                         # the server's decode step (python -m minillm.serve)
  python -m minillm.compile --list                          # what is built, and how big
"""


def compile_command(args, rows: int, num_draft_tokens: int | None) -> str:
    """The exact `python -m minillm.compile` command that builds the graphs this run looked for (`rows` decoded
    together; with `num_draft_tokens`, speculative decoding's verify graph too)."""
    flags = [(flag, value) for flag, value, default in (("--model", args.model, "default"),
                                                        ("--dtype", args.dtype, "float32"),
                                                        ("--quant", args.quant, "none"),
                                                        ("--batch-size", rows, 1))
             if value != default]
    if num_draft_tokens is not None:
        flags.append(("--verify-tokens", num_draft_tokens + 1))
    return " ".join(["python -m minillm.compile", *(f"{flag} {shlex.quote(str(value))}" for flag, value in flags)])


def eager_path_hint(extra: dict, build: str) -> str | None:
    """What a run that could have used kept graphs says when some of it ran eagerly (its stats' `extra`: the graph
    that ran, a damaged package, drafts verified eagerly), naming `build`, the command that builds what it lacked;
    None when everything ran compiled."""
    eager_verify = extra.get("verify_graph") == "eager"
    if extra.get("graph") != "eager" and not eager_verify:
        return None
    if damaged := extra.get("kept_problem"):
        return (f"minillm: {'verified drafts' if eager_verify else 'decoded'} eagerly: the kept compiled graph "
                f"{damaged}, so it was not loaded; `{build}` builds it again")
    if eager_verify:
        return (f"minillm: decoded through the kept graph, verified drafts eagerly: `{build}` builds the verify "
                "graph once, and later runs verify faster")
    return (f"minillm: decoded eagerly: `{build}` builds the compiled graphs once, and later runs load them in "
            "seconds and decode faster")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillm.compile", description="Build the compiled decode graph of a model "
                      "(lesson 15) and keep it on disk: 40 s to three minutes per graph on two cores, once; "
                      "later runs of python -m minillm.infer, generate() and the server load it in seconds.",
                      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, model_help="the model, as for python -m minillm.infer (default: SmolLM2-135M-Instruct)",
                    dtype_help="weights and compute precision: float32 (default), bfloat16 or float16")
    add_quant_flag(p)
    p.add_argument("--batch-size", type=int, action="append", metavar="N",
                   help="rows decoded together (repeatable; default 1: one prompt, as the CLI runs it)")
    p.add_argument("--verify-tokens", type=int, action="append", metavar="N",
                   help="the verify graphs to build for speculative decoding: N = the most tokens drafted per round "
                        f"+ 1 (default {DEFAULT_VERIFY_TOKENS}: the defaults of every --speculative drafter use it); "
                        "repeatable")
    p.add_argument("--serve", action="store_true",
                   help="build the server's step instead (python -m minillm.serve's engine: every request decoding "
                        "one token over the paged KV cache, any number of requests and lengths in one graph)")
    p.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="with --serve: the KV cache's block size the server runs with (default 16, the server's)")
    p.add_argument("--list", action="store_true", help="list the graphs built so far, and exit")
    return p


def list_graphs() -> int:
    from .base.files import minillm_home
    from .speed.graph_store import entry_problem, package_bytes

    folders = sorted((minillm_home() / "graphs").glob("*/"))
    for folder in folders:
        size = f"{package_bytes(folder) / 1e6:.0f} MB"
        print(f"{folder.name}  {size}  {entry_problem(folder) or 'ok'}")
    print(f"{len(folders)} graph(s) in {minillm_home() / 'graphs'}")
    return 0


def run(args) -> int:
    if args.list:
        return list_graphs()
    batches, verify = args.batch_size or [1], args.verify_tokens or [DEFAULT_VERIFY_TOKENS]
    if args.serve and (args.batch_size or args.verify_tokens):
        raise ValueError("--serve builds the one server step, whose rows and lengths are not fixed: drop "
                         "--batch-size and --verify-tokens")
    for flag, values, least in (("--batch-size", batches, 1), ("--verify-tokens", verify, 2),
                                ("--block-size", [args.block_size], 1)):
        if min(values) < least:
            raise ValueError(f"{flag} {min(values)} is invalid: must be >= {least}")
    if args.quant == "none" and args.device.startswith("cuda"):
        from .model.loading import resolve_device

        resolve_device(args.device)  # a GPU this machine lacks is named first, as by every command
        raise ValueError("nothing is kept for a GPU: there `python -m minillm.infer --device cuda --compile` compiles "
                         "the decode step and records it as a CUDA graph in the run (lesson 15)")
    from .speed.compile import compile_model
    from .speed.load import load_model
    from .speed.step_shapes import PagedShape, StepShape

    # Only built, never decoded here: the model's copy into huge pages (a second on two cores) would serve nothing.
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant, defer_huge_pages=True)
    if args.serve:
        shapes = [PagedShape(args.block_size)]
    else:
        # Every cache length in one package: the length symbolic (measured as fast as a package built for one).
        shapes = {StepShape.decode(model.config, b, None).any_length() for b in batches}
        # Speculative decoding runs one prompt: its verify graphs are built for batch 1 only.
        shapes |= {StepShape.verify(model.config, 1, t, None).any_length() for t in verify}
        shapes = sorted(shapes, key=lambda s: (s.batch, s.tokens))
    compiled = compile_model(model, kept=True)
    for shape in shapes:
        seconds = compiled.prepare([shape])
        folder = compiled.packages[shape].folder
        print(f"{shape.name}: ready in {seconds:.1f} s ({folder})")
    write_bytecode()
    return 0


def write_bytecode() -> None:
    """Byte-compile the package's modules once, as pip does when it installs a package. A clone run where
    PYTHONDONTWRITEBYTECODE is set (as on the course's machines) would otherwise compile its hundred-odd modules from
    source at every start: 0.17 s of a one-shot run on the 2-core AMD EPYC. Python checks each file's stamp against
    its source, so an edited module is compiled afresh; a package folder that cannot be written is left as it is."""
    import compileall
    from pathlib import Path

    compileall.compile_dir(Path(__file__).parent, quiet=2)


def main(argv=None) -> int:
    return run_command(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
