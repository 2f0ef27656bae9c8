"""`python -m minillm.bench speculative`: what drafting buys on this machine, against transformers.

Greedy decoding at batch 1 on the default model, FP32. For each task (an input-grounded
edit of a passage, and an open-ended story) and each draft length k, the same prompt runs
through plain cached greedy decoding and through each drafter, minillm and transformers'
assisted generation (`prompt_lookup_num_tokens`, `assistant_model`) alternating in one
run. Reported: tokens/s (generated tokens over the whole call, prefill included),
speedup over the same library's plain greedy, acceptance rate, tokens per target
forward, whether the tokens equal plain greedy's, and the cost model's prediction from
the measured acceptance rate, the measured draft/target cost ratio c and the measured
cost of verifying k + 1 tokens in one forward. Every minillm run is eager (`compile=False`):
a decode graph kept on disk by an earlier run (lesson 15) would otherwise speed up plain
decoding and not the verify forwards, and the comparison would depend on the cache's state.

Every k adds one run per drafter and library, and a draft model's run grows with k
(it drafts k tokens one forward at a time), so the draft lengths decide the run time:

    python -m minillm.bench speculative                          # k = 1, 2, 4, 8; BF16 and 24-layer drafts
    python -m minillm.bench speculative --ks 1,2,3,4,5,6,7,8     # every k up to 8: a longer run
    python -m minillm.bench speculative --drafts dtype:bfloat16  # without the slow 24-layer drafts
    python -m minillm.bench speculative --quick                  # 48 new tokens, the BF16 draft only
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..decoding.sampling import SamplingConfig
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from ..strategies.acceptance import acceptance_from_share, predicted_speedup
from ..strategies.drafters import DraftModel, PromptLookup, load_draft
from ..strategies.generate import generate
from ..strategies.speculative import speculative_generate
from .common import alternate, median, plot_title, save_png, spread_band

PASSAGE = (
    "The lighthouse on Gull Point was bilt in 1871 to warn ships away from the rocks that lie just under the "
    "surface at high tide. For more then a century a keeper lived in the small stone house at its foot, climbing "
    "the hundred and twelve steps each evening to light the lamp and again each morning to put it out. In 1962 "
    "the light was automated, and the last keeper, a quiet man named Tomas Reyes, moved to the village, where he "
    "spent his remaining years repairing fishing nets and telling visitors about the storms he had seen."
)
TASKS = {
    "edit (input-grounded)": "Correct the spelling mistakes in this passage and return the whole corrected "
                             "passage:\n\n" + PASSAGE,
    "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
KS = (1, 2, 4, 8)  # draft lengths measured by default (--ks)
DRAFTS = ("dtype:bfloat16", "layers:24")  # the target's own weights: in BF16, or its first 24 of 30 blocks


def forward_timer(model, n_tokens: int, context: int):
    """A no-argument function that runs one cached forward over `n_tokens` new tokens after `context` cached ones,
    through the model runner's verify step (what speculative decoding runs), and returns its seconds."""
    vocab = model.config.vocab_size
    runner = ModelRunner(model, max_len=context + n_tokens)
    seq = Sequence.create(torch.randint(0, vocab, (context,)).tolist(), SamplingConfig(max_new_tokens=n_tokens + 1),
                          vocab_size=vocab)
    with torch.inference_mode():
        runner.prefill([seq])
    seq.append(int(torch.randint(0, vocab, ())))  # the token each round feeds first, then the draft after it
    draft = torch.randint(0, vocab, (n_tokens - 1,)).tolist()

    @torch.inference_mode()
    def forward() -> float:
        start = time.perf_counter()
        runner.verify([seq], [draft])  # [1, n_tokens, V]
        elapsed = time.perf_counter() - start
        runner.rollback([seq])  # the cache holds the context again
        return elapsed
    return forward


def forward_seconds(model, n_tokens: int, context: int, repeats: int = 5) -> float:
    """Median time of one such forward (`forward_timer`), after one untimed warm-up."""
    forward = forward_timer(model, n_tokens, context)
    return median([forward() for _ in range(repeats + 1)][1:])


def cost_ratios(target, drafts: dict, ks, context: int, repeats: int = 7) -> tuple[dict, dict]:
    """verify_cost[k]: a (k+1)-token target forward in one-token forwards; draft_cost[name]: c.

    Every forward is timed in turn, round after round (`alternate`), and each ratio is of medians: timed one
    after the other, a slow spell of a shared machine during the one-token forwards alone would shrink every
    ratio at once (a measured v_1 of 0.71 did).
    """
    timers = {("target", n): forward_timer(target, n, context) for n in sorted({1, *(k + 1 for k in ks)})}
    timers.update({(name, 1): forward_timer(model, 1, context) for name, model in drafts.items()})
    times = {key: median(t) for key, t in alternate(timers, repeats=repeats, warmup=1,
                                                       desc="forward costs").items()}
    one = times["target", 1]
    return ({k: times["target", k + 1] / one for k in ks},
            {name: times[name, 1] / one for name in drafts})


def measure_task(model, tokenizer, prompt: str, ks, max_new_tokens: int, repeats: int, drafts: dict,
                 hf=None, hf_drafts: dict | None = None) -> dict:
    """One task: every contender at every k, alternating; speedups against the same library's plain greedy."""
    ids = tokenizer.encode(prompt)
    runs, outputs = {}, {}

    def minillm_plain():
        outputs["minillm plain"] = generate(model, ids, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                                            compile=False)

    runs["minillm plain"] = minillm_plain
    drafters = {"prompt-lookup": PromptLookup, **{f"draft {name}": (lambda m=m: DraftModel(m)) for name, m in drafts.items()}}
    for name, make in drafters.items():
        for k in ks:
            def run(name=name, make=make, k=k):
                outputs[f"minillm {name}", k] = speculative_generate(model, ids, make(), tokenizer=tokenizer,
                                                                     num_draft_tokens=k, max_new_tokens=max_new_tokens,
                                                                     compile=False)
            runs[f"minillm {name}", k] = run
    if hf is not None:
        input_ids = torch.tensor([ids])
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids),
                      pad_token_id=tokenizer.eos_token_id)

        def hf_generate(key, **extra):
            outputs[key] = hf.generate(input_ids, **common, **extra)[0, len(ids):].tolist()

        runs["transformers plain"] = lambda: hf_generate("transformers plain")
        for k in ks:
            runs["transformers prompt-lookup", k] = lambda k=k: hf_generate(("transformers prompt-lookup", k),
                                                                            prompt_lookup_num_tokens=k)
            for name, assistant in (hf_drafts or {}).items():
                def assisted(name=name, assistant=assistant, k=k):
                    assistant.generation_config.num_assistant_tokens = k
                    assistant.generation_config.num_assistant_tokens_schedule = "constant"
                    assistant.generation_config.assistant_confidence_threshold = 0.0  # fixed k, no early stop
                    hf_generate((f"transformers assistant {name}", k), assistant_model=assistant)
                runs[f"transformers assistant {name}", k] = assisted

    times = alternate({str(key): fn for key, fn in runs.items()}, repeats=repeats, warmup=1,
                      desc="speculative runs")
    plain_ids = outputs["minillm plain"].rows[0].token_ids
    result = {"prompt_tokens": len(ids), "contenders": {}}

    def tokens_of(key):
        out = outputs[key]
        return out if isinstance(out, list) else out.rows[0].token_ids

    def speed(key):
        return len(tokens_of(key)) / median(times[str(key)])

    result["minillm plain"] = {"tokens_per_second": speed("minillm plain"), "tokens": len(plain_ids),
                               "seconds_per_repeat": times["minillm plain"]}
    if hf is not None:
        hf_plain = tokens_of("transformers plain")
        result["transformers plain"] = {"tokens_per_second": speed("transformers plain"), "tokens": len(hf_plain),
                                        "matches_minillm": hf_plain == plain_ids,
                                        "seconds_per_repeat": times["transformers plain"]}
    for key in runs:
        if isinstance(key, str):
            continue
        name, k = key
        library = name.split()[0]
        row = {"tokens_per_second": speed(key), "speedup": speed(key) / result[f"{library} plain"]["tokens_per_second"],
               "matches_plain": tokens_of(key) == tokens_of(f"{library} plain"),
               "tokens": len(tokens_of(key)), "seconds_per_repeat": times[str(key)]}
        if library == "minillm":
            row.update({f: outputs[key].stats.extra[f] for f in ("acceptance_rate", "tokens_per_target_forward")})
        result["contenders"].setdefault(name, {})[k] = row
    return result


def model_speedup(contender: str, k: int, share, verify_cost: dict, draft_cost: dict) -> float | None:
    """The cost model's speedup for one minillm drafter's run at draft length k, or None when nothing was drafted.

    The measured rate is accepted / drafted; the model's a is the per-token acceptance probability,
    recovered from it (`acceptance_from_share`), so the predicted tokens per round are 1 + k·rate,
    for k draft forwards at c each (prompt lookup's cost ~nothing) and one verify at verify_cost[k].
    """
    if share is None or share != share:  # null in a results file, NaN in memory
        return None
    c = draft_cost.get(contender.removeprefix("minillm draft "), 0.0)
    return predicted_speedup(acceptance_from_share(share, k), k, c, verify_cost[k])


def add_predictions(task: dict, verify_cost: dict, draft_cost: dict) -> None:
    """`model_speedup` for each minillm drafter's row, from its measured acceptance."""
    for name, rows in task["contenders"].items():
        if name.startswith("minillm"):
            for k, row in rows.items():
                row["predicted_speedup"] = model_speedup(name, k, row["acceptance_rate"], verify_cost, draft_cost)


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ..model.loading import resolve_checkpoint_folder
    from ..speed.load import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    folder = resolve_checkpoint_folder(args.model)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ks = getattr(args, "ks", None) or KS  # --ks: each k adds one run per drafter and library
    max_new_tokens = 48 if args.quick else 128
    draft_specs = getattr(args, "drafts", None) or (DRAFTS[:1] if args.quick else DRAFTS)
    drafts = {spec: load_draft(spec, model)[0] for spec in draft_specs}
    hf_drafts = {}
    for spec in draft_specs:
        if spec.startswith("dtype:"):
            hf_drafts[spec] = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, spec[6:])).eval()
        else:
            n = int(spec.split(":")[1])
            draft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            draft.model.layers, draft.config.num_hidden_layers = draft.model.layers[:n], n
            hf_drafts[spec] = draft
    tasks = {}
    for task, message in tqdm(TASKS.items(), desc="speculative tasks", unit="task", disable=None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}])
        tqdm.write(f"speculative: {task} ...")
        tasks[task] = measure_task(model, tokenizer, prompt, ks, max_new_tokens, args.repeats, drafts, hf, hf_drafts)
    context = max(t["prompt_tokens"] for t in tasks.values()) + max_new_tokens // 2
    verify_cost, draft_cost = cost_ratios(model, drafts, ks, context)
    for task in tasks.values():
        add_predictions(task, verify_cost, draft_cost)
    return {"model": args.model, "dtype": "float32", "max_new_tokens": max_new_tokens, "ks": list(ks),
            "repeats": args.repeats,
            "verify_cost": verify_cost, "draft_cost_ratio": draft_cost, "tasks": tasks}


def plot(data: dict, path=None):
    """One row per task: tokens/s against k for each library (its plain greedy as a gray line, the speedup
    over it on the right axis, the cost model dashed), and minillm's acceptance rate.

    Colour names the drafter, so the same drafter can be compared across libraries
    on the shared tokens/s axis. Bands: min-max over the repeats.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def drafter(contender: str) -> str:  # 'minillm draft dtype:bfloat16', 'transformers assistant dtype:bfloat16'
        return contender.split(" ", 1)[1].removeprefix("draft ").removeprefix("assistant ")

    def by_draft_length(by_k: dict) -> tuple[list[int], list[dict]]:  # JSON turned the int keys into strings
        ks = sorted(int(k) for k in by_k)
        return ks, [by_k[k] if k in by_k else by_k[str(k)] for k in ks]

    def plot_library(ax, result: dict, library: str) -> None:
        plain = result[f"{library} plain"]
        plain_speed = plain["tokens_per_second"]
        ax.axhline(plain_speed, color="gray", label=f"plain greedy, {plain_speed:.1f} tok/s")
        if plain.get("seconds_per_repeat"):
            speeds = [plain["tokens"] / s for s in plain["seconds_per_repeat"]]
            ax.axhspan(min(speeds), max(speeds), color="gray", alpha=0.15, linewidth=0)
        for name, by_k in result["contenders"].items():
            if not name.startswith(library):
                continue
            ks, rows = by_draft_length(by_k)
            color = colors[drafter(name)]
            ax.plot(ks, [r["tokens_per_second"] for r in rows], "o-", color=color, label=drafter(name))
            spread_band(ax, ks, [[r["tokens"] / s for s in r.get("seconds_per_repeat", [])] for r in rows], color)
            if "predicted_speedup" in rows[0]:
                ax.plot(ks, [plain_speed * r["predicted_speedup"] if r["predicted_speedup"] is not None
                             else float("nan") for r in rows], "--", color=color)
        ax.secondary_yaxis("right", functions=(lambda y: y / plain_speed, lambda x: x * plain_speed)
                           ).set_ylabel("speedup over plain greedy (x)")
        ax.set(title=f"{task}: {library}", xlabel="draft length k (tokens)", ylabel="tokens / s (whole call)")

    def plot_acceptance(ax, result: dict) -> None:
        for name, by_k in result["contenders"].items():
            ks, rows = by_draft_length(by_k)
            if "acceptance_rate" in rows[0]:
                ax.plot(ks, [r["acceptance_rate"] if r["acceptance_rate"] is not None else float("nan")
                             for r in rows], "o-", color=colors[drafter(name)], label=drafter(name))
        ax.set(title=f"{task}: minillm acceptance rate", xlabel="draft length k (tokens)",
               ylabel="drafted tokens accepted (fraction)", ylim=(0, 1.05))

    tasks = data["tasks"]
    libraries = [library for library in ("minillm", "transformers")
                 if any(name.startswith(library) for result in tasks.values() for name in result["contenders"])]
    drafters = list(dict.fromkeys(drafter(name) for result in tasks.values() for name in result["contenders"]))
    colors = dict(zip(drafters, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(len(tasks), len(libraries) + 1, figsize=(5 * (len(libraries) + 1), 4.4 * len(tasks)),
                             squeeze=False)
    for panels, (task, result) in zip(axes, tasks.items()):
        for ax in panels[1:len(libraries)]:  # one tokens/s scale per task: the libraries compare directly
            ax.sharey(panels[0])
        for ax, library in zip(panels, libraries):
            plot_library(ax, result, library)
        plot_acceptance(panels[-1], result)
        for ax in panels:
            ax.set_xticks(sorted({int(k) for by_k in result["contenders"].values() for k in by_k}))
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle(plot_title("Speculative decoding, greedy, batch 1", data, data["dtype"]) +
                 f"\nup to {data['max_new_tokens']} new tokens; dashed: cost model from the measured acceptance; "
                 "lines: median over repeats, bands: min-max", fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path)
        plt.close(fig)
    return fig
