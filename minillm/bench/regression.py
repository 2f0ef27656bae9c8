"""Suite `regression`: this checkout against another commit, alternating in one run.

    python -m minillm.bench regression --against 8e06c7e

A refactor promises "no slower"; this suite checks the promise the way the other suites
compare libraries: the same model, prompts and settings, both contenders alternating
round by round so that drift in the machine's speed hits them alike, medians with the
spread. The other commit is checked out with `git worktree` into a temporary folder;
each measurement runs in a fresh Python process whose import path points at one
checkout (two versions of one package cannot share a process).

Measured on FP32, greedy, EOS off, through the public `generate` both versions share:

    decode      tokens/s at batch 1 after the first token (128-token prompt, 128 new tokens)
    batch-16    tokens/s for 16 mixed-length prompts, 32 new tokens each, prefill included
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent.parent

# Runs inside each subprocess, against whichever `minillm` its PYTHONPATH names.
MEASURE = """
import json, sys, time
import torch
from minillm import load_model
try:
    from minillm.strategies.generate import generate
    from minillm.bench.batch import TEXT, batch_prompts
except ImportError:  # a commit from before the package was laid out in subpackages
    from minillm.infer import generate
    from minillm.benchmarks.batch import TEXT, batch_prompts

new_tokens, batch_new, timed = {new_tokens}, {batch_new}, {timed}
model, tok = load_model({model!r})
prompt = tok.encode(TEXT)[:{prompt_tokens}]
rows = batch_prompts(tok, 16)

def decode():
    out = generate(model, [prompt], max_new_tokens=new_tokens, eos_token_id=())
    return (new_tokens - 1) / out.stats.decode_seconds, out.token_ids[0]

def batch():
    t = time.perf_counter()
    out = generate(model, rows, max_new_tokens=batch_new, eos_token_id=())
    return len(rows) * batch_new / (time.perf_counter() - t), out.token_ids

decode(); batch()  # warm-up: caches, packed weights, allocator
results = {{"decode": [], "batch-16": []}}
for _ in range(timed):
    rate, decode_tokens = decode()
    results["decode"].append(rate)
    rate, batch_tokens = batch()
    results["batch-16"].append(rate)
print(json.dumps({{"rates": results, "decode_tokens": decode_tokens, "batch_tokens": batch_tokens}}))
"""


def worktree(rev: str, folder: Path) -> str:
    """Check `rev` out into `folder`; returns its full commit hash."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise ValueError(f"--against {rev!r} is not a commit of this repository: give a hash, tag or branch")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), rev],
                   check=True, capture_output=True)
    return commit.stdout.strip()


def measure(checkout: Path, code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=checkout)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {checkout} failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    if not args.against:
        raise ValueError("the regression suite needs --against REV: the commit to compare this checkout with")
    quick = args.quick
    settings = dict(model=args.model, prompt_tokens=32 if quick else 128, new_tokens=16 if quick else 128,
                    batch_new=8 if quick else 32, timed=1 if quick else 2)
    code = MEASURE.format(**settings)
    rounds = 1 if quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        other_commit = worktree(args.against, other)
        try:
            contenders = {"this checkout": ROOT, f"against {other_commit[:8]}": other}
            rates = {name: {"decode": [], "batch-16": []} for name in contenders}
            tokens = {}
            with tqdm(total=rounds * len(contenders), desc="regression rounds", disable=None) as progress:
                for _ in range(rounds):
                    for name, checkout in contenders.items():
                        result = measure(checkout, code)
                        for metric, values in result["rates"].items():
                            rates[name][metric] += values
                        tokens[name] = (result["decode_tokens"], result["batch_tokens"])
                        progress.update()
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], capture_output=True)
    this, that = contenders
    ratios = {metric: statistics.median(rates[this][metric]) / statistics.median(rates[that][metric])
              for metric in ("decode", "batch-16")}
    return {"model": args.model, "quick": quick, "against": other_commit, "settings": settings, "rounds": rounds,
            "tokens_per_second": rates, "ratio": ratios, "same_tokens": tokens[this] == tokens[that]}


def plot(data: dict, path=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import machine_label

    names = list(data["tokens_per_second"])
    metrics = ["decode", "batch-16"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, metric in zip(axes, metrics):
        values = [data["tokens_per_second"][name][metric] for name in names]
        medians = [statistics.median(v) for v in values]
        low = [m - min(v) for m, v in zip(medians, values)]
        high = [max(v) - m for m, v in zip(medians, values)]
        ax.bar(names, medians, yerr=[low, high], capsize=6, color=["tab:blue", "tab:gray"])
        ax.set_ylabel("tokens/s (median, min-max)")
        ax.set_title(f"{metric}: {data['ratio'][metric]:.3f}x")
    fig.suptitle(f"{data['model']} FP32, cpu, {machine_label(data['machine'])}: this checkout vs "
                 f"{data['against'][:8]}", fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
