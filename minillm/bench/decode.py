"""Suite `decode`: greedy tokens per second at batch 1 (lessons 05 and 06).

At batch 1 every decoded token reads every weight once, so decode speed is bounded
by memory bandwidth: `weight bytes per token * tokens/s` can never exceed what the
machine reads per second. The suite measures that bandwidth in the same run and
reports each contender's share of the bound (the roofline).

Contenders, alternating in one run on the same weights and prompt (EOS off, so all
produce exactly `new_tokens` tokens):

    minillm static / dynamic / none   `generate(cache=...)`: the three caches of lesson 06
    minillm captured                  on a GPU: `generate(compile=True)`, the decode step compiled and
                                      captured as one CUDA graph (lesson 15), what `--compile` runs there
                                      (its one-row matmuls Inductor's reductions: `matmul_kernels`)
    minillm captured, library matmuls on a GPU, float32: the same with cuBLAS's matrix-vector products
    transformers                      `generate`, its default dynamic cache
    transformers static               `generate(cache_implementation="static")`
    llama.cpp                         with --llama-bench PATH: llama.cpp's own benchmark program on the GGUF
                                      as F32 / BF16, one process a round (`minillm.bench.llama_bench`)

in float32 and bfloat16 (lesson 05). Decode tokens/s counts the tokens after the
first one over the time after the first one, for both libraries (transformers'
streamer timestamps its tokens). Plus: prefill time of a 512-token prompt. With
`--quant int8,int4,gguf` each quantization is a section of its own (lesson 14): the model
as `--quant` loads it, eager ("minillm static") against compiled ("minillm compiled",
on a GPU "minillm captured"), and llama.cpp on the GGUF as Q8_0 (int8) or as stored
(Q4_1 for the default model: int4, gguf). On a GPU the profiler then counts each
captured step's kernels (`minillm.bench.kernels`, "kernels_per_step") before the timed
rounds, and predicts its time from the count, a probed floor per kernel and the bytes.

    python -m minillm.bench decode            # 128 prompt + 128 new tokens, 512-token prefill
    python -m minillm.bench decode --quick    # 32 + 16, 128-token prefill, float32 + minillm bf16
    python -m minillm.bench decode --device cuda --llama-bench /root/llama/build/bin/llama-bench \
        --quant int8,int4,gguf
"""

from __future__ import annotations

import time

import torch

from ..costmodel.probes import measure_graph_kernel_seconds, measure_memory_bandwidth, synchronize
from ..decoding.sampling import SamplingConfig
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from ..speed.compile import compile_model
from ..speed.quantize_model import weight_bytes
from ..strategies.generate import generate
from .batch import TEXT
from .common import alternate, finish_figure, median, plot_title, spread
from .kernels import counted_and_predicted
from .llama_bench import GGUF_TYPE, QUANTIZED, LlamaBench, llama_bench_problem
from .llama_cpp import gguf_as

FULL = (128, 128, 512)  # a full run's prompt tokens, new tokens, and the prefill's prompt (--quick: 32, 16, 128)


class TokenClock:
    """A transformers streamer noting when each new token arrives (its first call is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decode_seconds(self) -> float:
        return self.times[-1] - self.times[1]  # from the first new token to the last


def _minillm(model, prompt, new_tokens, cache, device, record, compile: bool = False):
    def run():
        # ids, no tokenizer: no EOS; eager, the model op by op, as lesson 06 measures its caches (compile:
        # the runner's compiled step, on a GPU captured as a CUDA graph, built before the first token)
        out = generate(model, [prompt], cache=cache, max_new_tokens=new_tokens, compile=compile)
        synchronize(device)
        record.append(out.token_ids[0])
        return out.stats.decode_seconds
    return run


def _transformers(hf_model, prompt, new_tokens, device, record, **generate_kwargs):
    tokens = torch.tensor([prompt], device=device)

    def run():
        clock = TokenClock()
        out = hf_model.generate(tokens, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                streamer=clock, **generate_kwargs)
        synchronize(device)
        record.append(out[0, len(prompt):].tolist())
        return clock.decode_seconds()
    return run


def _prefill(model, hf_model, prompt, device, repeats) -> dict:
    """Seconds to run a prompt through each model once, producing only the last position's logits (minillm: the
    model runner's prefill, what `generate` runs first)."""
    tokens = torch.tensor([prompt], device=device)
    runner = ModelRunner(model, max_len=len(prompt) + 1)
    seq = Sequence.create(prompt, SamplingConfig(max_new_tokens=1), vocab_size=model.config.vocab_size, device=device)

    def minillm():
        runner.prefill([seq])
        synchronize(device)

    def transformers():
        hf_model(tokens, logits_to_keep=1)
        synchronize(device)

    with torch.inference_mode():
        times = alternate({"minillm": minillm, "transformers": transformers}, repeats=repeats, warmup=1)
    return {name: median(t) for name, t in times.items()}


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ..model.loading import resolve_checkpoint_folder
    from ..speed.load import load_model
    from ..speed.quant_gguf import gguf_path_for

    quick = args.quick
    prompt_tokens, new_tokens, prefill_tokens = (32, 16, 128) if quick else FULL
    repeats = 1 if quick else args.repeats
    quants = tuple(getattr(args, "quant", ()) or ())
    folder = resolve_checkpoint_folder(args.model)
    program = getattr(args, "llama_bench", None)
    llama = llama_bench_problem(program)  # None: llama.cpp runs in these rounds
    if program is not None and llama is not None:
        raise ValueError(llama)
    bandwidth = measure_memory_bandwidth(device=args.device)
    on_gpu = torch.device(args.device).type == "cuda"
    floor = measure_graph_kernel_seconds(device=args.device) if on_gpu else None  # a captured kernel's least cost
    compiled = "minillm captured" if on_gpu else "minillm compiled"  # what --compile runs on this device

    results, prefill, kernels = {}, None, {}
    for section in ("float32", "bfloat16", *quants):
        quant = section if section in QUANTIZED else "none"
        dtype = "float32" if quant != "none" else section  # a quantized model as the command line loads it
        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device, quant=quant)
        ids = tokenizer.encode(TEXT * 2)
        prompt = ids[:prompt_tokens]
        records, contenders, captured = {}, {}, {}
        step_bytes = weight_bytes(model)  # what a decode step reads: the roofline's and the prediction's bytes

        def minillm(name, cache, runs=model, compile=False):
            contenders[name] = _minillm(runs, prompt, new_tokens, cache, args.device, records.setdefault(name, []),
                                        compile=compile)
            if compile:
                captured[name] = runs

        hf_model = None
        if quant != "none":  # eager against the compiled step, and llama.cpp on the same blocks (its file)
            minillm("minillm static", "static")
            minillm(compiled, "static", compile=True)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(args.device).eval()
            hf_model.generation_config.eos_token_id = None
            caches = ("static", "dynamic", "none") if dtype == "float32" else ("static", "dynamic")
            for cache in caches if not (quick and dtype != "float32") else ("static",):
                minillm(f"minillm {cache}", cache)
            if on_gpu:  # what `--compile --device cuda` runs: the step as one CUDA graph (in FP32 also with cuBLAS's
                minillm(compiled, "static", compile=True)  # matrix-vector products: the kernels before fusion)
                if dtype == "float32":
                    minillm(f"{compiled}, library matmuls", "static", compile_model(model, matmuls="library"), True)
            if not (quick and dtype != "float32"):
                contenders["transformers"] = _transformers(hf_model, prompt, new_tokens, args.device,
                                                           records.setdefault("transformers", []))
                contenders["transformers static"] = _transformers(hf_model, prompt, new_tokens, args.device,
                                                                  records.setdefault("transformers static", []),
                                                                  cache_implementation="static")
        if llama is None:  # the same weights in llama.cpp's file of this precision (quantized: Q8_0, or as stored)
            source = gguf_path_for(args.model)
            gguf = gguf_as(source, GGUF_TYPE[section]) if section in GGUF_TYPE else source
            contenders["llama.cpp"] = LlamaBench(program, gguf, prompt_tokens, new_tokens, args.device,
                                                 torch.get_num_threads())
        if on_gpu:  # each captured step's kernels counted first, and its time predicted from the count alone
            kernels[section] = {name: counted_and_predicted(runs, prompt, floor, step_bytes, bandwidth)
                                for name, runs in captured.items()}
        times = alternate(contenders, repeats=repeats, warmup=1, desc=f"decode {section}")
        results[section] = section_rows(section, times, records, step_bytes, bandwidth, new_tokens)
        for name, counted in kernels.get(section, {}).items():
            if "error" in counted:
                print(f"{section:8s} {name:34s} kernels not counted: {counted['error']}", flush=True)
                continue
            counted["measured_ms"] = results[section]["contenders"][name]["ms_per_token"]
            print(f"{section:8s} {name:34s} {counted['kernels']} kernels: predicted {counted['predicted_ms']:.3f} "
                  f"ms a token, measured {counted['measured_ms']:.3f}", flush=True)
        if dtype == "float32" and quant == "none":
            prefill = _prefill(model, hf_model, ids[:prefill_tokens], args.device, repeats)
            print(f"prefill {prefill_tokens} tokens: minillm {prefill['minillm']:.3f} s, "
                  f"transformers {prefill['transformers']:.3f} s", flush=True)
        del model, hf_model

    return {"model": args.model, "quick": quick, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "repeats": repeats, "llama_cpp": llama, "memory_bandwidth_gb_s": bandwidth / 1e9, "results": results,
            **({"kernels_per_step": kernels} if kernels else {}),
            "prefill": {"tokens": prefill_tokens, "seconds": prefill,
                        "speedup_vs_transformers": prefill["transformers"] / prefill["minillm"]}}


def section_rows(section: str, times: dict, records: dict, weight_bytes: int, bandwidth: float,
                 new_tokens: int) -> dict:
    """One section's table: each contender's tokens/s, ms a token, share of the roofline and ratio to transformers
    (where it ran), and which contenders chose the tokens eager minillm's static cache did."""
    rows = {}
    for name, seconds in times.items():
        tok_s = (new_tokens - 1) / median(seconds)
        rows[name] = {"tokens_per_second": tok_s, "ms_per_token": 1000 / tok_s,
                      "roofline_fraction": tok_s * weight_bytes / bandwidth, "decode_seconds_per_repeat": seconds}
    if "transformers" in rows:
        best = max(rows[r]["tokens_per_second"] for r in rows if r.startswith("transformers"))
        for row in rows.values():
            row["speedup_vs_transformers"] = row["tokens_per_second"] / rows["transformers"]["tokens_per_second"]
            row["speedup_vs_best_transformers"] = row["tokens_per_second"] / best
    same = {name: record[-1] == records["minillm static"][-1] for name, record in records.items()}
    for name, row in rows.items():
        extra = f", x{row['speedup_vs_transformers']:.2f} vs transformers" if "transformers" in rows else ""
        print(f"{section:8s} {name:34s} {row['tokens_per_second']:6.1f} tok/s, "
              f"{row['roofline_fraction']:.0%} of roofline{extra}", flush=True)
    return {"weight_bytes": weight_bytes, "roofline_tokens_per_second": bandwidth / weight_bytes,
            "contenders": rows, "same_tokens_as_minillm_static": same}


def plot(data: dict, path=None):
    """Bars of decode tokens/s per contender and dtype (whiskers: min-max over the repeats), roofline dashed."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["results"]), figsize=(5.5 * len(data["results"]), 4.6), squeeze=False)
    for ax, (dtype, res) in zip(axes[0], data["results"].items()):
        names = list(res["contenders"])
        speeds = [res["contenders"][n]["tokens_per_second"] for n in names]
        per_repeat = [[(data["new_tokens"] - 1) / s for s in res["contenders"][n].get("decode_seconds_per_repeat", [])]
                      for n in names]
        colors = ["tab:blue" if n.startswith("minillm") else "tab:green" if n == "llama.cpp" else "tab:orange"
                  for n in names]
        bars = ax.bar(range(len(names)), speeds, color=colors, yerr=spread(speeds, per_repeat), capsize=4)
        for bar, n in zip(bars, names):  # inside the bar, clear of the whiskers
            ax.annotate(f"{res['contenders'][n]['roofline_fraction']:.0%}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height() / 2), ha="center", va="center", fontsize=8, color="white")
        ax.axhline(res["roofline_tokens_per_second"], color="gray", ls="--",
                   label=f"roofline {res['roofline_tokens_per_second']:.0f} tok/s "
                         f"({res['weight_bytes'] / 1e6:.0f} MB at {data['memory_bandwidth_gb_s']:.0f} GB/s)")
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
        ax.set_xlabel("library and KV cache")
        ax.set_ylabel("decode speed (tokens/s, batch 1, greedy)")
        ax.set_title(dtype)
        ax.set_ylim(0, 1.2 * max(res["roofline_tokens_per_second"], *speeds))
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(plot_title("Decode speed at batch 1", data, " and ".join(data["results"])) +
                 f"\n{data['prompt_tokens']} prompt + {data['new_tokens']} new tokens; bars: median over repeats "
                 f"(n = {data['repeats']}), whiskers: min-max; labels: share of the roofline", fontsize=10)
    return finish_figure(fig, path)
