"""`python -m minillm.bench lookahead`: lookahead decoding (lesson 11) against plain greedy and prompt lookup.

Greedy decoding at batch 1 on the default model, FP32. Four kinds of task, each with a
*warm-up split* (prompts whose answers build lookahead's memory, as the original builds
its trie from a training split) and *held-out* prompts (the ones measured):

- input-grounded: the answer copies, edits or extracts from a passage in the prompt;
- code editing: the answer is the prompt's code with a change;
- repeated domain: requests of one kind (recipes), whose answers share their wording;
- open-ended: stories, where little repeats.

On every held-out prompt these run alternately in one process: minillm's plain greedy
decoding, its prompt lookup (lesson 08, at its default draft length), lookahead with
only the prompt's trie, lookahead with the memory warmed by the warm-up split, and
transformers' plain greedy and prompt lookup. A lookahead run starts from the warm
memory every time (it never learns from a held-out answer, so a repeat cannot copy
itself). Reported per task: tokens/s over the whole call (prefill included) as a
multiple of the same library's plain greedy, tokens per target forward (the effective
decoding length), tokens fed per forward, acceptance per draft depth, the share of the
time spent retrieving drafts, and whether the tokens equal plain greedy's. A sweep over
decoding length x branch length runs the warm lookahead once per setting. Every minillm
run is eager (`compile=False`), drafters and plain alike: a graph kept on disk by an
earlier run (lesson 15) must not speed up one side of a comparison.

    python -m minillm.bench lookahead            # every held-out prompt, 128 new tokens, the sweep
    python -m minillm.bench lookahead --quick    # 1 prompt per task, 48 new tokens, a 2 x 2 sweep
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..strategies.drafters import PromptLookup
from ..strategies.generate import generate
from ..strategies.lookahead import Lookahead
from ..strategies.speculative import speculative_generate
from .common import alternate, median, plot_title, save_png

PROMPT_LOOKUP_K = 4  # minillm's (and the CLI's) default draft length for prompt lookup
DECODING_LENGTHS = (4, 8, 16, 32)
BRANCH_LENGTHS = (2, 4, 8, 12)


@dataclass(frozen=True)
class Task:
    warm: tuple[str, ...]  # user messages whose answers warm the memory (never measured)
    held_out: tuple[str, ...]  # user messages measured


def _spelling(passage: str) -> str:
    return "Correct the spelling mistakes in this passage and return the whole corrected passage:\n\n" + passage


def _rename(code: str, old: str, new: str) -> str:
    return f"Rename the variable `{old}` to `{new}` in this Python code and return the whole code:\n\n{code}"


PASSAGES = (
    "The lighthouse on Gull Point was bilt in 1871 to warn ships away from the rocks that lie just under the "
    "surface at high tide. For more then a century a keeper lived in the small stone house at its foot, climbing "
    "the hundred and twelve steps each evening to light the lamp and again each morning to put it out.",
    "Our town libary opened its doors in 1903 with only four hundred books, most of them donated by familys who "
    "lived nearby. Today it holds more than sixty thousand titles, and every saturday morning the children's room "
    "is full of young readers listening to storys.",
    "The old bridge across the river was closed last winter after enginers found cracks in two of its supports. "
    "A new bridge is now being bilt a little further upstream, and the city expects it to open to traffic before "
    "the end of next year if the wether allows.",
    "Bees visit thousands of flowers every day to colect nectar and pollen. As they move from one flower to the "
    "next they carry pollen with them, which helps plants produce fruit and seeds. Without bees many of the foods "
    "we eat would become rare and expensiv.",
    "The farmers market in the center of town is open every sunday from eight untill noon. Local growers sell "
    "fresh vegtables, honey and bread, and in the summer there is allways a long line at the strawberry stand.",
    "Last spring our class planted a small garden behind the school. We grew beans, carrots and sunflowers, and "
    "each week two students were responsable for watering the plants and pulling out the weeds before they spred.",
    "The museum recieved a rare collection of old maps from a private donor last month. The maps show the coast as "
    "sailors saw it three hundred years ago, and they will be on display in the main hall untill the end of march.",
    "Every winter the lake near our village freezes solid, and people come from miles arround to skate on it. "
    "Volunteers check the thickness of the ice each morning and put up a red flag when it is not safe enuogh.",
)
CODES = (
    ("def total_price(items):\n    x = 0\n    for item in items:\n        x += item.price * item.quantity\n"
     "    return x\n", "x", "total"),
    ("def longest_word(words):\n    w = ''\n    for word in words:\n        if len(word) > len(w):\n"
     "            w = word\n    return w\n", "w", "longest"),
    ("def count_even(numbers):\n    n = 0\n    for number in numbers:\n        if number % 2 == 0:\n"
     "            n += 1\n    return n\n", "n", "count"),
    ("def average(values):\n    s = 0\n    for value in values:\n        s += value\n"
     "    return s / len(values)\n", "s", "running_sum"),
)
DISHES = ("pancakes", "tomato soup", "banana bread", "fried rice", "guacamole", "lemonade", "pasta salad",
          "an omelette", "chocolate cookies", "vegetable curry")
STORIES = (
    "a lighthouse keeper who finds a message in a bottle", "a dragon who is afraid of the dark",
    "a robot learning to paint", "two friends lost in a snowstorm", "a girl who can talk to birds",
    "a cat that becomes the mayor of a small town",
)
TASKS = {
    "input-grounded": Task(tuple(map(_spelling, PASSAGES[2:4])), tuple(map(_spelling, PASSAGES[:2] + PASSAGES[4:]))),
    "code editing": Task(tuple(_rename(*c) for c in CODES[2:]), tuple(_rename(*c) for c in CODES[:2])),
    "repeated domain": Task(tuple(f"Give me a simple recipe for {dish}." for dish in DISHES[:8]),
                            tuple(f"Give me a simple recipe for {dish}." for dish in DISHES[8:])),
    "open-ended": Task(tuple(f"Write a short story about {s}." for s in STORIES[2:]),
                       tuple(f"Write a short story about {s}." for s in STORIES[:2])),
}


def warm_memory(model, tokenizer, prompts, max_new_tokens: int) -> list[list[int]]:
    """The answers to the warm-up split, as token lists (what a deployment would have seen before)."""
    return [generate(model, ids, tokenizer=tokenizer, max_new_tokens=max_new_tokens, compile=False).rows[0].token_ids
            for ids in prompts]


def lookahead_drafter(memory: list[list[int]], **lengths) -> Lookahead:
    """A Lookahead (its default lengths unless given) whose memory holds `memory`."""
    drafter = Lookahead(**lengths)
    drafter.warm(memory)
    return drafter


def run_speculative(model, tokenizer, ids, drafter, max_new_tokens: int, k: int | None = None,
                    adaptive: bool | None = None):
    """(seconds, output) of one speculative run: the drafter is built before the clock starts.
    k and adaptive left as None: the drafter's own (lookahead: its decoding length, adapting)."""
    start = time.perf_counter()
    out = speculative_generate(model, ids, drafter, tokenizer=tokenizer, num_draft_tokens=k,
                               max_new_tokens=max_new_tokens, adaptive=adaptive, compile=False)
    return time.perf_counter() - start, out


def lookahead_stats(out) -> dict:
    extra = out.stats.extra
    decode = out.stats.prefill_seconds + out.stats.decode_seconds
    return {"tokens_per_forward": extra["tokens_per_target_forward"], "fed_per_forward": extra["tokens_fed_per_forward"],
            "acceptance_rate": extra["acceptance_rate"],
            "acceptance_by_depth": {str(d): a for d, a in extra["acceptance_by_depth"].items()},
            "draft_share": extra["draft_seconds"] / decode if decode else None}


def measure_prompt(model, tokenizer, hf, ids, memory, max_new_tokens: int, repeats: int) -> dict:
    """Every contender on one prompt, alternating; each row: tokens, seconds per repeat, stats."""
    outputs = {}

    def plain():
        outputs["minillm plain"] = generate(model, ids, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                                            compile=False)

    def speculative(name, make, **budget):
        def call():
            seconds, outputs[name] = run_speculative(model, tokenizer, ids, make(), max_new_tokens, **budget)
            return seconds
        return call

    runs = {"minillm plain": plain,
            "minillm prompt-lookup": speculative("minillm prompt-lookup", PromptLookup, k=PROMPT_LOOKUP_K),
            "minillm lookahead (prompt)": speculative("minillm lookahead (prompt)", Lookahead),
            "minillm lookahead (warm)": speculative("minillm lookahead (warm)", lambda: lookahead_drafter(memory))}
    if hf is not None:
        input_ids = torch.tensor([ids], device=hf.device)
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids),
                      pad_token_id=tokenizer.eos_token_id)

        def hf_generate(name, **extra):
            def call():
                outputs[name] = hf.generate(input_ids, **common, **extra)[0, len(ids):].tolist()
            return call

        runs["transformers plain"] = hf_generate("transformers plain")
        runs["transformers prompt-lookup"] = hf_generate("transformers prompt-lookup",
                                                         prompt_lookup_num_tokens=PROMPT_LOOKUP_K)
    times = alternate(runs, repeats=repeats, warmup=1, desc="lookahead runs")
    result = {}
    for name, seconds in times.items():
        out = outputs[name]
        tokens = out if isinstance(out, list) else out.rows[0].token_ids
        library = name.split()[0]
        reference = outputs[f"{library} plain"]
        reference = reference if isinstance(reference, list) else reference.rows[0].token_ids
        row = {"tokens": len(tokens), "seconds_per_repeat": seconds, "matches_plain": tokens == reference}
        if not isinstance(out, list) and "tokens_per_target_forward" in out.stats.extra:
            row.update(lookahead_stats(out))
        result[name] = row
    return result


def sweep(model, tokenizer, ids, memory, max_new_tokens: int, decoding_lengths, branch_lengths) -> dict:
    """Warm lookahead at each decoding length x branch length, one timed run each (after plain greedy's)."""
    generate(model, ids, tokenizer=tokenizer, max_new_tokens=max_new_tokens, compile=False)  # warm-up
    start = time.perf_counter()
    generate(model, ids, tokenizer=tokenizer, max_new_tokens=max_new_tokens, compile=False)
    plain_seconds = time.perf_counter() - start
    rows = {}
    for n in decoding_lengths:
        for depth in branch_lengths:
            drafter = lookahead_drafter(memory, decoding_length=n, branch_length=depth)
            seconds, out = run_speculative(model, tokenizer, ids, drafter, max_new_tokens)
            rows[f"{n}x{depth}"] = {"decoding_length": n, "branch_length": depth, "speedup": plain_seconds / seconds,
                                    **lookahead_stats(out)}
    return {"plain_seconds": plain_seconds, "settings": rows}


def summarise(prompts: list[dict]) -> dict:
    """Per contender over a task's prompts: tokens/s (all tokens over all median times) and the speedup over
    the same library's plain greedy; stats averaged over the prompts."""
    summary = {}
    for name in prompts[0]:
        rows = [p[name] for p in prompts]
        tokens = sum(r["tokens"] for r in rows)
        speed = tokens / sum(median(r["seconds_per_repeat"]) for r in rows)
        per_repeat = [tokens / sum(r["seconds_per_repeat"][i] for r in rows)
                      for i in range(len(rows[0]["seconds_per_repeat"]))]
        entry = {"tokens_per_second": speed, "tokens_per_second_per_repeat": per_repeat,
                 "matches_plain": all(r["matches_plain"] for r in rows)}
        for stat in ("tokens_per_forward", "fed_per_forward", "draft_share"):
            if stat in rows[0]:
                entry[stat] = sum(r[stat] for r in rows) / len(rows)
        if "acceptance_by_depth" in rows[0]:
            depths = sorted({int(d) for r in rows for d in r["acceptance_by_depth"]})
            entry["acceptance_by_depth"] = {str(d): sum(r["acceptance_by_depth"].get(str(d), 0) for r in rows) /
                                            sum(str(d) in r["acceptance_by_depth"] for r in rows) for d in depths}
        summary[name] = entry
    for name, entry in summary.items():
        entry["speedup"] = entry["tokens_per_second"] / summary[f"{name.split()[0]} plain"]["tokens_per_second"]
    return summary


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ..model.loading import resolve_checkpoint_folder
    from ..speed.load import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint_folder(args.model),
                                              dtype=torch.float32).to(args.device).eval()
    max_new_tokens = 48 if args.quick else 128
    held_out = 1 if args.quick else None  # None: every held-out prompt
    decoding_lengths, branch_lengths = ((8, 16), (4, 8)) if args.quick else (DECODING_LENGTHS, BRANCH_LENGTHS)

    def chat(message):
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": message}]))

    tasks = {}
    for name, task in tqdm(TASKS.items(), desc="lookahead tasks", unit="task", disable=None):
        tqdm.write(f"lookahead: {name} ...")
        memory = warm_memory(model, tokenizer, [chat(m) for m in task.warm], max_new_tokens)
        prompts = [chat(m) for m in task.held_out[:held_out]]
        measured = [measure_prompt(model, tokenizer, hf, ids, memory, max_new_tokens, args.repeats) for ids in prompts]
        tasks[name] = {"prompt_tokens": [len(ids) for ids in prompts], "warm_prompts": len(task.warm),
                       "contenders": summarise(measured), "prompts": measured,
                       "sweep": sweep(model, tokenizer, prompts[0], memory, max_new_tokens, decoding_lengths,
                                      branch_lengths)}
    return {"model": args.model, "dtype": "float32", "max_new_tokens": max_new_tokens, "repeats": args.repeats,
            "prompt_lookup_k": PROMPT_LOOKUP_K, "decoding_length": Lookahead().decoding_length,
            "branch_length": Lookahead().branch_length, "tasks": tasks}


def plot(data: dict, path=None):
    """Four panels: speedup per task and contender (bars, min-max over repeats as whiskers), tokens per
    forward, acceptance by depth (warm lookahead), and the sweep's speedup as a heat map per task."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = data["tasks"]
    names = list(next(iter(tasks.values()))["contenders"])
    fig, axes = plt.subplots(2, 2 + len(tasks) // 2, figsize=(5 * (2 + len(tasks) // 2), 8.4))
    ax = axes[0, 0]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [t + (i - (len(names) - 1) / 2) * width for t in range(len(tasks))]
        entries = [task["contenders"][name] for task in tasks.values()]
        plain = [task["contenders"][f"{name.split()[0]} plain"] for task in tasks.values()]
        speedups = [e["speedup"] for e in entries]
        low = [s - min(r / p["tokens_per_second"] for r in e["tokens_per_second_per_repeat"])
               for s, e, p in zip(speedups, entries, plain)]
        high = [max(r / p["tokens_per_second"] for r in e["tokens_per_second_per_repeat"]) - s
                for s, e, p in zip(speedups, entries, plain)]
        ax.bar(xs, speedups, width, yerr=[[max(v, 0) for v in low], [max(v, 0) for v in high]], label=name,
               capsize=2)
    ax.axhline(1, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), list(tasks), fontsize=8)
    ax.set(ylabel="speedup over the same library's plain greedy (x)", title="Speedup")
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    speculative_names = [n for n in names if "tokens_per_forward" in next(iter(tasks.values()))["contenders"][n]]
    for i, name in enumerate(speculative_names):
        xs = [t + (i - (len(speculative_names) - 1) / 2) * (0.8 / len(speculative_names)) for t in range(len(tasks))]
        ax.bar(xs, [task["contenders"][name]["tokens_per_forward"] for task in tasks.values()],
               0.8 / len(speculative_names), label=name)
    ax.axhline(1, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), list(tasks), fontsize=8)
    ax.set(ylabel="tokens per target forward", title="Effective decoding length")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for task, result in tasks.items():
        by_depth = result["contenders"]["minillm lookahead (warm)"]["acceptance_by_depth"]
        ax.plot([int(d) for d in by_depth], list(by_depth.values()), "o-", label=task)
    ax.set(xlabel="draft depth", ylabel="rounds that accepted a token at this depth\n(of those that drafted it)",
           ylim=(0, 1.05), title="Acceptance by depth, warm lookahead")
    ax.legend(fontsize=7)
    heat_axes = [a for a in axes.flat if a not in (axes[0, 0], axes[1, 0], axes[0, 1])]
    for ax, (task, result) in zip(heat_axes, tasks.items()):
        settings = result["sweep"]["settings"].values()
        ns = sorted({s["decoding_length"] for s in settings})
        depths = sorted({s["branch_length"] for s in settings})
        grid = [[result["sweep"]["settings"][f"{n}x{d}"]["speedup"] for d in depths] for n in ns]
        image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
        for r, row in enumerate(grid):
            for c, value in enumerate(row):
                ax.text(c, r, f"{value:.2f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(ns)), ns)
        ax.set(xlabel="branch length", ylabel="decoding length", title=f"Sweep (warm): {task}")
        fig.colorbar(image, ax=ax, label="speedup (x)")
    for ax in heat_axes[len(tasks):]:
        ax.axis("off")
    fig.suptitle(plot_title("Lookahead decoding, greedy, batch 1", data, data["dtype"]) +
                 f"\nheld-out prompts, up to {data['max_new_tokens']} new tokens; prompt lookup k = "
                 f"{data['prompt_lookup_k']}; whiskers: min-max over repeats; sweep: one run per setting",
                 fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path)
        plt.close(fig)
    return fig
