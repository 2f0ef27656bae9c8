"""The promise every `python -m minillm...` command keeps: a bad flag or value is one line, never a traceback."""

from __future__ import annotations

import argparse
import os
import signal
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is reported on one line (no usage dump)."""

    def error(self, message):
        self.exit(2, f"minillm: error: {message} (see --help)\n")


def add_model_flags(parser, *, model_help: str, dtype_help: str, device: bool = True) -> None:
    """--model, --device and --dtype: every command that loads a model takes them, with the same defaults
    (the default model, the CPU, float32); each command says in its own words what they mean for it."""
    parser.add_argument("--model", default="default", metavar="NAME_OR_PATH", help=model_help)
    if device:
        parser.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda' (or 'cuda:N')")
    parser.add_argument("--dtype", default="float32", help=dtype_help)


def add_quant_flag(parser) -> None:
    """--quant: quantized linears swapped in after loading (lesson 14), for every command that runs the model."""
    parser.add_argument("--quant", default="none",
                        choices=("none", "int8", "int4", "gguf", "dynamic-int8", "mxfp4"),
                        help="quantized linears (lesson 14), swapped in after loading (on a GPU: int8, int4, "
                             "gguf): 'int8' / 'int4' weights (int4 in groups of 32, the LM head int8) computing in "
                             "bfloat16, 'gguf' (the "
                             "GGUF's own Q4_1 blocks run as they are stored: the default model or a .gguf file), "
                             "'dynamic-int8' (int8 weights and activations), 'mxfp4' (a mixture of experts' experts "
                             "in MXFP4, as gpt-oss ships them); close to the float model, not identical")


def add_graph_flags(parser, *, compile_help: str) -> None:
    """--compile and --eager, one or neither: a command that decodes runs its compiled graph when one is on disk
    (neither flag), builds it first (--compile), or never uses it (--eager)."""
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument("--compile", action="store_true", help=compile_help)
    graphs.add_argument("--eager", action="store_true",
                        help="always run eager PyTorch, even when a compiled graph is on disk")


def negative_values_attached(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--temperature -inf` -> `--temperature=-inf`: argparse would read a value that starts
    with '-' (and is not a plain number) as a flag and report "expected one argument"."""
    takes_value = {option for action in parser._actions if action.nargs is None and action.option_strings
                   for option in action.option_strings}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1] not in parser._option_string_actions:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def run_command(parser: argparse.ArgumentParser, run, argv=None) -> int:
    """Parse `argv` and return `run(args)`, with every failure one line on stderr and an exit status.

    The promise of every `python -m minillm...` command (infer, serve, export, loadtest): --help
    exits 0, a bad flag or a bad value 2, Ctrl-C 130, a closed pipe (`| head`) 0 quietly, never
    a traceback (MINILLM_DEBUG=1 shows it).
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        args = parser.parse_args(negative_values_attached(parser, sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:
        return e.code
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\nminillm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # the promise: one clear line, no traceback
        if os.environ.get("MINILLM_DEBUG"):
            raise
        print(f"minillm: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2


def exit_at_once(status) -> None:
    """End a command's process with `status` (what `run_command` returned) once its output is flushed, skipping
    Python's teardown.

    Tearing down an interpreter that imported torch takes 0.6 s on the course's 2-core AMD EPYC
    (`python -c "import torch"`: 2.34 s, 1.74 s ending with `os._exit`), a tenth of a one-shot
    command line run, spent freeing what the process is about to lose anyway. Everything a command
    writes to disk is written and renamed into place before it returns, so nothing waits on it.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a reader gone, a stream closed or never open (None)
            pass
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)
