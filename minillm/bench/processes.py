"""Suite `cli`: whole processes as a user runs them, from start to first token to exit, beside llama.cpp's.

Every other suite times steps inside one long process. A user types a command: the process
starts, imports, loads the model, loads (or builds) its compiled graph, reads the prompt, and
then streams tokens. This suite runs exactly those commands, each in a fresh process:

    minillm eager            python -m minillm.infer --prompt P --no-chat --greedy --eager
    minillm compiled         the same without --eager: the kept decode graph, built beforehand
                             by `python -m minillm.compile` (that first build is timed too)
    ... --quant int8 / gguf  the same two, on the quantized linears (lesson 14)
    ... q4_k_m               the same two with --quant gguf on a Q4_K_M of the model that
                             llama.cpp's own quantizer makes (its K-quant and fallback blocks)
    llama.cpp F32/Q8_0/Q4_1  a process that loads the same weights with llama-cpp-python and
    /Q4_K_M                  streams the same number of tokens (skipped when not installed)
    ... long-prompt          float32 eager, compiled and llama.cpp F32 again with LONG_PROMPT
                             (about 800 tokens): the prefill, and decoding over a long cache
    speculative              float32 through the kept graphs, plain and with --speculative
                             prompt-lookup / lookahead (their defaults), on two chat prompts
                             (SPECULATIVE_PROMPTS): an open-ended one, whose answer copies little,
                             and a copy-heavy one; each strategy's decode rate against plain's

For each it records the wall time to the first streamed text and to exit, and what the process
reports for itself: the time from its prompt to its first token (the prefill, after loading) and
the decode rate after it; in the same rounds, a process that only imports torch
times the floor under every minillm start (llama.cpp's process imports no torch: `llama_child`).
The builds happen in a fresh $MINILLM_HOME (the model conversions linked in from the real
one), so the first build is a real first build.

    python -m minillm.bench cli            # 128 new tokens, every contender, 3 rounds
    python -m minillm.bench cli --quick    # 32 new tokens, float32 and llama.cpp F32 only, 1 round
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..base.files import minillm_home
from .common import REPO, alternate, finish_figure, median, plot_title, spread
from .batch import TEXT
from .llama_cpp import gguf_as, missing_reason, quantized_by_llama_cpp

PROMPT = ("The lighthouse keeper had not spoken to anyone in three weeks when the storm brought a stranger to "
          "the door. She")
LONG_PROMPT = TEXT * 3  # the batch suite's paragraph on the printing press, three times: about 800 tokens
SPECULATIVE_PROMPTS = {"open-ended": "Write a short story about a dragon who wants to learn to paint.",
                       "copy-heavy": f"Repeat this text exactly: {TEXT}"}
STRATEGIES = {"plain": [], "prompt-lookup": ["--speculative", "prompt-lookup"],
              "lookahead": ["--speculative", "lookahead"]}
STATS = re.compile(r"(\d+) decode tokens at ([\d.]+) tok/s")
PATH = re.compile(r"\[path: (\w+)")
PER_FORWARD = re.compile(r"([\d.]+) tokens per target forward")
PREFILL = re.compile(r"time to first token ([\d.]+) s")  # the process's own: from its prompt to its first token
LLAMA_CHILD = Path(__file__).with_name("llama_child.py")
# The floor under every minillm process's start: a process that only imports torch, timed in the same rounds.
TORCH_IMPORT = [sys.executable, "-c", "import torch"]


def minillm_command(quant: str, eager: bool, new_tokens: int, prompt: str = PROMPT, chat: bool = False,
                    extra: tuple = ()) -> list[str]:
    return [sys.executable, "-m", "minillm.infer", "--prompt", prompt, *([] if chat else ["--no-chat"]), "--greedy",
            "--max-new-tokens", str(new_tokens), "--quant", quant, "--stats", *(["--eager"] if eager else []),
            *extra]


def llama_command(gguf: Path, new_tokens: int, prompt: str = PROMPT) -> list[str]:
    """llama.cpp's process, started by path so that it imports neither minillm nor torch (`llama_child`)."""
    return [sys.executable, str(LLAMA_CHILD), str(gguf), str(new_tokens), prompt, str(torch.get_num_threads())]


def timed_process(command: list[str], env: dict) -> dict:
    """Run one process; wall seconds to its first streamed text and to its exit, its text and its own report."""
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    first, chunks = None, []
    while piece := child.stdout.read1(1 << 16):
        first = first or time.perf_counter()
        chunks.append(piece)
    err = child.stderr.read().decode(errors="replace")
    child.wait()
    end = time.perf_counter()
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed (exit {child.returncode}): {err.strip()[-300:]}")
    stats, path, per_forward = STATS.search(err), PATH.search(err), PER_FORWARD.search(err)
    prefill = PREFILL.search(err)
    return {"seconds": end - start, "first_text_seconds": (first or end) - start,
            "prefill_seconds": float(prefill.group(1)) if prefill else None,
            "decode_tokens": int(stats.group(1)) if stats else None,
            "decode_tokens_per_second": float(stats.group(2)) if stats else None,
            "path": path.group(1) if path else None, "text": b"".join(chunks).decode(errors="replace"),
            **({"tokens_per_target_forward": float(per_forward.group(1)),
                "verified_eagerly": "verified drafts eagerly" in err} if per_forward else {})}


def check_llama_runs(ggufs: dict[str, Path]) -> None:
    """Each llama.cpp contender once, for one token, before minutes of builds: a crash stops the suite at once,
    with its fix."""
    for kind, path in ggufs.items():
        child = subprocess.run(llama_command(path, 1), cwd=REPO, capture_output=True)
        if child.returncode < 0:
            raise RuntimeError(f"llama.cpp crashed on the {kind} file {path.name} (signal {-child.returncode}): on a "
                               f"CPU with AMX its native build does; rebuild llama-cpp-python without AMX (the flags "
                               f"are in minillm/bench/llama_cpp.py)")


def fresh_home(real: Path, into: Path) -> Path:
    """A $MINILLM_HOME holding links to the real one's model conversions and GGUF copies, and no graphs."""
    into.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name not in ("graphs", ".lock") and not entry.name.startswith("."):
            (into / entry.name).symlink_to(entry)
    return into


def run(args) -> dict:
    from ..speed.quant_gguf import gguf_path_for

    quick = args.quick
    new_tokens, repeats = (32, 1) if quick else (128, args.repeats)
    quants = ("none",) if quick else ("none", "int8", "gguf")
    llama = missing_reason()
    ggufs = {}
    if llama is None:
        source = gguf_path_for(args.model)
        ggufs = {"F32": gguf_as(source, "F32")}
        if not quick:
            ggufs.update({"Q8_0": gguf_as(source, "Q8_0"), "Q4_1": source, "Q4_K_M": quantized_by_llama_cpp(source)})
        check_llama_runs(ggufs)
    # A K-quant file of the model, run by --quant gguf as it is stored (when llama.cpp is here to make it)
    k_quant = ("--model", str(ggufs["Q4_K_M"])) if "Q4_K_M" in ggufs else None
    builds, records = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MINILLM_HOME": str(fresh_home(minillm_home(), Path(tmp) / "home")),
               "PYTHONPATH": str(REPO)}
        variants = [(quant, quant, ()) for quant in quants] + ([("q4_k_m", "gguf", k_quant)] if k_quant else [])
        for label, quant, model in variants:  # the first build of each compiled graph, as `python -m minillm.compile`
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "minillm.compile", "--quant", quant, *model], env=env, cwd=REPO,
                           check=True, capture_output=True)
            builds[label] = time.perf_counter() - start
            print(f"first build, {label}: {builds[label]:.0f} s (the whole process)", flush=True)
        contenders = {}
        for label, quant, model in variants:
            for eager in (True, False):
                name = f"minillm{'' if label == 'none' else ' ' + label} {'eager' if eager else 'compiled'}"
                contenders[name] = recorder(records, name, minillm_command(quant, eager, new_tokens, extra=model), env)
        for kind, path in ggufs.items():
            contenders[f"llama.cpp {kind}"] = recorder(records, f"llama.cpp {kind}", llama_command(path, new_tokens),
                                                       env)
        if not quick:  # a long prompt: float32 only, against llama.cpp's F32
            for eager in (True, False):
                name = f"minillm long-prompt {'eager' if eager else 'compiled'}"
                contenders[name] = recorder(records, name, minillm_command("none", eager, new_tokens, LONG_PROMPT), env)
            if "F32" in ggufs:
                contenders["llama.cpp long-prompt F32"] = recorder(records, "llama.cpp long-prompt F32",
                                                                   llama_command(ggufs["F32"], new_tokens, LONG_PROMPT),
                                                                   env)
            for task, prompt in SPECULATIVE_PROMPTS.items():  # the default path: kept decode and verify graphs
                for strategy, flags in STRATEGIES.items():
                    name = f"speculative {task} {strategy}"
                    command = minillm_command("none", False, new_tokens, prompt, chat=True, extra=tuple(flags))
                    contenders[name] = recorder(records, name, command, env)
        contenders["torch import"] = lambda: timed_process(TORCH_IMPORT, env)["seconds"]
        torch_import = alternate(contenders, repeats=repeats, warmup=1, desc="whole processes")["torch import"]
    rows = {}
    for name, runs in records.items():
        runs = runs[1:]  # the warm-up round is dropped, as `alternate` drops its time
        rates, prefills = [r["decode_tokens_per_second"] for r in runs], [r["prefill_seconds"] for r in runs]
        seconds = [r["seconds"] for r in runs]
        rows[name] = {"seconds": median(seconds), "seconds_per_repeat": seconds,
                      "first_text_seconds": median([r["first_text_seconds"] for r in runs]),
                      "prefill_seconds": None if None in prefills else median(prefills),
                      "prefill_seconds_per_repeat": prefills,
                      "decode_tokens_per_second": median(rates), "decode_tokens_per_second_per_repeat": rates,
                      "decode_tokens": runs[-1]["decode_tokens"], "path": runs[-1]["path"], "text": runs[-1]["text"],
                      **{key: runs[-1][key] for key in ("tokens_per_target_forward", "verified_eagerly")
                         if key in runs[-1]}}
    for name, row in rows.items():
        if name.startswith("minillm") and name.endswith("compiled"):
            row["same_text_as_eager"] = row["text"] == rows[name.replace("compiled", "eager")]["text"]
        if name.startswith("speculative") and not name.endswith("plain"):
            plain = rows[name.rsplit(" ", 1)[0] + " plain"]
            row["same_text_as_plain"] = row["text"] == plain["text"]
            row["decode_vs_plain"] = row["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
        print(f"{name:26s} first text {row['first_text_seconds']:5.2f} s, exit {row['seconds']:5.2f} s, decode "
              f"{row['decode_tokens_per_second']:6.1f} tok/s ({row['path'] or 'llama.cpp'})", flush=True)
    return {"model": args.model, "quick": quick, "prompt": PROMPT, "long_prompt": None if quick else LONG_PROMPT,
            "speculative_prompts": None if quick else SPECULATIVE_PROMPTS,
            "new_tokens": new_tokens, "repeats": repeats,
            "threads": torch.get_num_threads(), "llama_cpp": llama, "first_build_seconds": builds,
            "torch_import_seconds": median(torch_import), "torch_import_seconds_per_repeat": torch_import,
            "contenders": rows}


def recorder(records: dict, name: str, command: list[str], env: dict):
    def run():
        records.setdefault(name, []).append(timed_process(command, env))
    return run


COLORS = {"eager": "tab:blue", "compiled": "tab:green", "llama.cpp": "tab:red", "plain": "tab:green",
          "prompt-lookup": "tab:orange", "lookahead": "tab:purple"}


def plot(data: dict, path) -> None:
    import matplotlib.pyplot as plt

    rows = data["contenders"]
    names = list(rows)
    colors = [COLORS["llama.cpp"] if n.startswith("llama") else COLORS[n.split()[-1]] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = [rows[n]["decode_tokens_per_second"] for n in names]
    samples = [rows[n]["decode_tokens_per_second_per_repeat"] for n in names]
    left.barh(names, rates, color=colors, xerr=spread(rates, samples), capsize=3)
    left.set_xlabel("decode tokens per second (the process's own report)")
    left.invert_yaxis()
    right.barh(names, [rows[n]["first_text_seconds"] for n in names], color="lightgray", label="start to first text")
    right.barh(names, [rows[n]["seconds"] - rows[n]["first_text_seconds"] for n in names],
               left=[rows[n]["first_text_seconds"] for n in names], color=colors, label="first text to exit")
    right.set_xlabel(f"seconds, whole process ({data['new_tokens']} new tokens)")
    right.invert_yaxis()
    right.legend(fontsize=8)
    fig.suptitle(plot_title("Whole processes as a user runs them", data, "float32 and quantized"), fontsize=10)
    finish_figure(fig, path)
