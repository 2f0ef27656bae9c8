"""Suite `quant`: what each weight format costs in accuracy and buys in speed (lesson 14).

Accuracy: perplexity on the held-out text (`minillm.speed.quality`, ~12,000 tokens, windows of
1024), and next-token KL divergence and top-1 agreement against the float32 model, for
every swap of `minillm.speed.quantize_model` / `minillm.speed.quant_gguf` and every MX codec of `minillm.speed.mx`
(applied to the weights, computing in float32: accuracy only). The float32 model is the
GGUF's Q4_1 weights dequantized, so "float32" here already carries the file's 4-bit loss;
every variant is measured against it.

Speed: decode tokens/s at batch 1 and 8 (greedy, static cache, EOS off so every run
produces exactly `new_tokens`) and the prefill time of a 512-token prompt, contenders
alternating in one run: float32 (oneDNN, the default), bfloat16, weight-only int8,
int4 (own quantization, int8 head), the GGUF's Q4_1 blocks run natively (int8 or int4
head), dynamic int8, and at batch 1 the int8 and GGUF ones also compiled
(`generate(compile=True)`, lesson 15: Inductor's generated kernels for the quantized
matmuls); transformers float32 on the same weights as the reference, and, when
`llama-cpp-python` is installed, llama.cpp on the same GGUF (Q4_1), on its
Q8_0 requantization and on the Q4_K_M its quantizer makes (`minillm.bench.llama_cpp`), batch 1,
beside minillm running that same Q4_K_M file's blocks (`--quant gguf --model FILE`), accuracy included.

    python -m minillm.bench quant            # 128 prompt + 128 new tokens, all ~12k held-out tokens
    python -m minillm.bench quant --quick    # 32 + 16, 1024 held-out tokens, 1 repeat
"""

from __future__ import annotations

import copy

import torch

from ..costmodel.probes import measure_memory_bandwidth
from ..model.loading import resolve_checkpoint_folder
from ..speed.load import load_model
from ..speed.mx import MX_FORMATS, SHARED_MICROEXPONENT, apply_mx_to_weights, bits_per_weight
from ..speed.quality import compare_models, held_out_tokens
from ..speed.quant_gguf import gguf_path_for, use_gguf_weights
from ..speed.quantize_model import linears, quantize_model, weight_bytes
from ..strategies.generate import generate
from .batch import TEXT
from .common import COMPILED_SUFFIX, alternate, finish_figure, median, plot_title
from .llama_cpp import LlamaCpp, gguf_as, missing_reason, quantized_by_llama_cpp

BATCHES = (1, 8)
COMPILED = ("int8", "GGUF Q4_1 (int8 head)", "GGUF Q4_1 (int4 head)")  # also run compiled (lesson 15), batch 1


def params_read(model) -> int:
    """Weights a float model reads per decode step: all of them (a tied head reads the whole embedding),
    or, with an untied head, one row of the embedding. The divisor of bits per weight."""
    untied = model.lm_head.weight is not model.tok_emb.weight
    return sum(p.numel() for p in model.parameters()) - (model.tok_emb.weight.numel() - model.config.d_model
                                                        if untied else 0)


def build_variants(model, bf16_model, gguf, calibration, k_quant=None) -> dict:
    """name -> model: the variants whose speed is measured, each swap on its own copy of the float32 model;
    k_quant: a Q4_K_M file of the model (llama.cpp's quantizer's), run as stored, when there is one."""
    return {
        "float32": model,
        "bfloat16": bf16_model,
        "int8": quantize_model(copy.deepcopy(model), "int8"),
        "int4 (int8 head)": quantize_model(copy.deepcopy(model), "int4", head="int8"),
        "GGUF Q4_1 (int8 head)": use_gguf_weights(copy.deepcopy(model), gguf),
        "GGUF Q4_1 (int4 head)": use_gguf_weights(copy.deepcopy(model), gguf, head="int4"),
        "dynamic int8": quantize_model(copy.deepcopy(model), "dynamic-int8"),
        "static int8": quantize_model(copy.deepcopy(model), "static-int8", calibration_tokens=calibration),
        **({"GGUF Q4_K_M": use_gguf_weights(copy.deepcopy(model), k_quant)} if k_quant else {}),
    }


def bits_of(name: str, model, reference) -> float:
    """Average bits per weight read per decode step (MX: the format's nominal bits on every linear)."""
    if name in MX_FORMATS or name in SHARED_MICROEXPONENT:
        linear_weights = sum(m.weight.numel() for _, m in linears(reference))
        others = params_read(reference) - linear_weights
        return (linear_weights * bits_per_weight(name) + others * 32) / params_read(reference)
    return 8 * weight_bytes(model) / params_read(reference)


def _decode(model, prompts, new_tokens, compile: bool = False):
    def run():
        out = generate(model, prompts, cache="static", max_new_tokens=new_tokens, compile=compile)
        return out.stats.decode_seconds
    return run


def _transformers_decode(hf_model, prompts, new_tokens):
    tokens = torch.tensor(prompts)

    def run():
        import time

        start = time.perf_counter()
        hf_model.generate(tokens, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        hf_model.generate(tokens, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start - first  # the prefill (and first token) taken out
    return run


def _llama_cpp_decode(llama: LlamaCpp, prompt, new_tokens):
    return lambda: llama.decode(prompt, new_tokens)[0]


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    quick = args.quick
    prompt_tokens, new_tokens, prefill_tokens, held_out = (32, 16, 128, 1024) if quick else (128, 128, 512, None)
    repeats = 1 if quick else args.repeats
    model, tokenizer = load_model(args.model)
    bf16_model, _ = load_model(args.model, dtype="bfloat16")
    gguf = gguf_path_for(args.model)
    ids = tokenizer.encode(TEXT * 4)
    calibration = torch.tensor([ids[-512:]])  # not the held-out text, not the benchmark prompt
    llama_cpp = missing_reason()
    k_quant = quantized_by_llama_cpp(gguf) if llama_cpp is None else None
    variants = build_variants(model, bf16_model, gguf, calibration, k_quant)
    bandwidth = measure_memory_bandwidth()

    accuracy_variants = {name: m for name, m in variants.items() if name != "float32"}
    accuracy_variants["int4 (int4 head)"] = quantize_model(copy.deepcopy(model), "int4")
    for fmt in [*MX_FORMATS, *SHARED_MICROEXPONENT]:
        accuracy_variants[fmt] = apply_mx_to_weights(copy.deepcopy(model), fmt)
    tokens = held_out_tokens(tokenizer, held_out)
    with torch.inference_mode():
        accuracy = compare_models(accuracy_variants, model, tokens, window=1024, desc="perplexity")
    accuracy = {"float32": accuracy.pop("reference"), **accuracy}
    for name, row in accuracy.items():
        m = variants.get(name, accuracy_variants.get(name))
        row["bits_per_weight"] = bits_of(name, m, model)
        row["weight_bytes_per_token"] = weight_bytes(m) if name in variants else None
        row["perplexity_change"] = row["perplexity"] / accuracy["float32"]["perplexity"] - 1
        print(f"{name:24s} perplexity {row['perplexity']:7.3f} ({row['perplexity_change']:+.2%}), "
              f"KL {row.get('kl', 0):.4f}, top-1 {row.get('top1_agreement', 1):.1%}, "
              f"{row['bits_per_weight']:.2f} bits/weight", flush=True)
    for fmt in [*MX_FORMATS, *SHARED_MICROEXPONENT]:
        del accuracy_variants[fmt]

    folder = resolve_checkpoint_folder(args.model)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    llamas = {}
    if llama_cpp is None:
        context = prompt_tokens + new_tokens + 8
        llamas = {f"llama.cpp {kind}": LlamaCpp(path, context, threads=torch.get_num_threads())
                  for kind, path in (("Q4_1", gguf), ("Q8_0", gguf_as(gguf, "Q8_0")), ("Q4_K_M", k_quant))}
    speed = {}
    for batch in BATCHES:
        prompts = [ids[i * 7: i * 7 + prompt_tokens] for i in range(batch)]
        contenders = {name: _decode(m, prompts, new_tokens) for name, m in variants.items()}
        contenders["transformers float32"] = _transformers_decode(hf_model, prompts, new_tokens)
        if batch == 1:  # the first (warm-up) round compiles each variant's graph: about a minute each
            contenders.update({name + COMPILED_SUFFIX: _decode(variants[name], prompts, new_tokens, compile=True)
                               for name in COMPILED + ("GGUF Q4_K_M",) if name in variants})
            contenders.update({name: _llama_cpp_decode(llama, prompts[0], new_tokens) for name, llama in llamas.items()})
        with torch.inference_mode():
            times = alternate(contenders, repeats=repeats, warmup=1, desc=f"decode batch {batch}")
        speed[batch] = {}
        for name, seconds in times.items():
            tok_s = batch * (new_tokens - 1) / median(seconds)
            speed[batch][name] = {"tokens_per_second": tok_s, "seconds_per_repeat": seconds}
            print(f"batch {batch} {name:24s} {tok_s:7.1f} tok/s", flush=True)

    prompt = ids[:prefill_tokens]  # time to the first token, as generate runs it (the runner's prefill)
    prefill_contenders = {name: (lambda m=m: generate(m, [prompt], max_new_tokens=1).stats.prefill_seconds)
                          for name, m in variants.items()}
    with torch.inference_mode():
        prefill = {name: median(t) for name, t in
                   alternate(prefill_contenders, repeats=repeats, warmup=1, desc="prefill").items()}
    for name, seconds in prefill.items():
        print(f"prefill {prefill_tokens} tokens {name:24s} {seconds:.3f} s", flush=True)

    return {"model": args.model, "quick": quick, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "repeats": repeats, "held_out_tokens": accuracy["float32"]["tokens"], "window": 1024,
            "memory_bandwidth_gb_s": bandwidth / 1e9, "accuracy": accuracy,
            "decode": {str(b): rows for b, rows in speed.items()},
            "prefill": {"tokens": prefill_tokens, "seconds": prefill},
            "llama_cpp": llama_cpp or "measured: Q4_1 on the same GGUF, Q8_0 and Q4_K_M on its requantizations"}


def plot(data: dict, path=None):
    """Left: perplexity against bits per weight. Right: perplexity against decode speed at batch 1."""
    import matplotlib
    import matplotlib.ticker

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy, decode = data["accuracy"], data["decode"]["1"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, (name, row) in enumerate(accuracy.items()):
        mx = name in MX_FORMATS or name in SHARED_MICROEXPONENT
        left.scatter(row["bits_per_weight"], row["perplexity"], color="tab:purple" if mx else "tab:blue",
                     marker="s" if mx else "o")
        left.annotate(name, (row["bits_per_weight"], row["perplexity"]), fontsize=7, xytext=(4, 3 - 9 * (i % 3)),
                      textcoords="offset points")  # staggered: close points keep readable labels
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("bits per weight read per token (log scale)")
    left.set_ylabel(f"perplexity on {data['held_out_tokens']} held-out tokens (log scale)")
    left.set_title("accuracy against size (squares: MX codecs, float32 compute)", fontsize=9)
    left.grid(alpha=0.3)
    for i, (name, row) in enumerate(decode.items()):
        base = name.removesuffix(COMPILED_SUFFIX)
        if name != base and base in accuracy:  # the same weights compiled: its variant's accuracy, faster
            right.scatter(row["tokens_per_second"], accuracy[base]["perplexity"], color="tab:green", marker="D")
            right.annotate(name, (row["tokens_per_second"], accuracy[base]["perplexity"]), fontsize=7,
                           xytext=(4, -9 + 9 * (i % 3)), textcoords="offset points", color="tab:green")
            continue
        if name not in accuracy:
            right.axvline(row["tokens_per_second"], color="tab:orange", ls="--", lw=1)
            right.annotate(name, (row["tokens_per_second"], accuracy["float32"]["perplexity"]), fontsize=7,
                           rotation=90, xytext=(3, 0), textcoords="offset points", color="tab:orange")
            continue
        samples = [(data["new_tokens"] - 1) / s for s in row["seconds_per_repeat"]]
        right.errorbar(row["tokens_per_second"], accuracy[name]["perplexity"], color="tab:blue", fmt="o",
                       xerr=[[row["tokens_per_second"] - min(samples)], [max(samples) - row["tokens_per_second"]]])
        right.annotate(name, (row["tokens_per_second"], accuracy[name]["perplexity"]), fontsize=7,
                       xytext=(4, 3 - 9 * (i % 3)), textcoords="offset points")
    right.set_yscale("log")
    for ax in (left, right):  # plain numbers on the log axes, not powers of ten
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    right.set_xlabel("decode speed at batch 1 (tokens/s; whiskers: min-max over repeats)")
    right.set_ylabel("perplexity (log scale)")
    right.set_title("accuracy against speed (dashed: references; diamonds: compiled)", fontsize=9)
    right.grid(alpha=0.3)
    fig.suptitle(plot_title("Quantized weights", data, "float32 / bfloat16 / int8 / int4 / MX") +
                 f"\n{data['prompt_tokens']} prompt + {data['new_tokens']} new tokens, greedy; medians of "
                 f"{data['repeats']} repeats", fontsize=10)
    return finish_figure(fig, path)
