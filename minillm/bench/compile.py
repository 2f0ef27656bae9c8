"""Suite `compile`: the model run op by op, as compiled graphs, and as exported ONNX graphs (lesson 15).

Contenders, alternating in one run on the same weights and prompt (EOS off, so all
produce exactly `new_tokens` tokens, greedy):

    minillm eager        `generate()`, the model op by op (with its oneDNN swap in float32)
    minillm compiled     `generate(compile=True)`: the kept decode graph (an AOTInductor package, built
                         once, loaded before the clock starts) over the fixed-shape static cache
    onnxruntime          the exported prefill/decode graphs (`minillm.speed.export`, `minillm.speed.onnx_model`)
    transformers         `generate`, its default dynamic cache (the reference)
    llama.cpp F32        llama-cpp-python on an F32 GGUF of the same weights (float32 only,
                         when installed: `minillm.bench.llama_cpp`)

in float32 and bfloat16. Reported: decode tokens/s and its share of the memory-bandwidth
roofline (weight bytes per token times tokens/s over the read bandwidth, sampled between
the contenders in the same alternating rounds: `bandwidth_probe`), prefill time of a
`prefill_tokens` prompt, and the one-off costs: compiling (the calls that built graphs)
and exporting plus loading into onnxruntime. Without llama.cpp the JSON says why it is
missing.

    python -m minillm.bench compile            # 64 prompt + 128 new tokens, 192-token prefill
    python -m minillm.bench compile --quick    # 16 + 16, float32 only, one repeat
"""

from __future__ import annotations

import os
import re
import tempfile
import time

import torch

from ..costmodel.probes import bandwidth_probe
from ..speed.compile import compile_model
from ..speed.export import export_onnx
from ..speed.onnx_model import OnnxModel
from ..speed.step_shapes import StepShape
from ..strategies.generate import generate
from .batch import TEXT
from .common import alternate, finish_figure, median, plot_title, spread
from .decode import TokenClock
from .llama_cpp import LlamaCpp, gguf_as, missing_reason

FULL = (64, 128, 192)  # a full run's prompt tokens, new tokens, and the prefill's prompt (--quick: 16, 16, 64)
CONTEXT = 256  # the compiled step's cache length


def minillm_run(model, prompt, new_tokens, record, compile: bool):
    def run():
        out = generate(model, [prompt], max_new_tokens=new_tokens, compile=compile)  # ids, no tokenizer: no EOS
        record.append(out.token_ids[0])
        return out.stats.decode_seconds
    return run


def onnx_run(runner, prompt, new_tokens, record):
    def run():
        out = generate(runner, [prompt], max_new_tokens=new_tokens)  # ids, no tokenizer: no EOS
        record.append(out.token_ids[0])
        return out.stats.decode_seconds
    return run


def llama_cpp_run(llama: LlamaCpp, prompt, new_tokens, record):
    def run():
        seconds, tokens = llama.decode(prompt, new_tokens)
        record.append(tokens)
        return seconds
    return run


def transformers_run(hf_model, prompt, new_tokens, record):
    tokens = torch.tensor([prompt])

    def run():
        clock = TokenClock()
        out = hf_model.generate(tokens, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                streamer=clock)
        record.append(out[0, len(prompt):].tolist())
        return clock.decode_seconds()
    return run


def prefill_runs(model, runner, hf_model, llama, prompt) -> dict:
    """Time to the first token of `prompt` for each contender (one new token)."""
    runs = {"minillm eager": lambda: generate(model, [prompt], max_new_tokens=1, compile=False).stats.prefill_seconds,
            "minillm compiled": lambda: generate(model, [prompt], max_new_tokens=1,
                                                 compile=True).stats.prefill_seconds,
            "transformers": lambda: timed(lambda: hf_model(torch.tensor([prompt]), logits_to_keep=1))}
    if runner is not None:
        runs["onnxruntime"] = lambda: generate(runner, [prompt], max_new_tokens=1).stats.prefill_seconds
    if llama is not None:
        runs["llama.cpp F32"] = lambda: llama.prefill(prompt)
    return runs


def timed(fn) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        fn()
    return time.perf_counter() - start


def export_and_load(model, folder, context: int, chunk: int) -> tuple[OnnxModel | None, dict]:
    """Export and load the graphs; (None, the reason) where onnxruntime cannot run this dtype."""
    start = time.perf_counter()
    export_onnx(model, folder, context=context, chunk=chunk)
    exported = time.perf_counter()
    try:
        runner = OnnxModel(folder)
        generate(runner, [[1, 2, 3]], max_new_tokens=2)  # a kernel missing for this dtype fails here, not mid-run
    except Exception as e:  # onnxruntime's own exception types
        return None, {"export_seconds": exported - start, "unsupported": onnxruntime_reason(str(e))}
    return runner, {"export_seconds": exported - start, "load_seconds": time.perf_counter() - exported}


def onnxruntime_reason(message: str) -> str:
    """onnxruntime's own words from a runner error, without the temporary folder's path."""
    found = re.search(r"(\[ONNXRuntimeError\].*?)\): ", message)
    return " ".join((found.group(1) if found else message).split())[:300]


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ..model.loading import resolve_checkpoint_folder
    from ..speed.load import load_model

    quick = args.quick
    prompt_tokens, new_tokens, prefill_tokens = (16, 16, 64) if quick else FULL
    context, chunk = CONTEXT, 64
    repeats = 1 if quick else args.repeats
    dtypes = ("float32",) if quick else ("float32", "bfloat16")
    folder = resolve_checkpoint_folder(args.model)
    probe = bandwidth_probe(device=args.device)  # alternated with the contenders, warm-up round included
    llama_cpp = missing_reason()
    if llama_cpp is None:
        from ..speed.quant_gguf import gguf_path_for

        f32_gguf = gguf_as(gguf_path_for(args.model), "F32")

    results, bandwidths = {}, []
    for dtype in dtypes:
        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
        ids = tokenizer.encode(TEXT * 4)
        prompt = ids[:prompt_tokens]
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        hf_model.generation_config.eos_token_id = None
        # The kept decode graph, loaded (or built once) before anything is timed, as the command line does it.
        compiled = compile_model(model, kept=True)
        load_seconds = compiled.prepare([StepShape.decode(model.config, 1, prompt_tokens + new_tokens)])
        (package,) = compiled.packages.values()
        with tempfile.TemporaryDirectory() as tmp:
            runner, onnx_costs = export_and_load(model, f"{tmp}/graphs", context, chunk)
            records, contenders = {}, {}
            contenders["minillm eager"] = minillm_run(model, prompt, new_tokens,
                                                      records.setdefault("minillm eager", []), compile=False)
            contenders["minillm compiled"] = minillm_run(model, prompt, new_tokens,
                                                         records.setdefault("minillm compiled", []), compile=True)
            if runner is not None:
                contenders["onnxruntime"] = onnx_run(runner, prompt, new_tokens, records.setdefault("onnxruntime", []))
            contenders["transformers"] = transformers_run(hf_model, prompt, new_tokens,
                                                          records.setdefault("transformers", []))
            llama = None
            if llama_cpp is None and dtype == "float32":
                llama = LlamaCpp(f32_gguf, context, threads=torch.get_num_threads())
                contenders["llama.cpp F32"] = llama_cpp_run(llama, prompt, new_tokens,
                                                            records.setdefault("llama.cpp F32", []))
            contenders["memory bandwidth"] = probe
            times = alternate(contenders, repeats=repeats, warmup=1, desc=f"compile {dtype}")
            bandwidth = probe.bytes / median(times.pop("memory bandwidth"))
            prefill = alternate(prefill_runs(model, runner, hf_model, llama, ids[:prefill_tokens]),
                                repeats=repeats, warmup=1, desc=f"prefill {dtype}")
        weight_bytes = model.num_weight_bytes()
        rows = {}
        for name, seconds in times.items():
            tok_s = (new_tokens - 1) / median(seconds)
            rows[name] = {"tokens_per_second": tok_s, "ms_per_token": 1000 / tok_s,
                          "roofline_fraction": tok_s * weight_bytes / bandwidth, "decode_seconds_per_repeat": seconds,
                          "prefill_seconds": median(prefill[name]), "prefill_seconds_per_repeat": prefill[name],
                          "same_tokens_as_eager": records[name][-1] == records["minillm eager"][-1]}
        eager = rows["minillm eager"]["tokens_per_second"]
        for row in rows.values():
            row["speedup_vs_eager"] = row["tokens_per_second"] / eager
            row["speedup_vs_transformers"] = row["tokens_per_second"] / rows["transformers"]["tokens_per_second"]
        bandwidths.append(bandwidth)
        results[dtype] = {"weight_bytes": weight_bytes, "memory_bandwidth_gb_s": bandwidth / 1e9,
                          "roofline_tokens_per_second": bandwidth / weight_bytes,
                          "contenders": rows, "compile_seconds": package.build_seconds, "load_seconds": load_seconds,
                          "graphs_compiled": len(compiled.packages), "onnx": onnx_costs}
        for name, row in rows.items():
            print(f"{dtype:8s} {name:17s} {row['tokens_per_second']:6.1f} tok/s ({row['roofline_fraction']:.0%} of "
                  f"roofline, x{row['speedup_vs_eager']:.2f} vs eager), prefill {row['prefill_seconds']:.3f} s",
                  flush=True)
        print(f"{dtype:8s} compiled graph built in {package.build_seconds:.0f} s (once), loaded in "
              f"{load_seconds:.1f} s; ONNX {onnx_costs}", flush=True)
        del model, hf_model, compiled, llama

    return {"model": args.model, "quick": quick, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "prefill_tokens": prefill_tokens, "context": context, "chunk": chunk, "repeats": repeats,
            "memory_bandwidth_gb_s": median(bandwidths) / 1e9, "llama_cpp": llama_cpp,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "results": results}


COLORS = {"minillm eager": "tab:blue", "minillm compiled": "tab:green", "onnxruntime": "tab:purple",
          "transformers": "tab:orange", "llama.cpp F32": "tab:red"}


def plot(data: dict, path=None):
    """Decode tokens/s per contender and dtype (roofline dashed), prefill time, and the one-off costs."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [2, 2, 1.2]})
    names = list(COLORS)
    width = 0.8 / len(names)
    for ax, metric in zip(axes[:2], ("decode", "prefill")):
        for i, name in enumerate(names):
            xs, values, samples = [], [], []
            for x, res in enumerate(results.values()):
                row = res["contenders"].get(name)
                if row is None:
                    continue
                xs.append(x + (i - (len(names) - 1) / 2) * width)
                if metric == "decode":
                    values.append(row["tokens_per_second"])
                    samples.append([(data["new_tokens"] - 1) / s for s in row["decode_seconds_per_repeat"]])
                else:
                    values.append(1000 * row["prefill_seconds"])
                    samples.append([1000 * s for s in row["prefill_seconds_per_repeat"]])
            bars = ax.bar(xs, values, width, color=COLORS[name], label=name, yerr=spread(values, samples), capsize=3)
            if metric == "decode":
                for bar, x in zip(bars, xs):
                    res = list(results.values())[round(x)]
                    ax.annotate(f"{res['contenders'][name]['roofline_fraction']:.0%}",
                                (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2), ha="center",
                                va="center", fontsize=7, color="white", rotation=90)
        if metric == "decode":
            for x, res in enumerate(results.values()):
                ax.hlines(res["roofline_tokens_per_second"], x - 0.45, x + 0.45, colors="gray", linestyles="--")
            ax.set_ylabel("decode speed (tokens/s, batch 1, greedy)")
            ax.set_title(f"decode; dashed: roofline at {data['memory_bandwidth_gb_s']:.0f} GB/s; labels: its share")
        else:
            ax.set_ylabel(f"time to first token of a {data['prefill_tokens']}-token prompt (ms)")
            ax.set_title(f"prefill (ONNX: chunks of {data['chunk']})")
        ax.set_xticks(range(len(results)), list(results))
        ax.set_xlabel("precision")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    ax = axes[2]
    labels, costs, colors = [], [], []
    for dtype, res in results.items():
        labels += [f"compile\n{dtype}", f"export\n{dtype}"]
        costs += [res["compile_seconds"], res["onnx"]["export_seconds"]]
        colors += [COLORS["minillm compiled"], COLORS["onnxruntime"]]
    ax.bar(range(len(costs)), costs, color=colors)
    ax.set_xticks(range(len(costs)), labels, fontsize=8)
    ax.set_ylabel("one-off cost (s)")
    ax.set_title("compiling / exporting once")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(plot_title("Eager, compiled and ONNX Runtime", data, " and ".join(results)) +
                 f"\n{data['prompt_tokens']} prompt + {data['new_tokens']} new tokens, cache of {data['context']}; "
                 f"bars: median over repeats (n = {data['repeats']}), whiskers: min-max", fontsize=10)
    return finish_figure(fig, path)
