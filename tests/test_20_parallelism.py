"""Lesson 20: tensor parallelism. A model split over processes (gloo on the CPU) computes what one process computes.

The reference is the same model in one process: every rank's logits against its logits (the
all-reduce adds partial sums in another order, so within a float32 rounding bound, not bit for
bit), greedy tokens through `generate` equal token for token, and each rank holding only its
share of the weights and of the KV cache. The split's arithmetic (which heads, hidden units and
vocabulary rows a rank holds) is checked against its definition by brute force.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.model.tiny import from_hf_model, tiny_hf_model
from minillm.model.transformer import Transformer, init_weights
from minillm.parallel.follow import follow, stop_followers
from minillm.parallel.launch import spawn_ranks
from minillm.parallel.shard import Split, check_split, shard_model, split_for
from minillm.runtime.runner import ModelRunner
from minillm.strategies.generate import generate

PROMPT = [5, 17, 3, 42, 8, 61, 29, 11, 7]
NEW_TOKENS = 12
# float32: a sum split over ranks rounds differently from one matmul; the logits here are O(1-10)
LOGIT_BOUND = 1e-4
ROOT = Path(__file__).resolve().parent.parent


def six_heads_three_kv() -> Transformer:
    """A Llama-shaped model whose heads split over three ranks as the default model's 9/3 do (tiny: 6/3)."""
    config = ModelConfig(vocab_size=100, context_length=64, n_layer=2, n_head=6, n_kv_head=3, d_model=48,
                         d_ff=96, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, qkv_bias=False)
    return init_weights(Transformer(config), std=0.2, seed=3).eval()


def build(kind: str) -> Transformer:
    return six_heads_three_kv() if kind == "6/3 heads" else from_hf_model(tiny_hf_model(kind))


def prompt_logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])


def greedy_tokens(model) -> list[int]:
    return generate(model, [PROMPT], max_new_tokens=NEW_TOKENS, eos_token_id=(), cache="static").rows[0].token_ids


def rank_run(group, whole: Transformer, out: str) -> None:
    """What each rank does: keep its shard of the whole model (handed over by the parent) and run the prompt's
    forward, every rank calling it; then rank 0 generates greedily while the others follow its runner."""
    model = shard_model(whole, group.rank, group.world)
    logits, tokens, calls = prompt_logits(model), None, None
    if group.leader:
        tokens = greedy_tokens(model)
        stop_followers()
    else:
        calls = follow(model, ModelRunner)
    torch.save({"logits": logits, "tokens": tokens, "calls": calls, "cache_heads": model.config.kv_heads,
                "parameters": sum(p.numel() for p in model.parameters())}, f"{out}/rank{group.rank}.pt")


@pytest.mark.parametrize("kind, world", [("llama", 2), ("gpt2", 2), ("gemma3", 4), ("6/3 heads", 3), ("qwen3_moe", 2),
                                         ("gpt_oss", 2), ("deepseek_v3", 2)])
def test_sharded_ranks_compute_what_one_process_does(kind, world, tmp_path):
    whole = build(kind)
    logits, tokens = prompt_logits(whole), greedy_tokens(whole)
    spawn_ranks(world, rank_run, whole, str(tmp_path), timeout=60)  # a rank left waiting fails the test
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    split = split_for(whole.config, 0, world)
    for r, got in enumerate(ranks):
        difference = (got["logits"] - logits).abs().max().item()
        assert difference <= LOGIT_BOUND, f"rank {r}: logits differ by {difference:.1e}"
        if r == 0:
            assert got["tokens"] == tokens, "greedy tokens differ from one process's"
        else:  # the prefill and each decode step but the last (its token ends the run without a forward)
            assert got["calls"] == NEW_TOKENS, f"rank {r} followed {got['calls']} calls"
        assert torch.equal(got["logits"], ranks[0]["logits"]), "every rank ends a step with the same logits"
        assert got["cache_heads"] == len(split.key_value_heads())  # its own key/value heads, or the one it repeats
        assert got["parameters"] < sum(p.numel() for p in whole.parameters()) / world * 1.5


MESSAGES = [("session", "extend", ([[1, 2]],), {}), list(range(5000)), "stop"]  # a step, a long prompt's ids, stop


def message_run(group, out: str) -> None:
    """Rank 0 announces MESSAGES, the other ranks receive them; each counts its broadcasts."""
    from minillm.parallel import follow as messages

    broadcasts, broadcast = [], messages.dist.broadcast
    messages.dist.broadcast = lambda *args, **kwargs: broadcasts.append(1) or broadcast(*args, **kwargs)
    got = [messages.announce(m) for m in MESSAGES] if group.leader else [messages.received() for _ in MESSAGES]
    torch.save({"got": got, "broadcasts": len(broadcasts)}, f"{out}/rank{group.rank}.pt")


def test_an_announced_message_is_one_broadcast_unless_it_is_long(tmp_path):
    """What the followers receive is what rank 0 announced; a step's message costs one collective, as the cost model
    counts it (`broadcast_object_list` takes two), and only one longer than a broadcast's bytes takes a second."""
    spawn_ranks(2, message_run, str(tmp_path), timeout=60)
    leader, follower = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert follower["got"] == MESSAGES
    assert leader["broadcasts"] == follower["broadcasts"] == len(MESSAGES) + 1


def test_the_split_holds_each_head_unit_and_row_once():
    """Brute force: over the ranks, every query head, hidden unit and vocabulary row is held exactly once; each
    rank's key/value heads are the ones its query heads read (query head h reads h // (H / KV))."""
    for H, KV, hidden, vocab, world in [(9, 3, 1536, 49152, 3), (4, 1, 2048, 262144, 2), (4, 2, 64, 96, 4),
                                        (6, 3, 96, 100, 3), (4, 4, 128, 97, 2)]:
        splits = [Split(r, world, H, KV, hidden, vocab) for r in range(world)]
        for held, size in (("query_heads", H), ("hidden_units", hidden), ("vocab_rows", vocab)):
            every = [i for s in splits for i in getattr(s, held)()]
            assert sorted(every) == list(range(size)), f"{held} over {world} ranks of {H}/{KV} heads"
        for s in splits:
            assert {h // (H // KV) for h in s.query_heads()} == set(s.key_value_heads())
            assert s.replicated_kv == (KV < world)


def test_a_split_the_shapes_do_not_allow_is_refused_in_one_line():
    default = ModelConfig(n_head=9, n_kv_head=3, d_model=576, d_ff=1536)
    with pytest.raises(ValueError, match=r"^--tp 2 does not divide the model's 9 attention heads: use a divisor of 9 "
                                         r"\(1, 3, 9\)$"):
        check_split(default, 2)
    check_split(default, 3)
    with pytest.raises(ValueError, match=r"^--tp 3: the model's 2 key/value heads neither split evenly over 3 "
                                         r"ranks nor repeat evenly on them: use a divisor or a multiple of 2 that "
                                         r"divides 6$"):
        check_split(ModelConfig(n_head=6, n_kv_head=2, d_model=48, d_ff=96), 3)
    check_split(ModelConfig(n_head=12, n_kv_head=3, d_model=576, d_ff=1536), 6)  # each rank repeats one KV head
    check_split(ModelConfig(n_head=4, n_kv_head=1, d_model=640, head_dim=256, d_ff=2048), 2)  # Gemma 3 270M: repeat
    with pytest.raises(ValueError, match=r"MLP's 100 hidden units"):
        check_split(ModelConfig(n_head=8, d_model=64, d_ff=100), 8)
    with pytest.raises(ValueError, match=r"^--tp 9 does not divide the MLP's 1536 hidden units: use a divisor of both 9 "
                                         r"and 1536 \(1, 3\)$"):  # the default model's shapes
        check_split(ModelConfig(n_head=9, n_kv_head=3, d_model=576, d_ff=1536), 9)
    experts = dict(n_head=4, n_kv_head=2, d_model=32, d_ff=64, num_experts=4, experts_per_token=2)
    with pytest.raises(ValueError, match=r"^--tp 4 does not divide each expert's 30 hidden units: use a divisor of "
                                         r"30$"):
        check_split(ModelConfig(**experts, moe_ff=30), 4)
    with pytest.raises(ValueError, match=r"^--tp 4 does not divide the shared experts' 6 hidden units"):
        check_split(ModelConfig(**experts, moe_ff=32, shared_ff=6), 4)


# ------------------------------------------------------------------ the command line, on the real models


def cli(*flags: str, launcher: tuple = (), timeout: int = 300) -> subprocess.CompletedProcess:
    command = [*launcher, *([] if launcher else [sys.executable]), "-m", "minillm.infer", "--no-chat", "--greedy",
               "--json", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def token_ids(run: subprocess.CompletedProcess) -> list[int]:
    assert run.returncode == 0, run.stderr[-500:]
    return json.loads(run.stdout)["token_ids"]


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("model, world", [("default", 3), ("gemma3-270m", 2)])
def test_cli_split_over_ranks_prints_one_process_tokens(model, world):
    """The default model's 9 heads and 3 key/value heads over 3 ranks; Gemma 3 270M's 4 heads over 2, its one
    key/value head repeated on both: greedy tokens equal one process's on a held-out prompt, printed once."""
    flags = ("--model", model, "--prompt", "The lighthouse keeper climbed the stairs and", "--max-new-tokens", "24")
    alone = token_ids(cli(*flags))
    split = cli(*flags, "--tp", str(world), "--stats")
    assert token_ids(split) == alone
    assert f"split over {world} processes (gloo)" in split.stderr
    assert (f"minillm: note: {world} ranks share {os.cpu_count()} cores" in split.stderr) == (world > os.cpu_count())
    assert split.stdout.count("token_ids") == 1  # rank 0 prints; the others compute in silence


@pytest.mark.slow
@pytest.mark.real_model
def test_cli_under_torchrun_prints_one_process_tokens():
    flags = ("--prompt", "Three things every gardener knows:", "--max-new-tokens", "16")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3")
    assert token_ids(cli(*flags, "--tp", "3", launcher=torchrun)) == token_ids(cli(*flags))
    wrong = cli(*flags, "--tp", "2", launcher=(*torchrun[:-1], "2"))
    assert "--tp 2 does not divide the model's 9 attention heads" in wrong.stderr


@pytest.mark.slow
@pytest.mark.real_model
def test_a_split_the_model_does_not_allow_and_a_rank_that_dies_are_one_line():
    refused = cli("--prompt", "Hi", "--tp", "2")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "minillm: error: --tp 2 does not divide the model's 9 attention heads: use a divisor of 9 (1, 3, 9)"]
    refused = cli("--prompt", "Hi", "--tp", "9")  # more ranks than cores, too: refused before any note on sharing them
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "minillm: error: --tp 9 does not divide the MLP's 1536 hidden units: use a divisor of both 9 and 1536 (1, 3)"]
    run = subprocess.Popen([sys.executable, "-m", "minillm.infer", "--no-chat", "--prompt", "Once upon a time",
                            "--max-new-tokens", "2000", "--slide", "--tp", "3"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.stdout.read(20)  # rank 0 streams: every rank is in the loop
    worker = int(Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()[-1])
    os.kill(worker, signal.SIGKILL)
    run.wait(timeout=60)
    lines = run.stderr.read().strip().splitlines()
    assert run.returncode == 2 and lines[-1] == "minillm: error: rank 2 exited (status -9): no message", lines[-3:]
    assert not Path(f"/proc/{run.pid}/task/{run.pid}/children").exists()


class TensorParallelServer:
    """`python -m minillm.serve --tp 3` in a process of its own, started and waited for like a user's."""

    def __init__(self):
        from minillm.base.ports import free_port

        self.port = free_port()
        self.process = subprocess.Popen([sys.executable, "-m", "minillm.serve", "--tp", "3", "--port", str(self.port)],
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        lines = [self.process.stderr.readline()]  # a note on sharing the cores may come first
        while "serving" not in lines[-1] and lines[-1] and len(lines) < 5:
            lines.append(self.process.stderr.readline())
        assert "split over 3 processes (gloo)" in lines[-1], lines
        self.children = [int(pid) for pid in
                         Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()]

    def complete(self, prompt: str, max_tokens: int = 16) -> str:
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0)
        return client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                         temperature=0).choices[0].text

    def stop(self) -> float:
        """SIGTERM; the seconds until the server and every rank it started are gone."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        while any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                  for pid in self.children) and time.monotonic() - start < 30:
            time.sleep(0.1)
        return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.real_model
def test_server_split_over_three_ranks_answers_as_one_process_and_stops_on_sigterm():
    prompts = ["The lighthouse keeper climbed the stairs and", "Three things every gardener knows:",
               "In the winter of 1900, the town"]
    alone = [json.loads(cli("--prompt", p, "--max-new-tokens", "16", "--eager").stdout)["text"] for p in prompts]
    server = TensorParallelServer()
    try:
        with ThreadPoolExecutor(3) as pool:  # at once: the engine batches them, every rank in each step
            assert list(pool.map(server.complete, prompts)) == alone
    finally:
        seconds = server.stop()
    assert server.process.returncode == 0 and seconds < 15


@pytest.mark.slow
@pytest.mark.real_model
def test_server_whose_rank_dies_answers_503_saying_which():
    from openai import APIStatusError

    server = TensorParallelServer()
    try:
        os.kill(server.children[-1], signal.SIGKILL)
        for _ in range(2):  # the request that finds the rank gone, and every one after it
            with pytest.raises(APIStatusError) as error:
                server.complete("Hi", 4)
            assert error.value.status_code == 503
            assert "the server cannot compute: rank 2 exited (status -9)" in error.value.message
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.real_model
def test_notebook_runs(run_notebook):
    run_notebook("20_parallelism.ipynb", timeout=600)
