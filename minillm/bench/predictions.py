"""Predicted beside measured: the cost model's forecast for each lesson's speed-up, next to what results/ stored.

The cost model (`minillm.costmodel`, lessons/cost-model/README.md); every speed-up lesson after it shows the
model's prediction for its own change beside the stamped measurement, and states a band for
measured / predicted with the reason the two differ. This module computes those rows from
results/*.json, so a notebook's table, lesson 05's overview and tests/test_cost_model.py read
the same numbers and the same bands. Nothing here is timed.

The machine constants are those of the machine that wrote results/ (`results_machine`): each
suite's own bandwidth probe, the peak flop rate of the decode suite's prefill, and the op and
sync costs of results/cost.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..base.jsonio import read_json
from ..costmodel.model import (
    SMOLLM2_135M,
    Machine,
    Step,
    bound,
    decode_step,
    forward_flops,
    packed_step,
    predict,
    with_bytes,
)
from .common import RESULTS, machine_label
from .cost import results_machine
from .speculative import model_speedup


@dataclass(frozen=True)
class Comparison:
    """One prediction beside its measurement, and the band the lesson states for measured / predicted."""

    lesson: str
    what: str
    unit: str  # "ms" (a step's time), "s" (a whole run's), "tok/s", "x" (a speed-up or a cost relative to one step)
    predicted: float
    measured: float
    band: tuple[float, float]
    bound: str = ""  # the term that dominates the predicted step: memory, compute or overhead
    step: Step | None = field(default=None, repr=False)  # the step predicted, where a row is one step's time or speed
    machine: Machine | None = field(default=None, repr=False)  # ... and the constants it was predicted with

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted

    @property
    def measured_seconds(self) -> float:
        """The measured time of the row's step (rows in ms or tok/s only)."""
        return self.measured / 1e3 if self.unit == "ms" else self.step.tokens / self.measured

    @property
    def within(self) -> bool:
        low, high = self.band
        return low <= self.ratio <= high


def stored(name: str, results: Path = RESULTS) -> dict:
    return read_json(Path(results) / f"{name}.json")


def _machine(results: Path, bandwidth_gb_s: float | None = None) -> Machine:
    return results_machine(stored("decode", results), stored("cost", results), bandwidth_gb_s)


def _step_row(lesson: str, what: str, step, machine: Machine, measured_seconds: float, band) -> Comparison:
    return Comparison(lesson, what, "ms", predict(step, machine) * 1e3, measured_seconds * 1e3, band,
                      bound(step, machine), step, machine)


def kv_cache(results: Path) -> list[Comparison]:
    """Lesson 06. Without a cache a step recomputes every position: compute-bound, its flops at the prefill's rate
    (0.7-1.7). The cached step is memory-bound, but eager matrix-vector kernels stream the weights below the
    `torch.sum` probe's bandwidth (1.4-3x), so the cache's measured gain is 0.3-1.1 of the predicted one, the most at
    short contexts, where the recompute it saves is itself slower than predicted. The no-cache band is wide because a
    matrix multiply over more rows runs nearer the peak: one constant (the 512-token prefill's rate) predicts short
    recomputes too fast and long ones too slow."""
    data = stored("cache-scaling", results)
    machine, rows = _machine(results, data.get("memory_bandwidth_gb_s")), []  # the suite's own probe, where it has one
    for row in data["rows"]:
        length = row["length"]
        cached, uncached = (decode_step(SMOLLM2_135M, context=length, cache=c) for c in ("static", "none"))
        rows.append(_step_row("06", f"cached step at {length}", cached, machine, row["static cache"] / 1e3, (1.4, 3.0)))
        rows.append(_step_row("06", f"no cache at {length}", uncached, machine, row["no cache"] / 1e3, (0.7, 1.7)))
        rows.append(Comparison("06", f"the cache's gain at {length}", "x",
                               predict(uncached, machine) / predict(cached, machine),
                               row["no cache"] / row["static cache"], (0.3, 1.1)))
    return rows


def batching(results: Path) -> list[Comparison]:
    """Lesson 07. B rows share one read of the weights, so throughput should grow B-fold until the step's flops
    catch up with its bytes; eager batched steps reach 30-75% of the predicted throughput (the same slow
    matrix-vector kernels at small B, matrix-matrix kernels below peak at large B)."""
    machine, rows = _machine(results), []
    for row in stored("batch", results)["rows"]:
        step = decode_step(SMOLLM2_135M, batch=row["batch"], context=80)
        rows.append(Comparison("07", f"batch {row['batch']}", "tok/s", step.tokens / predict(step, machine),
                               row["minillm"]["decode_per_second"], (0.3, 0.75), bound(step, machine), step,
                               machine))
    return rows


def speculative(results: Path) -> list[Comparison]:
    """Lesson 08. A (k+1)-token verify forward reads the weights once, so it costs about one step, within 2x:
    eager kernels for a handful of rows run less efficiently than the one-row kernel (on the course's Xeon a 2- and
    3-token forward measured 1.05 and 1.10 steps, a 5- and 9-token one 1.5 and 1.7: up to three rows the matmuls go
    through MKL on weights in huge pages, from four through oneDNN's packed copies, lesson 05; on an AVX2 EPYC 1.3
    and 1.5). A round's speed-up is E / (k·c + v_k): E tokens kept (from the acceptance probability the measured
    share implies), for k draft forwards at c target steps each and one verify at v_k. From the measured c and v_k
    it predicts the measured speed-up at 0.7-1.25 of it wherever drafts are mostly accepted (a share of 0.5 or
    more); the low end is the BF16 draft's, whose rounds cost more than its c and v_k, each timed on its own, add up
    to (the round's bookkeeping and the draft's own cache)."""
    data, machine = stored("speculative", results), _machine(results)
    one = decode_step(SMOLLM2_135M, context=200)
    rows = [Comparison("08", f"verify {int(k) + 1} tokens (x one step)", "x",
                       predict(decode_step(SMOLLM2_135M, context=200, tokens_per_row=int(k) + 1), machine)
                       / predict(one, machine), cost, (0.5, 2.0))
            for k, cost in data["verify_cost"].items()]
    verify_cost = {int(k): cost for k, cost in data["verify_cost"].items()}
    for task, entry in data["tasks"].items():
        for name, by_k in entry["contenders"].items():
            for k, row in by_k.items() if name.startswith("minillm ") else ():
                if (row["acceptance_rate"] or 0.0) >= 0.5:  # null or NaN: nothing was drafted
                    predicted = model_speedup(name, int(k), row["acceptance_rate"], verify_cost,
                                              data["draft_cost_ratio"])
                    rows.append(Comparison("08", f"{name.removeprefix('minillm ')}, {task}, k={k}: speed-up", "x",
                                           predicted, row["speedup"], (0.7, 1.25)))
    return rows


def lookahead(results: Path) -> list[Comparison]:
    """Lesson 11. A round that feeds F tokens and keeps T of them should speed decoding up by T over the cost of an
    F-token forward relative to a one-token step. Measured speed-ups land at 0.45-1.3 of that: each round also
    pays Python work the model does not count (n-gram look-ups, the tree's mask), and on a CPU whose eager forward
    of 7-9 tokens costs a half to four fifths more than a one-token one (notebook 11's curve) the roofline's
    "nearly free" overstates the big trees' gain."""
    machine, rows = _machine(results), []
    one = predict(decode_step(SMOLLM2_135M, context=200), machine)
    for task, entry in stored("lookahead", results)["tasks"].items():
        for name in ("minillm prompt-lookup", "minillm lookahead (warm)"):
            row = entry["contenders"][name]
            fed = max(1, round(row["fed_per_forward"]))
            cost = predict(decode_step(SMOLLM2_135M, context=200, tokens_per_row=fed), machine) / one
            rows.append(Comparison("11", f"{name.removeprefix('minillm ')}, {task}", "x",
                                   row["tokens_per_forward"] / cost, row["speedup"], (0.45, 1.3)))
    return rows


def static_batches_seconds(prompt_lengths: list[int], output_lengths: list[int], max_batch: int,
                           machine: Machine) -> float:
    """Lesson 07's batching behind a queue, everything waiting from the start: batches of `max_batch` in arrival
    order, each a right-padded prefill, then one decode step per token of its longest answer over the rows still
    running (a finished row leaves the batch, but the batch waits for its slowest)."""
    seconds = 0.0
    for first in range(0, len(prompt_lengths), max_batch):
        prompts, outputs = prompt_lengths[first:first + max_batch], output_lengths[first:first + max_batch]
        width, batch = max(prompts), len(prompts)
        prefill = decode_step(SMOLLM2_135M, batch=batch, context=width, tokens_per_row=width)
        seconds += predict(replace(prefill, flops=batch * forward_flops(SMOLLM2_135M, width, width)), machine)
        for t in range(1, max(outputs)):
            running = sum(n > t for n in outputs)
            seconds += predict(decode_step(SMOLLM2_135M, batch=running, context=width + t), machine)
    return seconds


def engine_seconds(trace: dict, machine: Machine) -> float:
    """A continuous run's steps, each predicted from what it fed: its prompt chunks, its one-token rows and the
    keys the pool held (`packed_step`)."""
    return sum(predict(packed_step(SMOLLM2_135M, prefill, decode, len(rows) - decode, keys), machine)
               for prefill, decode, rows, keys in zip(trace["prefill_tokens"], trace["decode_tokens"],
                                                      trace["requests"], trace["slots_filled"]))


def continuous_batching(results: Path) -> list[Comparison]:
    """Lesson 12. Every request arriving at once: the engine's steps predicted one by one from what each fed, and
    static batching's from its padded prefills and its decode steps over the rows still running. Continuous batching
    wins by running fewer, fuller steps (no batch waits for its slowest row), prefix caching by feeding fewer prompt
    tokens; the model predicts both from those counts alone. Steps of mostly one-token rows take 1.5-3.5x their
    prediction, as lesson 06's cached step does (eager kernels for a few rows stream the weights well below the
    bandwidth probe); prompt-heavy steps are compute-bound and nearer it (1-2x, the chunks' gathers on top); static
    batching mixes both (1-2.5x). So the model credits the decode-heavy engine with speed eager kernels do not reach,
    and both gains come out at 0.4-1.0 of their prediction."""
    data, machine = stored("serving", results), _machine(results)
    row = next(r for r in data["rows"] if r["rate"] is None)
    cached, uncached = data["traces"]["None"], data["traces"]["None, no prefix cache"]
    static = static_batches_seconds(row["prompt_lengths"], row["output_lengths"], data["max_batch"], machine)
    continuous, recomputing = engine_seconds(cached, machine), engine_seconds(uncached, machine)
    return [
        Comparison("12", f"continuous: its {len(cached['step_seconds'])} steps", "s", continuous,
                   sum(cached["step_seconds"]), (1.5, 3.5)),
        Comparison("12", f"no prefix cache: its {len(uncached['step_seconds'])} steps", "s", recomputing,
                   sum(uncached["step_seconds"]), (1.0, 2.0)),
        Comparison("12", f"static batches of {data['max_batch']}: the whole run", "s", static,
                   row["static"]["seconds"], (1.0, 2.5)),
        Comparison("12", "continuous / static throughput", "x", static / continuous, row["throughput_vs_static"],
                   (0.4, 1.0)),
        Comparison("12", "prefix cache's gain (no cache / cache time)", "x", recomputing / continuous,
                   row["continuous, no prefix cache"]["seconds"] / row["continuous"]["seconds"], (0.4, 1.0)),
    ]


def quantization(results: Path) -> list[Comparison]:
    """Lesson 14. Fewer bytes, but arithmetic the roofline does not count: the activations stay float, so each int8
    weight is widened to float before it is multiplied (no int8 dot-product instruction applies), and compiled int8
    reaches 0.4-0.7 of the speed its bytes predict (0.64 on the course's Xeon, 0.4-0.65 on an AVX2 EPYC); Q4_1 reads
    0.70x int8's bytes but unpacks two nibbles per byte too (0.25-0.55)."""
    quant = stored("quant", results)
    machine = _machine(results, quant["memory_bandwidth_gb_s"])
    bands = {"int8": (0.4, 0.7), "GGUF Q4_1 (int8 head)": (0.25, 0.55), "GGUF Q4_1 (int4 head)": (0.25, 0.55)}
    rows = []
    for name, band in bands.items():
        step = with_bytes(decode_step(SMOLLM2_135M, context=192, graph="compiled"),
                          quant["accuracy"][name]["weight_bytes_per_token"])
        rows.append(Comparison("14", f"{name}, compiled", "tok/s", 1 / predict(step, machine),
                               quant["decode"]["1"][f"{name}, compiled"]["tokens_per_second"], band,
                               bound(step, machine), step, machine))
    return rows


def compilation(results: Path) -> list[Comparison]:
    """Lesson 15. A compiled graph calls about 240 kernels instead of 1,521 ops and its generated kernels stream the
    weights near the probe's bandwidth: 65-100% of the predicted speed, where eager runs at 30-65% (51% and 58% in the
    Xeon's last two stored runs: its Python dispatch and the probe's bandwidth swing apart with the host's load)."""
    fp32 = stored("compile", results)["results"]["float32"]
    machine = _machine(results, fp32["memory_bandwidth_gb_s"])
    rows = []
    for graph, name, band in (("eager", "minillm eager", (0.3, 0.65)), ("compiled", "minillm compiled", (0.65, 1.0))):
        step = decode_step(SMOLLM2_135M, context=192, graph=graph)
        rows.append(Comparison("15", f"float32 {graph}", "tok/s", 1 / predict(step, machine),
                               1e3 / fp32["contenders"][name]["ms_per_token"], band, bound(step, machine), step,
                               machine))
    return rows


def attention_kernels(results: Path) -> list[Comparison]:
    """Lesson 16. Flash attention does the work of the visible tiles only and never writes the L x L scores: the model
    predicts its gain over naive attention from each one's flops and bytes (`bench.attention.attention_cost`). Both
    are compute-bound at these lengths, so the predicted gain is about naive's flops over flash's. Measured, the gain
    is 0.8-3x that: the model charges naive attention four passes over the L x L scores (scores written and read,
    probabilities written and read), but eager PyTorch makes some fourteen, one or two per op (the matmul, the scale,
    the mask, the softmax's max, subtract, exp, sum and divide, p @ v), over scores that grow past the caches (2.4 MB
    at 256 tokens, past a core's 1 MiB L2; 38 MB at 1024, past the 32 MiB L3). Only the gains are compared: the
    suite times one thread against the constants' two, so each absolute time misses by more, but a ratio of two
    compute-bound times does not depend on the peak it is divided by."""
    machine, rows = _machine(results), []
    for row in stored("attention", results)["rows"]:
        naive, flash = (Step(weight_bytes=0.0, activation_bytes=row["cost"][kind]["bytes"],
                             flops=row["cost"][kind]["flops"]) for kind in ("naive", "flash"))
        rows.append(Comparison("16", f"flash's gain over naive at {row['length']} tokens", "x",
                               predict(naive, machine) / predict(flash, machine),
                               row["ms"]["naive"] / row["ms"]["flash"], (0.8, 3.0), bound(naive, machine)))
    return rows


SUITES = {"06": "cache-scaling", "07": "batch", "08": "speculative", "11": "lookahead", "12": "serving",
          "14": "quant", "15": "compile", "16": "attention"}  # each lesson's own suite; every lesson's constants also come from decode and cost


def other_machine(lesson: str, results: Path = RESULTS) -> str | None:
    """Why the lesson's prediction mixes machines, or None: its suite must have run where decode and cost ran, whose
    constants predict it (a suite awaiting its re-run on the course's machine is flagged, not compared)."""
    suites = ("decode", "cost", SUITES[lesson])
    labels = {name: machine_label(stored(name, results)["machine"]) for name in suites}
    if len(set(labels.values())) == 1:
        return None
    return (f"results/{SUITES[lesson]}.json ran on {labels[SUITES[lesson]]}, the constants' results/decode.json on "
            f"{labels['decode']} and results/cost.json on {labels['cost']}: re-run `python -m minillm.bench "
            f"{SUITES[lesson]}` on one machine with them before reading the ratios below")


LESSONS = {"06": kv_cache, "07": batching, "08": speculative, "11": lookahead, "12": continuous_batching,
           "14": quantization, "15": compilation, "16": attention_kernels}



def comparisons(lesson: str, results: Path = RESULTS) -> list[Comparison]:
    """The rows of one lesson ('06', '07', '08', '11', '12', '14', '15', '16')."""
    if lesson not in LESSONS:
        raise ValueError(f"lesson {lesson!r} has no cost-model prediction; one of {', '.join(LESSONS)}")
    return LESSONS[lesson](Path(results))


def table(rows: list[Comparison], results: Path = RESULTS) -> str:
    """The rows as a fixed-width table, the band and whether the measurement lies in it; first, for each lesson
    whose suite ran on another machine than the constants, the line saying so (its rows: "not comparable")."""
    flagged = {lesson: why for lesson in dict.fromkeys(row.lesson for row in rows)
               if (why := other_machine(lesson, results))}
    lines = [f"lesson {lesson}: {why}" for lesson, why in flagged.items()]
    lines += [f"{'lesson':6s} {'what':48s} {'bound':8s} {'predicted':>10s} {'measured':>10s} {'unit':6s} "
             f"{'measured/predicted':>18s}  band"]
    for row in rows:
        high = "inf" if math.isinf(row.band[1]) else f"{row.band[1]:.2f}"
        lines.append(f"{row.lesson:6s} {row.what:48s} {row.bound:8s} {row.predicted:10.2f} {row.measured:10.2f} "
                     f"{row.unit:6s} {row.ratio:18.2f}  {row.band[0]:.2f}-{high} "
                     f"{'not comparable' if row.lesson in flagged else 'ok' if row.within else 'OUTSIDE'}")
    return "\n".join(lines)


__all__ = ["Comparison", "comparisons", "table", "other_machine", "stored", "LESSONS", "SUITES"]
