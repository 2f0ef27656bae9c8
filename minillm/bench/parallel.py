"""Suite `parallel`: one process against the same model split over ranks (lesson 20), each step predicted first.

The order is the cost model's (lesson cost-model): probe, predict, then measure.

    1. probe     the machine's constants (`measure_machine`, quick) and one gloo all-reduce among 2 and
                 3 processes at several sizes (`measure_allreduce_seconds`): the latency every
                 collective of a sharded step waits
    2. predict   each configuration's eager float32 decode step (`sharded_decode_step`): 1/ranks of the
                 weights per rank, 2 all-reduces per block and 3 more per step; once with every rank on
                 this machine's one memory bus (what it can measure) and once as if each had its own
                 (what tensor parallelism is for: more memory and bandwidth than one device has)
    3. measure   whole command-line processes, as a user runs them, alternating: the default model
                 (9 heads, 3 key/value heads) alone and over 3 ranks; unless --quick, Gemma 3 270M
                 alone and over 2 ranks (its one key/value head repeated); greedy, eager float32, the
                 decode rate each process reports for itself (rank 0 decodes what all ranks compute)

    python -m minillm.bench parallel            # 64 new tokens, both models, 3 rounds
    python -m minillm.bench parallel --quick    # 16 new tokens, the default model, 1 round
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from ..costmodel.model import decode_step, predict, sharded_decode_step
from ..costmodel.probes import measure_allreduce_seconds, measure_machine
from ..model.checkpoint import config_from_hf
from ..model.loading import resolve_checkpoint_folder
from .common import alternate, finish_figure, median, plot_title
from .processes import timed_process

PROMPT = "The history of the printing press begins in the fifteenth century, when"
MODELS = {"default": (1, 3), "gemma3-270m": (1, 2)}  # model: the rank counts its heads allow (and one process)


def command(model: str, ranks: int, new_tokens: int) -> list[str]:
    return [sys.executable, "-m", "minillm.infer", "--model", model, "--prompt", PROMPT, "--no-chat", "--greedy",
            "--max-new-tokens", str(new_tokens), "--eager", "--stats", "--tp", str(ranks)]


def model_config(model: str):
    folder = resolve_checkpoint_folder(model)
    return config_from_hf(json.loads((folder / "config.json").read_text()))


def run(args) -> dict:
    quick = args.quick
    new_tokens, repeats = (16, 1) if quick else (64, args.repeats)
    models = {"default": MODELS["default"]} if quick else MODELS
    machine = measure_machine(quick=True)
    groups = sorted({ranks for counts in models.values() for ranks in counts if ranks > 1})
    allreduce = {ranks: measure_allreduce_seconds(ranks, bursts=3 if quick else 5) for ranks in groups}
    machine = replace(machine, allreduce=allreduce)
    context = 32 + new_tokens  # the prompt and what is generated after it, about
    predictions = {}
    for model, counts in models.items():  # before anything is measured
        config = model_config(model)
        for ranks in counts:
            one_bus = (decode_step(config, context=context) if ranks == 1
                       else sharded_decode_step(config, ranks, memory_buses=1, context=context))
            own_buses = sharded_decode_step(config, ranks, memory_buses=ranks, context=context)
            predictions[f"{model} --tp {ranks}"] = {
                "tokens_per_second": 1 / predict(one_bus, machine),
                "tokens_per_second_own_buses": 1 / predict(own_buses, machine),
                "collective_ms_per_step": 1e3 * (predict(one_bus, machine)
                                                 - predict(replace(one_bus, collectives=0), machine))}
    records = {}

    def contender(name, argv):
        def once():
            records.setdefault(name, []).append(timed_process(argv, None))
        return once

    contenders = {f"{model} --tp {ranks}": contender(f"{model} --tp {ranks}", command(model, ranks, new_tokens))
                  for model, counts in models.items() for ranks in counts}
    alternate(contenders, repeats=repeats, warmup=1, desc="whole processes")
    rows = {}
    for name, runs in records.items():
        runs = runs[1:]  # the warm-up round
        rates = [r["decode_tokens_per_second"] for r in runs]
        rows[name] = {**predictions[name], "measured_tokens_per_second": median(rates),
                      "measured_tokens_per_second_per_repeat": rates, "seconds": median([r["seconds"] for r in runs]),
                      "text": runs[-1]["text"]}
    for model, counts in models.items():
        alone = rows[f"{model} --tp 1"]
        for ranks in counts[1:]:
            split = rows[f"{model} --tp {ranks}"]
            split["same_text_as_one_process"] = split["text"] == alone["text"]
            split["vs_one_process"] = split["measured_tokens_per_second"] / alone["measured_tokens_per_second"]
    return {"quick": quick, "prompt": PROMPT, "new_tokens": new_tokens, "repeats": repeats, "model": "default",
            "threads": torch.get_num_threads(),
            "allreduce_us": {str(ranks): {str(size): seconds * 1e6 for size, seconds in curve}
                             for ranks, curve in allreduce.items()},
            "contenders": rows}


def plot(data: dict, path) -> None:
    import matplotlib.pyplot as plt

    rows = data["contenders"]
    names = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    y = range(len(names))
    left.barh([i - 0.2 for i in y], [rows[n]["measured_tokens_per_second"] for n in names], height=0.4,
              color="tab:green", label="measured")
    left.barh([i + 0.2 for i in y], [rows[n]["tokens_per_second"] for n in names], height=0.4, color="lightgray",
              label="predicted first (one memory bus)")
    left.set_yticks(list(y), names)
    left.invert_yaxis()
    left.set_xlabel("decode tokens per second (eager float32)")
    left.legend(fontsize=8)
    for ranks, curve in data["allreduce_us"].items():
        sizes = sorted(curve, key=int)
        right.plot([int(s) for s in sizes], [curve[s] for s in sizes], marker="o", label=f"{ranks} ranks")
    right.set_xscale("log")
    right.set_xlabel("bytes all-reduced (gloo, this machine)")
    right.set_ylabel("µs per all-reduce")
    right.legend(fontsize=8)
    fig.suptitle(plot_title("One process against ranks (tensor parallelism)", data, "float32"), fontsize=10)
    finish_figure(fig, path)


__all__ = ["plot", "run"]
