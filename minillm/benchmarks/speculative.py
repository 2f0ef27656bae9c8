"""`python -m minillm.bench speculative`: what drafting buys on this machine, against transformers.

Greedy decoding at batch 1 on the default model, FP32. For each task (an input-grounded
edit of a passage, and an open-ended story) and each draft length k, the same prompt runs
through plain cached greedy decoding and through each drafter, minillm and transformers'
assisted generation (`prompt_lookup_num_tokens`, `assistant_model`) alternating in one
run. Reported: tokens/s (generated tokens over the whole call, prefill included),
speedup over the same library's plain greedy, acceptance rate, tokens per target
forward, whether the tokens equal plain greedy's, and the cost model's prediction from
the measured acceptance rate, the measured draft/target cost ratio c and the measured
cost of verifying k + 1 tokens in one forward.
"""

from __future__ import annotations

import time

import torch

from ..bench import alternate, machine_info, machine_label, median
from ..infer import generate
from ..kv_cache import make_cache
from ..speculative import DraftModel, PromptLookup, load_draft, predicted_speedup, speculative_generate

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
DRAFTS = ("dtype:bfloat16", "layers:24")  # the target's own weights: in BF16, or its first 24 of 30 blocks


@torch.inference_mode()
def forward_seconds(model, n_tokens: int, context: int, repeats: int = 5) -> float:
    """Median time of one cached forward over `n_tokens` new tokens after `context` cached ones."""
    cache = make_cache("static", model, 1, context + n_tokens)
    model(torch.randint(0, model.config.vocab_size, (1, context)), torch.arange(context)[None], cache=cache)
    tokens = torch.randint(0, model.config.vocab_size, (1, n_tokens))
    positions = torch.arange(context, context + n_tokens)[None]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model(tokens, positions, cache=cache)
        times.append(time.perf_counter() - start)
        cache.crop(context)
    return median(times[1:])


def cost_ratios(target, drafts: dict, ks, context: int) -> tuple[dict, dict]:
    """verify_cost[k]: a (k+1)-token target forward in one-token forwards; draft_cost[name]: c."""
    one = forward_seconds(target, 1, context)
    verify = {k: forward_seconds(target, k + 1, context) / one for k in ks}
    draft_cost = {name: forward_seconds(model, 1, context) / one for name, model in drafts.items()}
    return verify, draft_cost


def measure_task(model, tokenizer, prompt: str, ks, max_new_tokens: int, repeats: int, drafts: dict,
                 hf=None, hf_drafts: dict | None = None) -> dict:
    """One task: every contender at every k, alternating; speedups against the same library's plain greedy."""
    ids = tokenizer.encode(prompt)
    runs, outputs = {}, {}

    def minillm_plain():
        outputs["minillm plain"] = generate(model, ids, tokenizer=tokenizer, max_new_tokens=max_new_tokens)

    runs["minillm plain"] = minillm_plain
    drafters = {"prompt-lookup": PromptLookup, **{f"draft {name}": (lambda m=m: DraftModel(m)) for name, m in drafts.items()}}
    for name, make in drafters.items():
        for k in ks:
            def run(name=name, make=make, k=k):
                outputs[f"minillm {name}", k] = speculative_generate(model, ids, make(), tokenizer=tokenizer,
                                                                     num_draft_tokens=k, max_new_tokens=max_new_tokens)
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

    times = alternate({str(key): fn for key, fn in runs.items()}, repeats=repeats, warmup=1)
    plain_ids = outputs["minillm plain"].rows[0].token_ids
    result = {"prompt_tokens": len(ids), "contenders": {}}

    def tokens_of(key):
        out = outputs[key]
        return out if isinstance(out, list) else out.rows[0].token_ids

    def speed(key):
        return len(tokens_of(key)) / median(times[str(key)])

    result["minillm plain"] = {"tokens_per_second": speed("minillm plain"), "tokens": len(plain_ids)}
    if hf is not None:
        hf_plain = tokens_of("transformers plain")
        result["transformers plain"] = {"tokens_per_second": speed("transformers plain"), "tokens": len(hf_plain),
                                        "matches_minillm": hf_plain == plain_ids}
    for key in runs:
        if isinstance(key, str):
            continue
        name, k = key
        library = name.split()[0]
        row = {"tokens_per_second": speed(key), "speedup": speed(key) / result[f"{library} plain"]["tokens_per_second"],
               "matches_plain": tokens_of(key) == tokens_of(f"{library} plain")}
        if library == "minillm":
            row.update({f: outputs[key].stats.extra[f] for f in ("acceptance_rate", "tokens_per_target_forward")})
        result["contenders"].setdefault(name, {})[k] = row
    return result


def add_predictions(task: dict, verify_cost: dict, draft_cost: dict) -> None:
    """The cost model's speedup for each minillm drafter, from its measured acceptance."""
    for name, rows in task["contenders"].items():
        if not name.startswith("minillm"):
            continue
        c = draft_cost.get(name.removeprefix("minillm draft "), 0.0)  # prompt lookup costs ~nothing
        for k, row in rows.items():
            a = row["acceptance_rate"]
            row["predicted_speedup"] = None if a != a else predicted_speedup(a, k, c, verify_cost[k])


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ..loading import load_model, resolve_checkpoint_folder

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    folder = resolve_checkpoint_folder(args.model)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ks = (1, 2, 4, 8) if args.quick else tuple(range(1, 9))
    max_new_tokens = 48 if args.quick else 128
    draft_specs = DRAFTS[:1] if args.quick else DRAFTS
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
    for task, message in TASKS.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}])
        print(f"speculative: {task} ...", flush=True)
        tasks[task] = measure_task(model, tokenizer, prompt, ks, max_new_tokens, args.repeats, drafts, hf, hf_drafts)
    context = max(t["prompt_tokens"] for t in tasks.values()) + max_new_tokens // 2
    verify_cost, draft_cost = cost_ratios(model, drafts, ks, context)
    for task in tasks.values():
        add_predictions(task, verify_cost, draft_cost)
    return {"model": args.model, "dtype": "float32", "max_new_tokens": max_new_tokens, "ks": list(ks),
            "verify_cost": verify_cost, "draft_cost_ratio": draft_cost, "tasks": tasks}


def plot(data: dict, path=None):
    """Speedup (measured, and predicted dashed) and acceptance rate against k, one row per task."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = data["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (task, result) in zip(axes, tasks.items()):
        for i, (name, by_k) in enumerate(result["contenders"].items()):
            ks = sorted(int(k) for k in by_k)
            rows = [by_k[k] if k in by_k else by_k[str(k)] for k in ks]
            style = dict(color=colors[i % len(colors)], marker="x" if name.startswith("transformers") else "o")
            row[0].plot(ks, [r["speedup"] for r in rows], label=name, **style)
            if rows[0].get("predicted_speedup") is not None:
                row[0].plot(ks, [r["predicted_speedup"] for r in rows], linestyle="--", color=style["color"],
                            label=f"{name} (cost model)")
            if "acceptance_rate" in rows[0]:
                row[1].plot(ks, [r["acceptance_rate"] for r in rows], label=name, **style)
        row[0].axhline(1.0, color="gray", linewidth=0.8)
        row[0].set(title=f"{task}: speedup over plain cached greedy", xlabel="draft length k (tokens)",
                   ylabel="speedup (x, tokens/s ratio)")
        row[1].set(title=f"{task}: acceptance rate", xlabel="draft length k (tokens)",
                   ylabel="drafted tokens accepted (fraction)", ylim=(0, 1.05))
        row[0].legend(fontsize=7)
        row[1].legend(fontsize=7)
    machine = machine_label(data.get("machine") or machine_info())
    fig.suptitle(f"Speculative decoding, greedy, batch 1: {data['model']} model, {data['dtype']}, "
                 f"{data['max_new_tokens']} new tokens, CPU ({machine})")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
