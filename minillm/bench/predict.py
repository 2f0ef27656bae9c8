"""`python -m minillm.bench predict`: the cost model's forecast of every suite's figures, written before they run.

The course promises that every speed-up is predicted before it is measured. So this command measures
the machine's constants with the cost model's probes (`minillm.costmodel.probes`: read bandwidth, peak
arithmetic, one op's dispatch, one sync, the matrix library's speed at a few rows) and nothing else,
prices each figure a suite is about to measure with the cost model (`minillm.costmodel.model`), and
writes results/predictions.json: its date, commit and machine, one band for the whole course, and rows

    {lesson, what, unit, predicted, source, measured}

where `source` is the results file that will measure the row and `measured` the figure expression
(`figures.py`) that reads the measurement from it. Nothing here reads results/: the forecast cannot
lean on the run it forecasts, this one's or an earlier one's. Run the suites after it; `python -m
minillm.bench report` then writes results/predicted-vs-measured.json (`predictions.py`), each row inside
the band or shown as a miss.

The rows cover what the cost model can price from counts alone: decode and prefill (lesson 05), the
cache's gain with the context (06), batching (07), a verify forward's cost (08), compiled and quantized
steps (14, 15) and whole command-line runs (15). Acceptance rates, schedules and attention's tiles depend
on the text or the kernels' inner loops, which the model does not count, so those lessons compare their
mechanisms in their notebooks instead.
"""

from __future__ import annotations

from ..costmodel.model import SMOLLM2_135M, Machine, decode_step, predict, tokens_per_second
from ..costmodel.probes import measure_machine
from . import batch, cache_scaling, compile, decode, speculative

RESULTS_NAME = "predictions"  # results/predictions.json: the command is a verb, the file holds its rows
BAND = (0.67, 1.5)  # measured / predicted: one band for every row of the course (hi / lo = 2.24)
CLI_CONTEXT = 96  # the `cli` suite's prompt (about 30 tokens) plus half its 128 new tokens
INT8_BYTES = 1 + 4 / SMOLLM2_135M.d_model  # an int8 weight with one float32 scale per row of 576 (8.06 bits)
Q4_1_BYTES = (32 // 2 + 2 + 2) / 32  # GGUF Q4_1: 32 nibbles, a half-precision scale and minimum per block of 32


def row(lesson: str, what: str, unit: str, predicted: float, source: str, measured: str) -> dict:
    return {"lesson": lesson, "what": what, "unit": unit, "predicted": predicted, "source": source,
            "measured": measured}


def precision_rows(machine: Machine) -> list[dict]:
    """Lesson 05: one FP32 and one BF16 eager decode step, and a 512-token prefill (compute-bound)."""
    prompt, new, prefill = decode.FULL
    context = prompt + new // 2
    rows = []
    for dtype, size in (("float32", 4.0), ("bfloat16", 2.0)):
        step = decode_step(SMOLLM2_135M, context=context, bytes_per_weight=size, kv_element=size, dtype=dtype)
        rows.append(row("05", f"{dtype} decode, static cache", "tok/s", tokens_per_second(step, machine), "decode",
                        f'decode.results.{dtype}.contenders["minillm static"].tokens_per_second'))
    step = decode_step(SMOLLM2_135M, context=prefill, tokens_per_row=prefill)
    rows.append(row("05", f"float32 prefill of {prefill} tokens", "s", predict(step, machine), "decode",
                    "decode.prefill.seconds.minillm"))
    return rows


def cache_rows(machine: Machine) -> list[dict]:
    """Lesson 06: a cached step reads the weights and the cache; without a cache a step recomputes every position."""
    rows = []
    for length in cache_scaling.LENGTHS:
        for cache, name in (("static", "static cache"), ("none", "no cache")):
            step = decode_step(SMOLLM2_135M, context=length, cache=cache)
            rows.append(row("06", f"{name} step at {length} tokens", "ms", predict(step, machine) * 1e3,
                            "cache-scaling", f'cache_scaling.rows.find(length={length})["{name}"]'))
    return rows


def batch_rows(machine: Machine) -> list[dict]:
    """Lesson 07: B rows share one read of the weights; decode throughput at each batch size."""
    context = max(batch.PROMPT_LENGTHS) + batch.NEW_TOKENS // 2
    return [row("07", f"decode at batch {size}", "tok/s",
                tokens_per_second(decode_step(SMOLLM2_135M, batch=size, context=context), machine), "batch",
                f"batch.rows.find(batch={size}).minillm.decode_per_second")
            for size in batch.BATCH_SIZES]


def verify_rows(machine: Machine) -> list[dict]:
    """Lesson 08: a forward of k + 1 tokens against a one-token step, what a speculative round's verify costs."""
    context = 200  # the suite's chat prompts plus half of its new tokens, about
    one = predict(decode_step(SMOLLM2_135M, context=context), machine)
    return [row("08", f"verify {k + 1} tokens, in one-token steps", "x",
                predict(decode_step(SMOLLM2_135M, context=context, tokens_per_row=k + 1), machine) / one,
                "speculative", f'speculative.verify_cost["{k}"]')
            for k in speculative.KS]


def compiled_rows(machine: Machine) -> list[dict]:
    """Lessons 14-15: eager against the compiled graph's generated kernels, in FP32, BF16, int8 and Q4_1."""
    prompt, new, _ = compile.FULL
    context = prompt + new // 2
    rows = []
    for dtype, size, graph, name in (("float32", 4.0, "eager", "minillm eager"),
                                     ("float32", 4.0, "compiled", "minillm compiled"),
                                     ("bfloat16", 2.0, "compiled", "minillm compiled")):
        step = decode_step(SMOLLM2_135M, context=context, bytes_per_weight=size, graph=graph, dtype=dtype)
        rows.append(row("15", f"{dtype} {graph} decode", "tok/s", tokens_per_second(step, machine), "compile",
                        f'compile.results.{dtype}.contenders["{name}"].tokens_per_second'))
    for quant, kernel, size, name in (("float32", "float32", 4.0, "minillm compiled"),
                                      ("int8", "int8", INT8_BYTES, "minillm int8 compiled"),
                                      ("gguf", "int4", Q4_1_BYTES, "minillm gguf compiled")):  # Q4_1: int4 kernels
        head, head_kernel = (4.0, "float32") if quant == "float32" else (INT8_BYTES, "int8")  # an int8 head
        step = decode_step(SMOLLM2_135M, context=CLI_CONTEXT, bytes_per_weight=size, head_bytes_per_weight=head,
                           graph="compiled", dtype=kernel, head_dtype=head_kernel)
        lesson = "15" if quant == "float32" else "14"
        rows.append(row(lesson, f"command line, {quant} compiled decode", "tok/s", tokens_per_second(step, machine),
                        "cli", f'cli.contenders["{name}"].decode_tokens_per_second'))
    return rows


FORECASTS = (precision_rows, cache_rows, batch_rows, verify_rows, compiled_rows)


def forecasts(machine: Machine) -> list[dict]:
    """Every row the course predicts on `machine`, in lesson order."""
    return sorted((r for forecast in FORECASTS for r in forecast(machine)), key=lambda r: r["lesson"])


def constants(machine: Machine) -> dict:
    """The machine's constants in readable units; an attention curve is named "batch x queries"."""
    return {"bandwidth_gb_s": machine.bandwidth / 1e9, "peak_gflops": machine.peak_flops / 1e9,
            "op_us": machine.op_seconds * 1e6, "sync_us": machine.sync_seconds * 1e6,
            "linear_ns_per_byte": {dtype: {str(rows): seconds * 1e9 for rows, seconds in curve}
                                   for dtype, curve in machine.linear.items()},
            "attention_us_per_call": {f"{batch} x {queries}": {str(keys): seconds * 1e6 for keys, seconds in curve}
                                      for (batch, queries), curve in machine.attention.items()}}


def machine_of(data: dict) -> Machine:
    """The constants a predictions file was made with (for the notebooks, which re-price a step with them)."""
    c = data["machine_constants"]
    return Machine(c["bandwidth_gb_s"] * 1e9, c["peak_gflops"] * 1e9, c["op_us"] * 1e-6, c["sync_us"] * 1e-6,
                   {dtype: tuple((int(rows), ns * 1e-9) for rows, ns in curve.items())
                    for dtype, curve in c["linear_ns_per_byte"].items()},
                   {tuple(int(n) for n in name.split(" x ")): tuple((int(keys), us * 1e-6) for keys, us in curve.items())
                    for name, curve in c.get("attention_us_per_call", {}).items()})


def run(args) -> dict:
    """The suite runner's entry point: probe the machine, then forecast (nothing else is timed)."""
    machine = measure_machine(quick=args.quick)
    return {"model": args.model, "quick": args.quick, "band": list(BAND), "machine_constants": constants(machine),
            "rows": forecasts(machine)}


__all__ = ["RESULTS_NAME", "BAND", "forecasts", "constants", "machine_of", "run", "FORECASTS"]
