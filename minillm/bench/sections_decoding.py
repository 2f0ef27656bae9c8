"""The README sections of the decoding suites (lessons 02-11): decode, cache-scaling, batch, speculative, lookahead.

Each `*_section(title, data, links)` turns one suite's JSON into Markdown: a heading with
links to the JSON and the plot, the provenance line, a table, and sentences whose every
figure is read from the data (`python -m minillm.bench report` assembles them).
"""

from __future__ import annotations

from ..costmodel.model import SMOLLM2_135M, forward_flops, weight_bytes
from ..model.loading import DEFAULT_ALIASES
from . import markdown as md
from .common import model_label
from .llama_bench import GGUF_TYPE


def decode_section(title: str, data: dict, links: dict) -> str:
    results = data["results"]
    names = list(dict.fromkeys(name for res in results.values() for name in res["contenders"]))
    peers = ["transformers", *(["llama.cpp"] if "llama.cpp" in names else [])]  # llama.cpp: with --llama-bench
    rows = []
    for dtype, res in results.items():
        speeds = _speeds(res)
        minillm = _fastest(speeds, "minillm")
        ratios = []
        for peer in peers:
            best = _fastest(speeds, peer)
            ratios.append(f"**{md.times(speeds[minillm] / speeds[best])}**" if minillm and best else "—")
        cells = [f"{speeds[name]:.1f}" if name in speeds else "—" for name in names]
        rows.append([md.PRECISIONS.get(dtype, dtype), *cells, *ratios])
    header = ["precision", *(_contender_label(name, results) for name in names), "best minillm / best transformers",
              *(["best minillm / llama.cpp"] if len(peers) > 1 else [])]
    return "\n\n".join([
        md.heading(title, links,
                   f"{model_label(data['model'])}, {data['prompt_tokens']} prompt + {data['new_tokens']} new tokens, "
                   f"greedy, decode tokens/s. {_same_tokens_sentence(results)}"),
        md.provenance(data), md.table(header, rows), _decode_bullets(data)])


def _speeds(res: dict) -> dict:
    return {name: row["tokens_per_second"] for name, row in res["contenders"].items()}


def _fastest(speeds: dict, library: str) -> str | None:
    """The name of the library's fastest contender, or None if it has none."""
    names = [name for name in speeds if name.startswith(library)]
    return max(names, key=speeds.get) if names else None


def _contender_label(name: str, results: dict) -> str:
    """'minillm none' -> 'minillm no cache'; 'transformers' (its default cache) -> 'transformers dynamic cache';
    'llama.cpp' -> its file in each row's precision (a quantized row's: Q8_0, or the GGUF as stored)."""
    if name == "llama.cpp":
        files = dict.fromkeys(GGUF_TYPE.get(section, "as stored") for section in results)
        return f"llama.cpp ({' / '.join(files)} file)"
    library, _, cache = name.partition(" ")
    return f"{library} {md.CACHES.get(cache or 'dynamic', cache)}"


def _same_tokens_sentence(results: dict) -> str:
    differing = [f"{name} in {md.PRECISIONS.get(dtype, dtype)}" for dtype, res in results.items()
                 for name, same in res["same_tokens_as_minillm_static"].items() if not same]
    if not differing:
        return "Every contender produced the same tokens as minillm with a static cache."
    return f"Tokens different from minillm's static cache: {', '.join(differing)}."


def _probe_spread(data: dict, share: float) -> str:
    """A sentence on how far this run's bandwidth probe is from the other suites' on the same machine, and the
    roofline share at theirs; empty when they agree within 10%."""
    own = data["memory_bandwidth_gb_s"]
    others = [gb_s for suite, gb_s in data.get("bandwidth_probes", {}).items() if suite != data["suite"]]
    if not others or all(abs(gb_s / own - 1) <= 0.1 for gb_s in others):
        return ""
    low, high = min(others), max(others)
    if round(low) == round(high):
        measured, shares = f"{high:.0f} GB/s", md.percent(share * own / high)
    else:
        measured = f"{low:.0f}-{high:.0f} GB/s"
        shares = f"{md.percent(share * own / high)}-{md.percent(share * own / low)}"
    return (f" The probe swings on this shared VM: this machine's other suites measured {measured}, at which the "
            f"same speed is {shares} of the roofline")


def _decode_bullets(data: dict) -> str:
    results, bullets = data["results"], []
    for i, (dtype, res) in enumerate(results.items()):
        speeds = _speeds(res)
        minillm, transformers = _fastest(speeds, "minillm"), _fastest(speeds, "transformers")
        text = f"{md.PRECISIONS.get(dtype, dtype)} reads {res['weight_bytes'] / 1e6:.0f} MB of weights per token. "
        text += (f"At the run's measured peak read bandwidth ({data['memory_bandwidth_gb_s']:.0f} GB/s, the fastest "
                 "`torch.sum` over a large tensor) that allows " if i == 0 else "That allows ")
        text += (f"{res['roofline_tokens_per_second']:.0f} tok/s, so minillm reaches "
                 f"**{md.percent(res['contenders'][minillm]['roofline_fraction'])} of the roofline**")
        if transformers:
            text += f" (transformers {md.percent(res['contenders'][transformers]['roofline_fraction'])})"
        if i == 0:
            text += "." + _probe_spread(data, res["contenders"][minillm]["roofline_fraction"])
        bullets.append(md.bullet(text.removesuffix(".") + "."))
    if "float32" in results and "bfloat16" in results:
        bullets.append(md.bullet(_precision_sentence(data)))
    prefill = data["prefill"]
    bullets.append(md.bullet(
        f"Prefill of a {prefill['tokens']}-token prompt: minillm {md.seconds(prefill['seconds']['minillm'])}, "
        f"transformers {md.seconds(prefill['seconds']['transformers'])} "
        f"(**{md.times(prefill['speedup_vs_transformers'])}**)."))
    return "\n".join(bullets)


def _precision_sentence(data: dict) -> str:
    """BF16 against FP32, and whether the CPU has the instructions that decide it (when the JSON says)."""
    fp32, bf16 = (_speeds(data["results"][dtype]) for dtype in ("float32", "bfloat16"))
    ratio = bf16[_fastest(bf16, "minillm")] / fp32[_fastest(fp32, "minillm")]
    text = (f"minillm's best BF16 decoding runs at {md.times(ratio)} its best FP32 speed. BF16 halves the bytes a step "
            "reads")
    if "gpu" in data["machine"]:  # far below the roofline, a GPU's step waits on launches, not on bytes
        return text + ("; on a GPU a step this small is bound by its kernel launches and the host, not by the bytes, "
                       "so halving them changes little.")
    text += "; how much of that becomes speed is up to the CPU's BF16 matrix kernels (lesson 05)"
    flags = data["machine"].get("cpu_flags")
    if flags is not None:
        native = [flag for flag in flags if "bf16" in flag]
        text += (f": this CPU reports {', '.join(f'`{flag}`' for flag in native)}" if native
                 else ": this CPU reports no BF16 instructions, so its kernels widen BF16 to FP32 as they read it")
    return text + "."


def cache_scaling_section(title: str, data: dict, links: dict) -> str:
    rows, growth = data["rows"], data["growth"]
    first, last = rows[0]["length"], rows[-1]["length"]
    header = ["sequence length", *(str(row["length"]) for row in rows), f"growth {first} → {last}"]
    body = [[name, *(md.milliseconds(row[name]) for row in rows), md.times(growth[name])] for name in growth]
    def grows(name: str) -> str:  # below 1.1x a cached step's growth is within a shared machine's run-to-run noise
        g = growth[name]
        return f"grows {md.times(g)}" if g >= 1.1 else f"stays flat ({md.times(g)}, within the run's noise)"

    text = (f"From {first} to {last} tokens the cost of the next token {grows('static cache')} with a static cache "
            f"and {grows('dynamic cache')} with a dynamic one, against {md.times(growth['no cache'])} without a "
            "cache, which recomputes every earlier position at each step.")
    return "\n\n".join([
        md.heading(title, links,
                   f"{model_label(data['model'])}, {md.PRECISIONS.get(data['dtype'], data['dtype'])}, ms for the next "
                   "token after the given number of tokens."),
        md.provenance(data), md.table(header, body), md.paragraph(text)])


def batch_section(title: str, data: dict, links: dict) -> str:
    rows = data["rows"]
    lengths = rows[-1]["prompt_lengths"]
    differing = [str(row["batch"]) for row in rows if not row["same_tokens"]]
    same = ("At every batch size minillm and transformers produced the same tokens." if not differing else
            f"minillm and transformers produced different tokens at batch {', '.join(differing)}.")
    header = ["batch", *(str(row["batch"]) for row in rows)]
    body = [["minillm tok/s (prefill included)", *(f"{r['minillm']['tokens_per_second']:.1f}" for r in rows)],
            ["transformers tok/s", *(f"{r['transformers']['tokens_per_second']:.1f}" for r in rows)],
            ["minillm / transformers", *(md.times(r["speedup_vs_transformers"]) for r in rows)],
            ["minillm decode-only tok/s", *(f"{r['minillm']['decode_per_second']:.1f}" for r in rows)],
            ["padding share of computed positions", *(md.percent(r["padding_share"]) for r in rows)]]
    first, biggest = rows[0], rows[-1]
    decode_scaling = biggest["minillm"]["decode_per_second"] / first["minillm"]["decode_per_second"]
    text = (f"Batch {biggest['batch']} gives {biggest['minillm_scaling_vs_batch_1']:.1f}x batch {first['batch']}'s "
            f"throughput end to end and {decode_scaling:.1f}x in the decode phase alone; minillm / transformers goes "
            f"from {md.times(first['speedup_vs_transformers'])} at batch {first['batch']} to "
            f"{md.times(biggest['speedup_vs_transformers'])}. A batch reads the weights once for all its rows, until "
            "the step's matrix multiplications become compute-bound; and a padded prefill computes padding too: "
            f"{md.percent(biggest['prefill_padding_share'])} of the prefill positions at batch {biggest['batch']} "
            "(lesson 07's packed-prefill exercise removes it).")
    return "\n\n".join(part for part in [
        md.heading(title, links,
                   f"{model_label(data['model'])}, {md.PRECISIONS.get(data['dtype'], data['dtype'])}, greedy, prompts "
                   f"of {min(lengths)}-{max(lengths)} tokens, {data['new_tokens']} new tokens each. {same}"),
        md.provenance(data), md.table(header, body), md.paragraph(text), _batch_balance(data)] if part)


def _batch_balance(data: dict) -> str:
    """Where the decode phase stops gaining from rows, and why: the weight reading against the arithmetic.

    Read from the decode-only rates: a step of B rows takes B / rate seconds. The batch-1 step gives the
    effective read bandwidth (the weights' bytes over its time), the largest batch the arithmetic rate
    the cores sustain (its flops over its time); rows are nearly free until their arithmetic takes as
    long as the weight reading. Only for the default model, whose weights and flops the cost model counts.
    """
    if data["model"] not in DEFAULT_ALIASES or data["dtype"] != "float32":
        return ""
    rows = data["rows"]
    batches = [row["batch"] for row in rows]
    rates = [row["minillm"]["decode_per_second"] for row in rows]
    step_ms = [1000 * b / rate for b, rate in zip(batches, rates)]
    linear = max((b for b, rate in zip(batches, rates) if rate / rates[0] >= 0.9 * b / batches[0]), default=batches[0])
    at = batches.index(linear)
    gains = ", ".join(f"{rates[i] / rates[i - 1]:.2f}x to {batches[i]}" for i in range(at + 1, len(rows)))
    context = max(rows[-1]["prompt_lengths"]) + data["new_tokens"] // 2
    flops = forward_flops(SMOLLM2_135M, 1, context)  # per token (row) of a decode step
    weights = weight_bytes(SMOLLM2_135M)
    read_gb_s = weights / (step_ms[0] / 1000) / 1e9
    sustained = batches[-1] * flops / (step_ms[-1] / 1000)
    balance = (step_ms[0] / 1000) / (flops / sustained)
    if linear == batches[0]:
        growth = f"grows less than B-fold from the first step up ({gains})"
    else:
        growth = (f"grows about B-fold up to batch {linear} ({rates[at]:.1f} tok/s, {rates[at] / rates[0]:.1f}x batch "
                  f"{batches[0]}'s {rates[0]:.1f})" + (f", then less than B-fold: {gains}" if gains else ""))
    below = [i for i, b in enumerate(batches) if 1 < b <= balance]  # the largest batch still under the balance
    cheap = (f"Below that, a row costs less than its share of the weight reading (batch {batches[below[-1]]}'s step "
             f"takes {step_ms[below[-1]] / step_ms[0]:.2f}x batch {batches[0]}'s)" if below else "Below that, rows "
             "share the weight reading")
    beyond = [i for i, b in enumerate(batches) if b > balance and i > 0]
    past = ("beyond it, the step is compute-bound: throughput still grows by less than the rows added ("
            + ", ".join(f"{rates[i] / rates[i - 1]:.2f}x to {batches[i]}" for i in beyond)
            + f"), while a step's latency grows to {step_ms[-1]:.0f} ms" if beyond else
            "beyond it, the step would be compute-bound, so each added row would cost its own arithmetic")
    return md.paragraph(
        f"In the decode phase alone throughput {growth}, while a step takes {step_ms[at]:.0f} ms at batch "
        f"{linear} and {step_ms[-1]:.0f} ms at batch {batches[-1]}. The batch-{batches[0]} step reads the weights at "
        f"an effective {read_gb_s:.1f} GB/s ({weights / 1e6:.0f} MB in {step_ms[0]:.1f} ms) and "
        f"does {flops / 1e9:.2f} GFLOP per row; batch {batches[-1]} sustains {sustained / 1e9:.0f} GFLOP/s "
        f"({batches[-1] * flops / 1e9:.1f} GFLOP in {step_ms[-1]:.0f} ms), so a step's arithmetic takes as long as "
        f"its weight reading at about {balance:.0f} rows. {cheap}; {past} (lesson 12's exercise 3 predicts this point "
        "from these two rates).")


def speculative_section(title: str, data: dict, links: dict) -> str:
    tasks = data["tasks"]
    ks = sorted({int(k) for task in tasks.values() for by_k in task["contenders"].values() for k in by_k})
    header = ["task", "drafter", "plain tok/s", *(f"k = {k}" for k in ks)]
    body = []
    for task, result in tasks.items():
        for name, by_k in result["contenders"].items():
            library = name.split()[0]
            rows = [by_k.get(str(k), by_k.get(k)) for k in ks]
            cells = ["" if row is None else md.times(row["speedup"]) +
                     (f" ({row['acceptance_rate']:.2f})" if row.get("acceptance_rate") is not None else "")
                     for row in rows]
            speedups = [row["speedup"] if row else float("-inf") for row in rows]
            body.append([task, name, f"{result[f'{library} plain']['tokens_per_second']:.1f}",
                         *md.bold_max(cells, speedups)])
    return "\n\n".join([
        md.heading(title, links,
                   f"{model_label(data['model'])}, {md.PRECISIONS.get(data['dtype'], data['dtype'])}, greedy, batch 1, "
                   f"up to {data['max_new_tokens']} new tokens. Each cell is tokens/s as a multiple of the same "
                   "library's plain greedy decoding (prefill included), with minillm's acceptance rate in brackets; "
                   f"bold: the best k. "
                   + _matches_sentence([f"{name} at k = {k} ({task})" for task, result in tasks.items()
                                     for name, by_k in result["contenders"].items() for k, row in by_k.items()
                                     if not row["matches_plain"]])),
        md.provenance(data), md.table(header, body), _speculative_bullets(data)])


def _matches_sentence(differing: list[str]) -> str:
    """Whether every run gave plain greedy's tokens, naming the runs that did not."""
    if not differing:
        return "Every run produced exactly the plain greedy tokens."
    return f"Runs whose tokens differ from plain greedy's: {', '.join(differing)}."


def _speculative_bullets(data: dict) -> str:
    tasks, bullets = data["tasks"], []
    for task, result in tasks.items():
        lookup = result["contenders"].get("minillm prompt-lookup")
        if not lookup:
            continue
        best_k = max(lookup, key=lambda k: lookup[k]["speedup"])
        best = lookup[best_k]
        text = (f"{task}: prompt lookup is accepted "
                f"{md.span([row['acceptance_rate'] for row in lookup.values()], 0, '%', 100)} of the time and gives "
                f"{md.span([row['speedup'] for row in lookup.values()], unit='x')}, at best "
                f"{best['tokens_per_second']:.1f} tok/s (k={best_k}) against plain greedy's "
                f"{result['minillm plain']['tokens_per_second']:.1f}.")
        reference = result["contenders"].get("transformers prompt-lookup")
        if reference:
            best_reference = max(row["tokens_per_second"] for row in reference.values())
            text += (" transformers' prompt lookup gives up to "
                     f"{md.times(max(row['speedup'] for row in reference.values()))} over its own plain greedy "
                     f"({result['transformers plain']['tokens_per_second']:.1f} tok/s): at best {best_reference:.1f} "
                     f"tok/s, {md.times(best_reference / best['tokens_per_second'])} minillm's best.")
        bullets.append(md.bullet(text))
    bullets.append(md.bullet("Prompt lookup pays where the output repeats the input (edits, code changes, "
                             "extraction)" + _lookup_elsewhere(tasks)))
    costs = {int(k): cost for k, cost in data["verify_cost"].items()}
    dearest = max(costs, key=costs.get)
    verify = (f"Verifying k + 1 tokens in one forward costs {md.span(costs.values(), 1)} single-token forwards "
              "(measured, k = " + ", ".join(map(str, costs)) + "): ")
    if costs[dearest] <= 1.15:  # within the noise of one step: the weight reads still dominate
        verify += ("about one, so verifying a draft is nearly free here and what caps the gain is how much of it is "
                   "accepted (and, for a draft model, its cost c).")
    else:
        verify += (f"up to {costs[dearest]:.2f} (k = {dearest}), so the rows' arithmetic shows here and a long draft "
                   "pays only when most of it is accepted: rejected tokens cost real time.")
    bullets.append(md.bullet(verify))
    for spec, cost in data["draft_cost_ratio"].items():
        rows = [row for result in tasks.values() for row in result["contenders"].get(f"minillm draft {spec}", {})
                .values()]
        if rows:
            bullets.append(md.bullet(
                f"Draft `{spec}` ({_draft_label(spec)}) costs {cost:.2f} of a target step and is accepted "
                f"{md.span([row['acceptance_rate'] for row in rows], 0, '%', 100)} of the time: "
                f"{md.span([row['speedup'] for row in rows], unit='x')} across tasks and k."))
    bullets.append(md.bullet("A draft model pays only when it is much cheaper than the target and agrees with it."))
    return "\n".join(bullets)


def _lookup_elsewhere(tasks: dict) -> str:
    """The rest of the prompt-lookup bullet: what it does on the tasks where under half its drafts are accepted."""
    elsewhere = {task: rows for task, result in tasks.items()
                 if (rows := result["contenders"].get("minillm prompt-lookup"))
                 and max((row.get("acceptance_rate") or 0.0) for row in rows.values()) < 0.5}
    if not elsewhere:
        return "."
    speedups = [row["speedup"] for rows in elsewhere.values() for row in rows.values()]
    cost = ("costs about what plain decoding costs" if 0.9 <= min(speedups) and max(speedups) <= 1.1
            else "runs at a fraction of plain decoding's speed")
    return (f"; elsewhere almost nothing it drafts is accepted, and it {cost} ({', '.join(elsewhere)}: "
            f"{md.span(speedups, unit='x')}).")


def _draft_label(spec: str) -> str:
    kind, _, value = spec.partition(":")
    if kind == "dtype":
        return f"the target's weights in {md.PRECISIONS.get(value, value)}"
    if kind == "layers":
        return f"the target's first {value} blocks"
    return spec


def lookahead_section(title: str, data: dict, links: dict) -> str:
    tasks = data["tasks"]
    names = list(next(iter(tasks.values()))["contenders"])
    shown = [name for name in names if not name.endswith(" plain")]
    header = ["task", "minillm plain tok/s", *shown]
    body = []
    for task, result in tasks.items():
        entries = [result["contenders"][name] for name in shown]
        cells = [md.times(e["speedup"]) + (f" ({e['tokens_per_forward']:.2f})" if "tokens_per_forward" in e else "")
                 for e in entries]
        body.append([task, f"{result['contenders']['minillm plain']['tokens_per_second']:.1f}",
                     *md.bold_max(cells, [e["speedup"] for e in entries])])
    prompts = sorted({n for result in tasks.values() for n in result["prompt_tokens"]})
    return "\n\n".join([
        md.heading(title, links,
                   f"{model_label(data['model'])}, {md.PRECISIONS.get(data['dtype'], data['dtype'])}, greedy, batch 1, "
                   f"held-out prompts of {prompts[0]}-{prompts[-1]} tokens, up to {data['max_new_tokens']} new tokens; "
                   f"lookahead at decoding length {data['decoding_length']}, branch length {data['branch_length']}; "
                   f"prompt lookup at k = {data['prompt_lookup_k']}. Each cell is tokens/s as a multiple of the same "
                   "library's plain greedy decoding (prefill included), with tokens per target forward in brackets; "
                   "bold: the fastest. "
                   + _matches_sentence([f"{name} ({task})" for task, result in tasks.items()
                                     for name, entry in result["contenders"].items() if not entry["matches_plain"]])),
        md.provenance(data), md.table(header, body), _lookahead_bullets(data)])


def _lookahead_bullets(data: dict) -> str:
    bullets = []
    for task, result in data["tasks"].items():
        c = result["contenders"]
        warm, prompt_only, lookup = (c["minillm lookahead (warm)"], c["minillm lookahead (prompt)"],
                                     c["minillm prompt-lookup"])
        best_key, best = max(result["sweep"]["settings"].items(), key=lambda item: item[1]["speedup"])
        default_key = f"{data['decoding_length']}x{data['branch_length']}"
        default = result["sweep"]["settings"].get(default_key)
        bullets.append(md.bullet(
            f"{task}: warm lookahead {md.times(warm['speedup'])} plain greedy and "
            f"{md.times(warm['tokens_per_second'] / lookup['tokens_per_second'])} prompt lookup (prompt-only trie: "
            f"{md.times(prompt_only['speedup'])}); it feeds {warm['fed_per_forward']:.1f} tokens per forward to gain "
            f"{warm['tokens_per_forward']:.2f}, and retrieving drafts takes {warm['draft_share']:.1%} of the "
            f"time. Best in the sweep (the first held-out prompt only, one run each): decoding length "
            f"{best['decoding_length']}, branch length {best['branch_length']} ({md.times(best['speedup'])}"
            + (", the default" if best_key == default_key else
               f"; the default {default_key} gave {md.times(default['speedup'])} on that prompt" if default else "")
            + ")."))
    worst_task, worst = min(((task, result["contenders"]["minillm lookahead (warm)"])
                             for task, result in data["tasks"].items()), key=lambda item: item[1]["speedup"])
    bullets.append(md.bullet(
        "Lookahead pays where the answer repeats what the trie has seen (the prompt, or earlier answers of the same "
        "kind); on open-ended text its drafts fail, and the adaptive budget shrinks them to the few nodes the tries "
        f"still offer ({worst_task}: {worst['fed_per_forward']:.1f} tokens fed per forward to gain "
        f"{worst['tokens_per_forward']:.2f}); such a round costs {worst['tokens_per_forward'] / worst['speedup']:.2f} "
        f"plain steps (tokens per forward / speed-up), not one, so the run lands at {md.times(worst['speedup'])} "
        "plain decoding."))
    return "\n".join(bullets)
