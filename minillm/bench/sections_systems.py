"""The README sections of the serving and speed suites (lessons 12-16): serving, servers, attention, compile, quant.

These suites compare ways of running the same model (continuous against static batching,
kernels, compiled and exported graphs, quantized weights), so their sections lead with the
ratios against the plain path and against transformers and llama.cpp, and name each
contender's cost (memory, build time, accuracy) beside its speed.
"""

from __future__ import annotations

from . import markdown as md
from .common import COMPILED_SUFFIX, model_label


def serving_section(title: str, data: dict, links: dict) -> str:
    ways = ("continuous", "continuous, compiled step", "continuous, no prefix cache", "static", "one at a time")
    header = ["request rate", *ways]
    body = []
    for row in data["rows"]:
        rate = "all at once" if row["rate"] is None else f"{row['rate']:g} req/s"
        cells = [f"{row[way]['tokens_per_second']:.1f}, {row[way]['e2e']['p99']:.1f} s" if way in row else "—"
                 for way in ways]
        body.append([rate, *md.bold_max(cells, [row[way]["tokens_per_second"] if way in row else 0 for way in ways])])
    workload = data["workload"]
    return "\n\n".join([
        md.heading(title, links,
                   f"{model_label(data['model'])}, {md.PRECISIONS.get(data['dtype'], data['dtype'])}, "
                   f"{data['requests']} requests per rate arriving as a Poisson process, each a chat prompt behind the "
                   f"same {workload['system_prompt_tokens']}-token system prompt, with long-tailed output lengths (EOS "
                   f"ignored); batch limit {data['max_batch']}, a paged pool of {data['engine']['num_blocks']} blocks "
                   f"of {data['engine']['block_size']} tokens; continuous batching eager, and with its decode "
                   "steps through the compiled paged graph kept on disk (lesson 15). Each cell: output tokens/s over "
                   "the run (first arrival to last token), then the 99th-percentile end-to-end latency of a request; "
                   "bold: the highest throughput; one at a time is measured at saturation only."),
        md.provenance(data), md.table(header, body), _serving_bullets(data)])


def _serving_bullets(data: dict) -> str:
    saturated = data["rows"][-1]
    c, no_cache, static = saturated["continuous"], saturated["continuous, no prefix cache"], saturated["static"]
    compiled = saturated["continuous, compiled step"]
    ratios = [row["throughput_vs_static"] for row in data["rows"]]
    workload, block_size = data["workload"], data["engine"]["block_size"]
    return "\n".join([
        md.bullet(f"All requests at once: continuous batching serves {md.times(saturated['throughput_vs_static'])} "
                  f"static batching's throughput (over all rates: {md.span(ratios)}x), with a p99 latency of "
                  f"{c['e2e']['p99']:.1f} s against {static['e2e']['p99']:.1f} s and a median time to first token of "
                  f"{c['ttft']['p50']:.2f} s against {static['ttft']['p50']:.2f} s."),
        md.bullet(f"With its decode steps compiled (all at once, {compiled['compiled_steps']} of its "
                  f"{compiled['forward_passes']} forward passes ran through the paged graph; the others took in a "
                  f"prompt and ran eagerly), continuous batching serves {md.times(saturated['compiled_vs_static'])} static "
                  f"batching's throughput (over all rates: {md.span([r['compiled_vs_static'] for r in data['rows']])}x)"
                  f", with a p99 latency of {compiled['e2e']['p99']:.1f} s, and "
                  f"{md.times(compiled['tokens_per_second'] / c['tokens_per_second'])} the eager engine's."),
        md.bullet(f"KV memory, what paging saves (the run without the prefix cache): "
                  f"{md.percent(no_cache['paged_used_share'])} of the slots in the blocks handed out hold keys; "
                  "reserving each request's exact final length contiguously (an oracle, the best case for "
                  "contiguous allocation; a server that reserves `max_tokens` does worse), only "
                  f"{md.percent(no_cache['contiguous_used_share'])} would (means over the steps). A request takes a "
                  "block only when its last one is full, so paging saves the reserved tail that is never written."),
        md.bullet(f"KV memory, what prefix caching saves: the requests share one copy of the system prompt's "
                  f"{workload['system_prompt_tokens'] // block_size} full blocks. At the peak, contiguous reservation "
                  f"(neither paging nor sharing) would take {c['contiguous_peak_slots']} slots; paging alone "
                  + (f"still filled the whole {no_cache['pool_slots']}-slot pool ({no_cache['preemptions']} "
                     "preemptions)" if no_cache["paged_peak_slots"] >= no_cache["pool_slots"]
                     else f"peaked at {no_cache['paged_peak_slots']} slots")
                  + f"; with sharing the pool peaked at {c['paged_peak_slots']} slots. The prefix cache served "
                  f"{md.percent(c['prefix_hit_rate'])} of the prompt tokens from blocks already computed; without it "
                  f"the same run gives {no_cache['tokens_per_second']:.1f} tok/s instead of "
                  f"{c['tokens_per_second']:.1f}."),
    ])


def attention_section(title: str, data: dict, links: dict) -> str:
    rows, names = data["rows"], ("naive", "flash", "sdpa")
    header = ["sequence length", *(str(row["length"]) for row in rows)]
    body = [*([f"{name} ms", *(md.milliseconds(row["ms"][name]) for row in rows)] for name in names),
            *([f"{name} peak MiB", *(f"{row['peak_mib'][name]:.1f}" for row in rows)] for name in names),
            ["naive / flash GFLOP", *(f"{row['cost']['naive']['flops'] / 1e9:.2f} / "
                                      f"{row['cost']['flash']['flops'] / 1e9:.2f}" for row in rows)]]
    first, last = rows[0], rows[-1]
    growth = {name: last["peak_mib"][name] / first["peak_mib"][name] for name in names}
    ms, cost = last["ms"], last["cost"]
    sweep = data["sweep"]
    best = min(sweep["tiles"], key=lambda entry: entry["ms"])
    error = max(max(row["max_abs_error_vs_sdpa"].values()) for row in rows)
    text = (f"From {first['length']} to {last['length']} tokens ({last['length'] // first['length']}x) naive "
            f"attention's peak memory grows {growth['naive']:.0f}x (it holds every score) and flash attention's "
            f"{growth['flash']:.1f}x (one tile of scores, and the output). At {last['length']} tokens naive takes "
            f"{md.times(ms['naive'] / ms['flash'])} flash's time and {md.times(ms['naive'] / ms['sdpa'])} SDPA's; "
            f"flash computes {md.percent(cost['flash']['flops'] / cost['naive']['flops'])} of naive's FLOPs (it skips "
            f"the tiles above the diagonal) and moves {md.percent(cost['flash']['bytes'] / cost['naive']['bytes'])} of "
            f"its bytes. Among flash tiles of {md.span([entry['tile'] for entry in sweep['tiles']], digits=0)} at "
            f"{sweep['length']} tokens, {best['tile']} was fastest ({md.milliseconds(best['ms'])} ms in the sweep's "
            f"own run: the same setting timed in separate runs on this shared machine can differ by half). Every "
            f"output was within {error:.0e} of SDPA's.")
    return "\n\n".join([
        md.heading(title, links,
                   f"one causal prefill through one attention layer of {model_label(data['model'])}'s shape "
                   f"({data['heads']} query heads, {data['kv_heads']} key heads, head size {data['head_dim']}), "
                   f"{md.PRECISIONS.get(data['dtype'], data['dtype'])}, batch {data['batch']}, random q, k, v, "
                   f"{data['threads']} thread; flash tiles of {data['tile']}. Peak memory counts every tensor the "
                   "call allocates (the same on any machine); "
                   "GFLOP counts the products computed."),
        md.provenance(data), md.table(header, body), md.paragraph(text)])


def server_section(title: str, data: dict, links: dict) -> str:
    c, soak = data["concurrency"], data["soak"]

    def ms(value) -> str:
        return "—" if value is None else f"{value * 1000:.0f} ms"

    header = ["load", "output tok/s", "TTFT p50 / p99", "TPOT p50 / p99", "end-to-end p99", "failed"]
    rows = []
    for label, run in (("1 client, one request at a time", c["single"]),
                       (f"{data['clients']} clients at once", c["crowd"]),
                       *((f"{r['rate']:g} req/s, Poisson", r) for r in data["rates"])):
        rows.append([label, f"{run['tokens_per_second']:.1f}", f"{ms(run['ttft']['p50'])} / {ms(run['ttft']['p99'])}",
                     f"{ms(run['tpot']['p50'])} / {ms(run['tpot']['p99'])}", f"{run['e2e']['p99']:.1f} s",
                     str(run["failed"])])
    return "\n\n".join([
        md.heading(title, links,
                   f"`python -m minillm.serve` ({model_label(data['model'])}, "
                   f"{md.PRECISIONS.get(data['dtype'], data['dtype'])}) in its own process, driven over loopback by "
                   f"`minillm.serving.loadtest`'s streaming chat clients; {data['tokens_per_request']} tokens per "
                   "request in the client rows, the lesson 12 workload (a shared system prompt, long-tailed answers) "
                   "in the rate rows. TTFT: time to first token; TPOT: time per output token after the first."),
        md.provenance(data), md.table(header, rows),
        "\n".join([
            md.bullet(f"{data['clients']} concurrent streaming clients get {md.times(c['speedup'])} the output "
                      f"throughput of one client, each waiting {ms(c['crowd']['tpot']['p50'])} per token instead of "
                      f"{ms(c['single']['tpot']['p50'])}."),
            md.bullet(f"Soak: {soak['seconds']:.0f} s of mixed traffic from {soak['clients']} clients: "
                      f"{soak['well_formed']} well-formed requests ({soak['well_formed_failed']} failed), "
                      f"{soak['abandoned']} clients hanging up mid-stream, {soak['malformed']} malformed or impossible "
                      f"requests ({soak['malformed_wrong_status']} answered other than documented); "
                      f"{soak['server_errors']} 5xx answers; afterwards {soak['requests_held_after']} requests and "
                      f"{soak['blocks_leaked']} KV blocks still held."),
        ])])


def compile_section(title: str, data: dict, links: dict) -> str:
    results = data["results"]
    names = ("minillm eager", "minillm compiled", "onnxruntime", "transformers", "llama.cpp F32")
    header = ["precision", *(f"{name} tok/s" for name in names), "compiled / eager", "compiled, share of roofline",
              "graph build s (once)", "export s"]
    rows, notes = [], []
    for dtype, res in results.items():
        c = res["contenders"]
        compiled = c["minillm compiled"]
        rows.append([md.PRECISIONS.get(dtype, dtype),
                     *(f"{c[name]['tokens_per_second']:.1f}" if name in c else "—" for name in names),
                     f"**{md.times(compiled['speedup_vs_eager'])}**", md.percent(compiled["roofline_fraction"]),
                     f"{res['compile_seconds']:.0f}", f"{res['onnx']['export_seconds']:.0f}"])
        prefill = ", ".join(f"{name} {md.milliseconds(1000 * c[name]['prefill_seconds'])}"
                            for name in names if name in c)
        notes.append(md.bullet(f"{md.PRECISIONS.get(dtype, dtype)} prefill of {data['prefill_tokens']} tokens (ms): "
                               f"{prefill}."))
        if "load_seconds" in res:
            notes.append(md.bullet(f"{md.PRECISIONS.get(dtype, dtype)} compiled graph: built once in "
                                   f"{res['compile_seconds']:.0f} s and kept on disk; preparing it in this run "
                                   f"(building it where the cache lacked it, else loading it) took "
                                   f"{res['load_seconds']:.1f} s; the `cli` suite times a warm load."))
        if "unsupported" in res["onnx"]:
            notes.append(md.bullet(f"onnxruntime's CPU provider could not run the {md.PRECISIONS.get(dtype, dtype)} "
                                   f"graphs: `{res['onnx']['unsupported']}`."))
        if "llama.cpp F32" in c:
            ratio = compiled["tokens_per_second"] / c["llama.cpp F32"]["tokens_per_second"]
            notes.append(md.bullet(f"{md.PRECISIONS.get(dtype, dtype)} minillm compiled against llama.cpp F32 on "
                                   f"the same weights: {md.times(ratio)} decode speed."))
        differing = [f"{name} ({md.PRECISIONS.get(dtype, dtype)})" for name, row in c.items()
                     if not row["same_tokens_as_eager"]]
        if differing:
            notes.append(md.bullet(f"Tokens differing from eager minillm: {', '.join(differing)} (in reduced precision "
                                   "fused kernels round differently from separate ops; in FP32 they must match)."))
    if data["llama_cpp"] is not None:
        notes.append(md.bullet(f"llama.cpp: {data['llama_cpp']}."))
    return "\n\n".join([
        md.heading(title, links,
                   f"{model_label(data['model'])}, {data['prompt_tokens']} prompt + {data['new_tokens']} new tokens, "
                   f"greedy, batch 1, decode tokens/s; every graph over a cache of {data['context']} tokens. Building "
                   "the graph and exporting are one-off costs, paid before the first token."),
        md.provenance(data), md.table(header, rows), "\n".join(notes)])


def quant_section(title: str, data: dict, links: dict) -> str:
    accuracy, decode, prefill = data["accuracy"], data["decode"], data["prefill"]["seconds"]
    batches = list(decode)
    header = ["weights", "bits/weight", "perplexity", "vs float32", "KL", "top-1",
              *(f"tok/s batch {b}" for b in batches), f"prefill {data['prefill']['tokens']} (s)"]
    rows = []
    for name, row in accuracy.items():
        speeds = [f"{decode[b][name]['tokens_per_second']:.1f}" if name in decode[b] else "—" for b in batches]
        rows.append([name, f"{row['bits_per_weight']:.2f}", f"{row['perplexity']:.2f}",
                     f"{row['perplexity_change']:+.1%}", f"{row.get('kl', 0):.4f}",
                     md.percent(row.get("top1_agreement", 1)),
                     *speeds, f"{prefill[name]:.2f}" if name in prefill else "—"])
    for name in decode[batches[0]]:
        if name not in accuracy:
            base = accuracy.get(name.removesuffix(COMPILED_SUFFIX))  # a compiled variant: its weights' accuracy
            known = ([f"{base['bits_per_weight']:.2f}", f"{base['perplexity']:.2f}",
                      f"{base['perplexity_change']:+.1%}", "", ""] if base else [""] * 5)
            rows.append([name, *known, *(f"{decode[b][name]['tokens_per_second']:.1f}" if name in decode[b]
                                         else "—" for b in batches), "—"])
    speed = {name: row["tokens_per_second"] for name, row in decode["1"].items()}
    fastest = max((n for n in speed if n.removesuffix(COMPILED_SUFFIX) in accuracy), key=speed.get)
    notes = [md.bullet(f"Fastest at batch 1: {fastest}, {md.times(speed[fastest] / speed['float32'])} float32, "
                       f"perplexity {accuracy[fastest.removesuffix(COMPILED_SUFFIX)]['perplexity_change']:+.1%}.")]
    # The shipped file's format is Q4_1 blocks with a Q8_0 embedding, which the tied head reads: "int8 head"
    # is the same bits llama.cpp runs, "int4 head" fewer.
    for variant, theirs in (("GGUF Q4_1 (int8 head)", "llama.cpp Q4_1"), ("GGUF Q4_1 (int4 head)", "llama.cpp Q4_1"),
                            ("int8", "llama.cpp Q8_0")):
        ours = variant + COMPILED_SUFFIX
        if ours in speed and theirs in speed:
            notes.append(md.bullet(f"{ours} against {theirs}: {md.times(speed[ours] / speed[theirs])}."))
    notes.append(md.bullet(f"llama.cpp: {data['llama_cpp']}."))
    return md.section(title, links,
                      f"{model_label(data['model'])}, perplexity on {data['held_out_tokens']} held-out tokens (windows "
                      f"of {data['window']}), KL and top-1 agreement against float32; decode tokens/s at "
                      f"{data['prompt_tokens']} prompt + {data['new_tokens']} new tokens, greedy. MX rows are codecs "
                      "applied to the weights (float32 compute: accuracy only).", data, header, rows, notes)


LLAMA_REFERENCE = {"none": "llama.cpp F32", "int8": "llama.cpp Q8_0", "gguf": "llama.cpp Q4_1",
                   "q4_k_m": "llama.cpp Q4_K_M"}


def cli_section(title: str, data: dict, links: dict) -> str:
    rows = data["contenders"]
    header = ["process", "path that ran", "start to first text (s)", "prefill (s)", "whole run (s)",
              "decode tok/s (spread)", "decode vs llama.cpp"]
    body = []
    speculative = {name: row for name, row in rows.items() if name.startswith("speculative")}
    rows = {name: row for name, row in rows.items() if name not in speculative}
    for name, row in rows.items():
        quant = next((q for q in ("int8", "gguf", "q4_k_m") if f" {q} " in name), "none")
        reference = LLAMA_REFERENCE[quant]
        if "long-prompt" in name:  # the long prompt's rows against llama.cpp's on the same prompt
            reference = reference.replace("llama.cpp", "llama.cpp long-prompt")
        reference = rows.get(reference) if name.startswith("minillm") else None
        ratio = (md.times(row["decode_tokens_per_second"] / reference["decode_tokens_per_second"])
                 if reference else "—")
        prefill = "—" if row.get("prefill_seconds") is None else f"{row['prefill_seconds']:.2f}"
        body.append([name, row["path"] or "llama.cpp", f"{row['first_text_seconds']:.2f}", prefill,
                     f"{row['seconds']:.2f}", f"{row['decode_tokens_per_second']:.1f} "
                     f"({md.span(row['decode_tokens_per_second_per_repeat'], 1)})", ratio])
    builds = ", ".join(f"{'float32' if q == 'none' else q} {s:.0f} s" for q, s in data["first_build_seconds"].items())
    graphs = ("the decode graph and the verify graph of speculative decoding's defaults"  # runs since the default
              if data.get("speculative_prompts") else "the decode graph")  # build added the verify graph
    notes = [md.bullet(f"First build of the compiled graphs (`python -m minillm.compile`, the whole process, in an "
                       f"empty cache: {graphs}): {builds}. Later runs load them; none builds them again.")]
    for name, row in rows.items():
        if "same_text_as_eager" in row:
            same = "the same text as" if row["same_text_as_eager"] else "text differing from"
            notes.append(md.bullet(f"{name}: {same} its eager run."))
    if "torch_import_seconds" in data:  # runs since the suite timed torch's import beside the contenders
        floor = data["torch_import_seconds"]
        beyond = ", ".join(f"{name.removeprefix('minillm ')} {row['first_text_seconds'] - floor:.2f} s"
                           for name, row in rows.items() if name.startswith("minillm") and name.endswith("compiled"))
        notes.append(md.bullet(f"A process that only imports torch took {floor:.2f} s "
                               f"({md.span(data['torch_import_seconds_per_repeat'])} s) in the same rounds: the "
                               f"floor under every minillm start. The first text came that much later in the compiled "
                               f"runs: {beyond}. llama.cpp's processes import no torch."))
    long, llama_long = rows.get("minillm long-prompt compiled"), rows.get("llama.cpp long-prompt F32")
    if long and llama_long:
        ours, theirs = long.get("prefill_seconds"), llama_long.get("prefill_seconds")  # None before processes said
        prefills = (f"; its prefill (each process's own time from the prompt to the first token, the model loaded) "
                    f"{ours:.2f} s against {theirs:.2f} s, {md.times(theirs / ours)} llama.cpp's rate"
                    if ours and theirs else "")
        notes.append(md.bullet(f"The long prompt (the batch suite's paragraph three times, about 800 tokens): start "
                               f"to first text {long['first_text_seconds']:.2f} s compiled against llama.cpp F32's "
                               f"{llama_long['first_text_seconds']:.2f} s{prefills}."))
    if speculative:
        notes.append(speculative_table(speculative, data["speculative_prompts"]))
    if data["llama_cpp"] is not None:
        notes.append(md.bullet(f"llama.cpp: {data['llama_cpp']}."))
    return md.section(title, links,
                      f"{model_label(data['model'])}, each contender a fresh process as a user starts it: the prompt "
                      f"\"{data['prompt'][:40]}...\" (raw text, greedy), {data['new_tokens']} new tokens at most; "
                      f"medians of {data['repeats']} rounds after a warm-up, contenders alternating. Decode tok/s is "
                      "each process's own report (after its first token), and so is prefill (from its prompt to "
                      "its first token); the other times are wall clock from the start.",
                      data, header, body, notes)


def speculative_table(rows: dict, prompts: dict) -> str:
    """The cli suite's speculative rows: each strategy's decode rate against plain decoding's on the same prompt."""
    body = []
    for name, row in rows.items():
        _, task, strategy = name.split(" ", 2)
        vs_plain = row.get("decode_vs_plain")
        body.append([task, strategy, f"{row['decode_tokens_per_second']:.1f} "
                     f"({md.span(row['decode_tokens_per_second_per_repeat'], 1)})", f"{row['seconds']:.2f}",
                     "—" if vs_plain is None else md.times(vs_plain),
                     f"{row['tokens_per_target_forward']:.2f}" if "tokens_per_target_forward" in row else "1",
                     "—" if "same_text_as_plain" not in row else "yes" if row["same_text_as_plain"] else "NO"])
    said = "; ".join(f'{task}: "{prompt[:60]}..."' for task, prompt in prompts.items())
    lead = (f"Speculative decoding on the default path (float32, the kept decode and verify graphs, each strategy's "
            f"defaults), chat prompts ({said}):")
    return "\n" + "\n\n".join([md.paragraph(lead),
                        md.table(["prompt", "strategy", "decode tok/s (spread)", "whole run (s)", "decode vs plain",
                                  "tokens per target forward", "same text as plain"], body)])


SAME_WEIGHTS = {"minillm float32": "llama.cpp F32", "minillm float32 compiled": "llama.cpp F32",
                "minillm GGUF Q4_1": "llama.cpp Q4_1"}  # serve-vs-llamacpp


def serve_vs_llamacpp_section(title: str, data: dict, links: dict) -> str:
    rows = data["contenders"]
    loads = list(next(iter(rows.values())))
    single, crowd = loads[0], loads[-1]

    def ms(seconds) -> str:
        return "—" if seconds is None else md.milliseconds(1000 * seconds)

    header = ["server", *(f"{label}: tok/s, TTFT p50 ms, TPOT p50 ms" for label in loads),
              f"{crowd} / {single}", "vs llama.cpp on the same weights"]
    body = []
    for name, row in rows.items():
        theirs = rows.get(SAME_WEIGHTS.get(name))
        against = (" / ".join(md.times(row[label]["tokens_per_second"] / theirs[label]["tokens_per_second"])
                              for label in loads) if theirs else "—")
        body.append([name, *(f"{row[label]['tokens_per_second']:.1f}, {ms(row[label]['ttft_p50'])}, "
                             f"{ms(row[label]['tpot_p50'])}" for label in loads),
                     md.times(row[crowd]["tokens_per_second"] / row[single]["tokens_per_second"]), against])
    notes = []
    if "llama.cpp Q4_1" in rows:
        llama = rows["llama.cpp Q4_1"]
        notes.append(md.bullet(
            f"llama-cpp-python's server runs one request at a time (the next waits for the running one; "
            f"`--interrupt_requests False`, else it would cut the running stream short), so {crowd} give llama.cpp "
            f"Q4_1 {md.times(llama[crowd]['tokens_per_second'] / llama[single]['tokens_per_second'])} its "
            f"one-client throughput and each waits its turn ({ms(llama[crowd]['ttft_p50'])} ms to the first token); "
            f"minillm's engine batches them (lesson 12)."))
    failed = {name: sum(row[label]["failed"] for label in loads) for name, row in rows.items()}
    wanted = {label: data["requests"][label] * data["tokens_per_request"] for label in loads}
    short = [name for name, row in rows.items() if any(n != wanted[label] for label in loads
                                                        for n in row[label]["output_tokens"])]
    exact = (f"every server generated exactly {data['tokens_per_request']} tokens per request (EOS ignored through "
             "`ignore_eos` and `min_tokens`)" if not short else f"fewer tokens than asked for from {', '.join(short)}")
    notes.append(md.bullet(f"Failed requests: {', '.join(f'{name} {n}' for name, n in failed.items())}; {exact}."))
    if "ready_seconds" in data:
        graph = data["compiled_graph"]
        notes.append(md.bullet(
            f"Starts: `{graph['command']}` ran first ({graph['seconds']:.0f} s: {graph['report'].split(' (')[0]}; a "
            "package already on disk is only loaded), so every start is a warm one: from the process's start to its "
            "first answer, " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in data["ready_seconds"].items())
            + "."))
    cores, before = data["machine"]["cores"], data["load_average"]["before"]
    busy = ("busy: other work shared the cores, so read the ratios, which every contender met alike; absolute figures "
            "run higher on an idle machine" if before >= 1 else "otherwise idle")
    notes.append(md.bullet(f"Machine: load average {before:.1f} on {cores} cores as the run began "
                           f"({data['load_average']['after']:.1f} as it ended), {busy}."))
    if data["llama_cpp"] is not None:
        notes.append(md.bullet(f"llama.cpp: {data['llama_cpp']}."))
    return md.section(title, links,
                      f"{model_label(data['model'])}, every server its own process on the same GGUF (minillm float32 "
                      "serves its weights dequantized" + (", eagerly or (`--compile`) with its decode steps as one "
                                                          "compiled graph" if "ready_seconds" in data else "") +
                      ", `--quant gguf` its Q4_1 blocks; llama.cpp F32 the "
                      "full-precision copy, Q4_1 the file itself; llama.cpp's server is llama-cpp-python's "
                      f"`python -m llama_cpp.server`), each computing with {data['threads']} "
                      f"thread{'s' if data['threads'] > 1 else ''}, driven by lesson 13's load test: "
                      f"streaming chat requests behind one system prompt, {data['tokens_per_request']} tokens each, "
                      f"{data['requests'][single]} sent one after another, then {data['requests'][crowd]} by "
                      f"{data['clients']} clients at once; the loads alternate between the servers, round by round. "
                      "TTFT: time to first token; TPOT: time per output token after the first.",
                      data, header, body, notes)


def parallel_section(title: str, data: dict, links: dict) -> str:
    rows = data["contenders"]
    header = ["command line", "predicted tok/s (one memory bus)", "measured tok/s (spread)", "vs one process",
              "predicted collectives ms/step", "predicted tok/s, a bus per rank", "same text"]
    body = []
    for name, row in rows.items():
        measured = row["measured_tokens_per_second"]
        body.append([f"`--model {name}`", f"{row['tokens_per_second']:.1f}",
                     f"{measured:.1f} ({md.span(row['measured_tokens_per_second_per_repeat'], 1)})",
                     md.times(row["vs_one_process"]) if "vs_one_process" in row else "—",
                     f"{row['collective_ms_per_step']:.1f}", f"{row['tokens_per_second_own_buses']:.1f}",
                     "—" if "same_text_as_one_process" not in row
                     else "yes" if row["same_text_as_one_process"] else "NO"])
    curves = data["allreduce_us"]
    latency = "; ".join(f"{ranks} ranks {md.span([us / 1e3 for us in curve.values()])} ms"
                        for ranks, curve in curves.items())
    sizes = [int(size) for curve in curves.values() for size in curve]
    notes = [md.bullet(f"One gloo all-reduce on this machine, {min(sizes)} bytes to {max(sizes) // 2**20} MiB: "
                       f"{latency}. A sharded step waits in 2 of them per block and 3 more."),
             md.bullet("Every rank here shares the machine's cores and its one memory bus: splitting the weights "
                       "cannot read them faster, it can only add the collectives. Tensor parallelism pays where "
                       "each rank has memory and bandwidth of its own (GPUs, sockets) and the links are fast: the "
                       "last column prices that case with this machine's all-reduce, as a bound.")]
    models = " and ".join(dict.fromkeys(model_label(name.split(" --tp")[0]) for name in rows))
    return md.section(title, links, f"{models}, eager float32, each command a "
                      f"fresh process (`python -m minillm.infer --tp N`, greedy, {data['new_tokens']} new tokens); "
                      f"the cost model's step (`sharded_decode_step`) priced from the probes before any run, then "
                      f"medians of {data['repeats']} rounds after a warm-up, alternating.", data, header, body, notes)
