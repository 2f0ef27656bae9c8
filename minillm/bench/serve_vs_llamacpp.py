"""Suite `serve-vs-llamacpp`: lesson 13's load test against minillm's server and llama.cpp's, on one GGUF.

Every server is its own process, started as a user starts it, on the default model's
GGUF file (Q4_1 blocks) or the copy of it at full precision:

    minillm float32           python -m minillm.serve --eager          the file's weights dequantized
    minillm float32 compiled  python -m minillm.serve --compile        the same, decode steps as one compiled graph
    minillm GGUF Q4_1         python -m minillm.serve --eager --quant gguf   the file's own 4-bit blocks (lesson 14)
    llama.cpp F32             python -m llama_cpp.server --model F32   the same weights as minillm float32 (`gguf_as`)
    llama.cpp Q4_1            python -m llama_cpp.server --model GGUF  the very file

The compiled server's graph is built before any server starts (`python -m minillm.compile
--serve`, once per machine: its time is recorded, and is near zero when the package was
already on disk), so each server's start, also recorded, is a warm start.

(llama.cpp's server is llama-cpp-python's, skipped with the reason when it does not import.)
The clients are `minillm.serving.loadtest`'s streaming chat requests behind the help
desk's shared system prompt, each generating exactly `tokens` tokens, under two loads:
one client sending its requests one after another, and `clients` clients at once. Every
server is started before the first request and the loads alternate between them, round
by round after a warm-up round, so the machine's drift hits each alike; the figures are
medians over the rounds, with the machine's load average recorded beside them.

    python -m minillm.bench serve-vs-llamacpp            # 5 servers, 3 rounds: about 15 minutes on 2 cores
    python -m minillm.bench serve-vs-llamacpp --quick    # minillm float32 and llama.cpp Q4_1, 1 round
    python -m minillm.bench serve-vs-llamacpp --threads 1   # each server on one thread (a busy machine)

Both engines compute with the same number of threads (`--threads`, default torch's
count). On a machine other work keeps busy, llama.cpp's thread pool, which spins while
it waits, slows down many times over once its threads outnumber the free cores, where
PyTorch's slows down far less: there, fewer threads keep the comparison about the engines.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from contextlib import ExitStack

import torch

from ..serving.loadtest import chat_workload
from .common import alternate, finish_figure, median, plot_title, spread
from .llama_cpp import gguf_as, server_missing_reason, server_process
from .server import SLO_TPOT, SLO_TTFT, ServerProcess, child_env, load


def servers(args, quick: bool, threads: int, llama_cpp: str | None) -> dict[str, ServerProcess]:
    """The contenders, not started yet: minillm's always, llama.cpp's unless `llama_cpp` says why not."""
    from ..speed.quant_gguf import gguf_path_for

    threads_env = {"OMP_NUM_THREADS": str(threads)}  # torch's intra-op threads, as llama.cpp's --n_threads
    chosen = {"minillm float32": ServerProcess.minillm(args.model, args.device, 16, "--eager", env=threads_env),
              "minillm float32 compiled": ServerProcess.minillm(args.model, args.device, 16, "--compile",
                                                                env=threads_env)}
    if not quick:
        chosen["minillm GGUF Q4_1"] = ServerProcess.minillm(args.model, args.device, 16, "--eager", "--quant", "gguf",
                                                            env=threads_env)
    if llama_cpp is None:
        source = gguf_path_for(args.model)
        if not quick:
            chosen["llama.cpp F32"] = server_process(gguf_as(source, "F32"), threads)
        chosen["llama.cpp Q4_1"] = server_process(source, threads)
    return chosen


def run(args) -> dict:
    quick = args.quick
    tokens, clients = (16, 4) if quick else (32, 8)
    single_requests, crowd_requests = (2, 8) if quick else (4, 16)
    repeats = 1 if quick else args.repeats
    threads = args.threads or torch.get_num_threads()
    if threads < 1:
        raise ValueError(f"--threads {threads} is invalid: must be >= 1")
    fixed = ((tokens, tokens), (tokens, tokens), 0.0)
    workloads = {"1 client": (chat_workload(single_requests, math.inf, seed=1, outputs=fixed), 1),
                 f"{clients} clients": (chat_workload(crowd_requests, math.inf, seed=2, outputs=fixed), clients)}
    llama_cpp, load_before = server_missing_reason(), os.getloadavg()[0]
    build = build_server_graph(args.model)
    chosen = servers(args, quick, threads, llama_cpp)
    rounds: dict[str, dict[str, list[dict]]] = {name: {label: [] for label in workloads} for name in chosen}

    def contender(name: str, server: ServerProcess):
        def one_round():
            for label, (workload, concurrency) in workloads.items():
                rounds[name][label].append(load(server, workload, concurrency, desc=f"{name}, {label}"))
        return one_round

    with ExitStack() as running:
        for server in chosen.values():  # all up before the first request: every round meets the same machine
            running.enter_context(server)
        alternate({name: contender(name, server) for name, server in chosen.items()}, repeats=repeats, warmup=1,
                  desc="servers under load")
    rows = {name: {label: summary(runs[1:]) for label, runs in by_load.items()}  # the warm-up round dropped
            for name, by_load in rounds.items()}
    for name, row in rows.items():
        print(f"{name:18s} " + ", ".join(f"{label} {row[label]['tokens_per_second']:.1f} tok/s" for label in row),
              flush=True)
    return {"model": args.model, "quick": quick, "tokens_per_request": tokens, "clients": clients,
            "requests": {label: len(workload) for label, (workload, _) in workloads.items()}, "repeats": repeats,
            "threads": threads, "slo": {"ttft": SLO_TTFT, "tpot": SLO_TPOT}, "llama_cpp": llama_cpp,
            "load_average": {"before": load_before, "after": os.getloadavg()[0]}, "contenders": rows,
            "compiled_graph": build, "ready_seconds": {name: server.ready_seconds for name, server in chosen.items()}}


def build_server_graph(model: str) -> dict:
    """`python -m minillm.compile --serve`, as a user runs it ahead of the compiled server: its wall time and its
    report (a package already on disk is only loaded)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "minillm.compile", "--serve", "--model", model], env=child_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"python -m minillm.compile --serve failed: {done.stderr.strip()[-2000:]}")
    line = done.stdout.strip().splitlines()[-1]
    print(f"server graph: {line}", flush=True)
    return {"command": f"python -m minillm.compile --serve --model {model}", "seconds": time.perf_counter() - start,
            "report": line}


def summary(runs: list[dict]) -> dict:
    """Medians over the timed rounds of one contender under one load, each round's own figures kept."""
    def quantile(metric: str, q: str) -> float | None:
        values = [run[metric][q] for run in runs if run[metric][q] is not None]
        return median(values) if values else None

    rates = [run["tokens_per_second"] for run in runs]
    return {"tokens_per_second": median(rates), "tokens_per_second_per_repeat": rates,
            "ttft_p50": quantile("ttft", "p50"), "tpot_p50": quantile("tpot", "p50"), "e2e_p99": quantile("e2e", "p99"),
            "failed": sum(run["failed"] for run in runs), "output_tokens": [run["output_tokens"] for run in runs]}


COLORS = {"minillm float32": "tab:blue", "minillm float32 compiled": "tab:purple", "minillm GGUF Q4_1": "tab:cyan", "llama.cpp F32": "tab:red",
          "llama.cpp Q4_1": "tab:orange"}


def plot(data: dict, path) -> None:
    """Output tokens/s of each server under each load (the spread over rounds), and each one's TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["contenders"]
    names, loads = list(rows), list(next(iter(rows.values())))
    fig, (ax_rate, ax_tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(loads))]
        rates = [rows[name][label]["tokens_per_second"] for label in loads]
        samples = [rows[name][label]["tokens_per_second_per_repeat"] for label in loads]
        ax_rate.bar(xs, rates, width, label=name, color=COLORS.get(name), yerr=spread(rates, samples), capsize=3)
        ax_tpot.bar(xs, [1000 * (rows[name][label]["tpot_p50"] or math.nan) for label in loads], width, label=name,
                    color=COLORS.get(name))
    for ax, label in ((ax_rate, "aggregate output tokens / s"), (ax_tpot, "time per output token, median (ms)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))], loads)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    ax_rate.legend(fontsize=8)
    fig.suptitle(plot_title("minillm's server and llama.cpp's under the same load", data, "float32 and Q4_1") +
                 f"\nstreaming chat requests over loopback, {data['tokens_per_request']} tokens each; "
                 f"{data['threads']} thread{'s' if data['threads'] > 1 else ''} per server", fontsize=10)
    finish_figure(fig, path)
