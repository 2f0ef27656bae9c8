"""The course's cost model (minillm/costmodel/; lessons/cost-model/README.md): exact counts, and the bands it states.

The counts are checked exactly against independent computations (the model's own
`num_weight_bytes`, the dispatcher's op count, an enumeration of acceptance patterns), and the
stored runs' own accounting against the formulas. The forecast and its verdicts (one band for the
course, results/predictions.json) are tests/test_predictions.py's.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minillm.cache.kv_cache import StaticCache
from minillm.costmodel.model import (
    SMOLLM2_135M,
    Machine,
    Step,
    collective_seconds,
    decode_step,
    eager_ops,
    forward_flops,
    kv_bytes_per_token,
    log_interpolate,
    matmul_flops,
    packed_step,
    predict,
    shard_config,
    sharded_decode_step,
    weight_bytes,
)
from minillm.costmodel.probes import count_ops
from minillm.model.tiny import TINY_KINDS, tiny_pair
from minillm.strategies.acceptance import expected_tokens_per_round

RESULTS = Path(__file__).resolve().parent.parent / "results"


def stored(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


# --- Formulas, exactly. ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", TINY_KINDS)
def test_bytes_of_a_decode_step_are_the_weights_and_the_cache(kind):
    model = tiny_pair(kind)[1]
    config = model.config
    assert weight_bytes(config) == model.num_weight_bytes()
    cache = StaticCache.for_model(model, batch=3, max_len=20)
    assert 20 * kv_bytes_per_token(config) * 3 == cache.k.nbytes + cache.v.nbytes
    step = decode_step(config, batch=3, context=20)
    assert step.weight_bytes + step.kv_bytes == model.num_weight_bytes() + cache.k.nbytes + cache.v.nbytes


def test_the_default_model_counts_match_what_the_suites_stored():
    assert weight_bytes(SMOLLM2_135M) == stored("decode")["results"]["float32"]["weight_bytes"]
    assert weight_bytes(SMOLLM2_135M, 2.0, norm_bytes=2.0) == stored("decode")["results"]["bfloat16"]["weight_bytes"]
    assert kv_bytes_per_token(SMOLLM2_135M) == stored("serving")["rows"][0]["continuous"]["bytes_per_token"]


def test_flops_of_a_matmul_and_of_a_forward():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    assert matmul_flops(3, 5, 7) == 2 * a.shape[0] * b.shape[1] * a.shape[1]  # one multiply and one add per term
    c = SMOLLM2_135M
    per_token = 2 * c.n_layer * (c.d_model * (c.n_head + 2 * c.kv_heads) * c.head_size
                                 + c.n_head * c.head_size * c.d_model + 3 * c.d_model * c.ff_size)
    head = 2 * c.d_model * c.vocab_size
    # one token after 9 cached: 10 keys per head and layer, 2 flops per q·k and per p·v term
    assert forward_flops(c, 1, 10) == per_token + c.n_layer * c.n_head * 4 * c.head_size * 10 + head
    # 4 tokens from scratch: 1 + 2 + 3 + 4 visible keys
    assert forward_flops(c, 4, 4) == 4 * per_token + c.n_layer * c.n_head * 4 * c.head_size * 10 + head


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.9])
def test_tokens_per_forward_equals_enumerating_every_acceptance_pattern(alpha, k):
    """E = (1 - α^(k+1)) / (1 - α): a round keeps drafts up to the first rejection, plus the target's own token."""
    expected = 0.0
    for pattern in itertools.product((True, False), repeat=k):
        probability = 1.0
        for accepted in pattern:
            probability *= alpha if accepted else 1 - alpha
        run = next((i for i, accepted in enumerate(pattern) if not accepted), k)
        expected += probability * (run + 1)
    assert expected_tokens_per_round(alpha, k) == pytest.approx(expected, rel=1e-12)
    step = decode_step(SMOLLM2_135M, tokens_per_row=k + 1, acceptance=alpha)
    assert step.tokens == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_op_count_of_an_eager_decode_step_is_what_the_dispatcher_sees(kind):
    model = tiny_pair(kind)[1]
    cache = StaticCache.for_model(model, batch=1, max_len=16)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache=cache)
        ops = count_ops(lambda: model(torch.tensor([[4]]), torch.tensor([[3]]), cache=cache))
    assert ops.total() == eager_ops(model.config), ops
    assert decode_step(model.config).ops == ops.total()


def test_op_count_of_a_packed_engine_step_is_what_the_dispatcher_sees():
    """Lesson 12's packed steps, as the engine runs them with requests coming and going: prompt chunks alone,
    one-token rows alone, and both in one step; `packed_step` counts each step's ops exactly."""
    from minillm.decoding.sampling import SamplingConfig
    from minillm.runtime.engine import Engine

    model = tiny_pair("llama")[1]
    model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))  # the RoPE tables are built once, on the first forward
    engine = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    step, seen = engine.runner.step, []

    def counted(packed, tokens, logits_at, copies):
        out = {}
        ops = count_ops(lambda: out.setdefault("logits", step(packed, tokens, logits_at, copies))).total()
        decodes, chunks = len(packed.decode_queries), len(packed.chunks)
        predicted = packed_step(model.config, tokens.numel() - decodes, decodes, chunks, keys=0).ops
        seen.append((decodes, chunks, ops, predicted))
        return out["logits"]

    engine.runner.step = counted
    engine.add_request([1, 2, 3, 4, 5], SamplingConfig(max_new_tokens=6, eos_token_id=()))
    engine.step(), engine.step()
    for prompt in ([6, 7, 8], [9, 10, 11, 12]):
        engine.add_request(prompt, SamplingConfig(max_new_tokens=3, eos_token_id=()))
    engine.step()
    for prompt in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        engine.add_request(prompt, SamplingConfig(max_new_tokens=3, eos_token_id=()))
    while engine.has_unfinished():
        engine.step()
    kinds = {(decodes > 0, chunks) for decodes, chunks, _, _ in seen}
    assert {(False, 1), (True, 0), (True, 2), (True, 3)} <= kinds, kinds
    assert [(d, c, ops) for d, c, ops, predicted in seen if ops != predicted] == []


def test_predict_is_the_roofline_plus_overhead():
    from minillm.costmodel.model import Machine

    machine = Machine(bandwidth=10.0, peak_flops=100.0, op_seconds=0.5, sync_seconds=2.0)
    assert predict(Step(weight_bytes=30, kv_bytes=10, flops=200, ops=2, syncs=1), machine) == 4.0 + 1.0 + 2.0
    assert predict(Step(weight_bytes=1, flops=1000, ops=0), machine) == 10.0  # compute-bound


# --- The stored runs' own accounting. ------------------------------------------------------------------------------

def test_every_stored_speculative_prediction_is_the_current_formula():
    """results/speculative.json stores each run's predicted speed-up; notebook 08 prints it beside the table of
    `comparisons('08')`: both must be `model_speedup` of the stored acceptance, verify and draft costs."""
    from minillm.bench.speculative import model_speedup

    data = stored("speculative")
    verify = {int(k): cost for k, cost in data["verify_cost"].items()}
    for task in data["tasks"].values():
        for name, by_k in task["contenders"].items():
            for k, row in by_k.items() if name.startswith("minillm ") else ():
                share = row["acceptance_rate"]
                if share is not None and share == share and "predicted_speedup" in row:  # NaN: nothing drafted
                    assert row["predicted_speedup"] == pytest.approx(
                        model_speedup(name, int(k), share, verify, data["draft_cost_ratio"])), (name, k)


def test_no_round_keeps_more_than_its_draft_says():
    """Lesson 08's accounting: a round keeps its accepted drafts and one token of the target's, so tokens per forward
    are at most 1 + k · share (equal when every round drafts k: prompt lookup drafts fewer, or nothing, when its
    n-gram runs out), and with k = 1 a drafted round keeps 1 + a on average: mostly-accepted runs sit at the bound."""
    for task in stored("speculative")["tasks"].values():
        for name, by_k in task["contenders"].items():
            for k, row in by_k.items() if name.startswith("minillm ") else ():
                if row["acceptance_rate"] == row["acceptance_rate"]:  # NaN: nothing was drafted
                    assert row["tokens_per_target_forward"] <= 1 + int(k) * row["acceptance_rate"] + 1e-9, (name, k)
        one = task["contenders"]["minillm prompt-lookup"]["1"]
        if one["acceptance_rate"] >= 0.5:
            assert one["tokens_per_target_forward"] == pytest.approx(
                expected_tokens_per_round(one["acceptance_rate"], 1), rel=0.02)


def test_the_cost_model_page_lists_the_lessons_it_checks():
    """lessons/cost-model/README.md lists, one table row each, exactly the lessons the forecast has rows for
    (`minillm.bench.predict`), and states no band in them: the one band lives in the code and the forecast."""
    from minillm.bench.predict import forecasts
    from minillm.costmodel.model import Machine

    page = (Path(__file__).resolve().parent.parent / "lessons" / "cost-model" / "README.md").read_text()
    rows = re.findall(r"^\| (\d\d) \| ([^|]+) \|$", page, flags=re.M)
    lessons = {row["lesson"] for row in forecasts(Machine(30e9, 300e9, 2e-6, 0.2e-6))}
    assert sorted(lesson for lesson, _ in rows) == sorted(lessons)
    assert [what for _, what in rows if re.search(r"\d(?:\.\d+)?\s?-\s?\d", what)] == []


def test_a_sharded_step_reads_its_share_and_waits_in_two_collectives_per_block():
    """Lesson 20's step, by its definition: on one memory bus the ranks' weight reads take as long as one
    process's (each reads 1/ranks of the bytes at 1/ranks of the bandwidth), with a bus each they take 1/ranks of
    it (the same bytes of the head, norms and biases aside); every rank then waits in 2 all-reduces per block, one
    for the embedding, the logits' gather and the step's message, each priced at the probed all-reduce."""
    config = SMOLLM2_135M
    probed = {3: ((256, 1e-4), (4096, 2e-4))}
    machine = Machine(bandwidth=20e9, peak_flops=1e15, op_seconds=0.0, sync_seconds=0.0, allreduce=probed)
    alone = decode_step(config)
    shared, own = sharded_decode_step(config, 3, memory_buses=1), sharded_decode_step(config, 3, memory_buses=3)
    assert shared.collectives == own.collectives == 2 * config.n_layer + 3 and shared.ranks == 3
    assert shared.collective_bytes == config.d_model * 4  # one row's activations, 2304 bytes
    per_collective = log_interpolate(probed[3], 2304)
    assert 1e-4 < per_collective < 2e-4
    assert collective_seconds(shared, machine) == pytest.approx(63 * per_collective)
    assert shared.weight_bytes == pytest.approx(alone.weight_bytes, rel=0.01)  # the bus shared: no faster
    assert own.weight_bytes == pytest.approx(alone.weight_bytes / 3, rel=0.01)
    assert shard_config(config, 3).n_head == 3 and shard_config(config, 3).kv_heads == 1
    gemma = replace(config, n_head=4, n_kv_head=1)
    assert shard_config(gemma, 2).kv_heads == 1  # a repeated key/value head: each rank caches all of it
    assert predict(shared, machine) == pytest.approx(predict(replace(shared, collectives=0), machine)
                                                     + 63 * per_collective)
    assert collective_seconds(shared, replace(machine, allreduce={})) == 0.0  # an unprobed group: no term
    assert collective_seconds(alone, machine) == 0.0
