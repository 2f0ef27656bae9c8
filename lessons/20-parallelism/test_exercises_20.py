"""Checks for lesson 20's exercises: `pytest lessons/20-parallelism` (yours) or `--solutions`.

References: minillm's `MLP` and `F.embedding` (with the weights no rank holds changed, to catch a rank that reads
them); a brute force of the heads each rank's query heads read and the package's `check_split`; integer sums and
a count of what each rank sends; the course's cost model (`sharded_decode_step`, `predict`).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from minillm.costmodel.model import SMOLLM2_135M, Machine, decode_step, predict, sharded_decode_step
from minillm.model.config import ModelConfig
from minillm.model.transformer import MLP
from minillm.parallel.shard import check_split


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exercise_1_partials_add_up_to_the_mlp_and_each_reads_only_its_units(answers, world):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=8, n_layer=1, n_head=2, d_model=16, d_ff=24, mlp="swiglu", bias=False)
    mlp = MLP(config).eval()
    x = torch.randn(2, 3, 16)
    gate_up, down = mlp.fc.weight.detach(), mlp.proj.weight.detach()
    with torch.no_grad():
        partials = answers.megatron_mlp_partials(x, gate_up, down, world)
        assert len(partials) == world and all(p.shape == (2, 3, 16) for p in partials)
        torch.testing.assert_close(sum(partials), mlp(x), rtol=1e-5, atol=1e-5)
        per = 24 // world
        for r in range(world):  # every weight another rank holds, changed: rank r's partial must not move
            others = torch.ones(24, dtype=torch.bool)
            others[r * per:(r + 1) * per] = False
            changed_gate_up, changed_down = gate_up.clone(), down.clone()
            changed_gate_up[torch.cat([others, others])] = torch.randn(int(others.sum()) * 2, 16)
            changed_down[:, others] = torch.randn(16, int(others.sum()))
            again = answers.megatron_mlp_partials(x, changed_gate_up, changed_down, world)
            torch.testing.assert_close(again[r], partials[r], rtol=0, atol=0)


def heads_read(n_head: int, kv_heads: int, world: int, rank: int) -> set[int]:
    """Brute force: the key/value heads the query heads of `rank` read."""
    per = n_head // world
    return {q // (n_head // kv_heads) for q in range(rank * per, (rank + 1) * per)}


def test_exercise_2_each_rank_holds_the_heads_its_queries_read(answers):
    for n_head, world in itertools.product(range(1, 13), range(1, 9)):
        for kv in (k for k in range(1, n_head + 1) if n_head % k == 0):
            config = ModelConfig(vocab_size=8, n_layer=1, n_head=n_head, n_kv_head=kv, d_model=8 * n_head,
                                 head_dim=8, d_ff=8 * world)
            try:
                check_split(config, world)
                allowed = True
            except ValueError:
                allowed = False
            if not allowed:
                with pytest.raises(ValueError):
                    answers.kv_heads_for(n_head, kv, world, 0)
                continue
            held = [answers.kv_heads_for(n_head, kv, world, rank) for rank in range(world)]
            for rank, heads in enumerate(held):
                assert isinstance(heads, range) and set(heads) == heads_read(n_head, kv, world, rank), \
                    (n_head, kv, world, rank)
            assert sum(len(h) for h in held) == max(kv, world)  # split: each once; repeated: one copy per rank


@pytest.mark.parametrize("vocab, world", [(12, 3), (10, 3), (7, 4), (9, 1)])
def test_exercise_3_lookups_add_up_exactly_and_each_reads_only_its_rows(answers, vocab, world):
    torch.manual_seed(1)
    weight = torch.randn(vocab, 5)
    tokens = torch.randint(0, vocab, (3, 7))
    partials = answers.embedding_partials(tokens, weight, world)
    assert len(partials) == world
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    assert torch.equal(total, F.embedding(tokens, weight))
    per = -(-vocab // world)
    for r in range(world):
        changed = torch.randn(vocab, 5)
        changed[r * per:(r + 1) * per] = weight[r * per:(r + 1) * per]
        assert torch.equal(answers.embedding_partials(tokens, changed, world)[r], partials[r])


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_exercise_4_the_ring_sums_and_each_rank_sends_two_p_minus_one_over_p(answers, ranks):
    n = 6 * ranks
    tensors = [torch.randint(-50, 50, (n,)).float() for _ in range(ranks)]
    inputs = [t.clone() for t in tensors]
    sent = {rank: [] for rank in range(ranks)}

    def send(src, chunk):
        sent[src].append(chunk.numel())
        return chunk.clone()

    results = answers.ring_allreduce(tensors, send)
    assert all(torch.equal(t, i) for t, i in zip(tensors, inputs)), "the inputs were modified"
    total = torch.stack(inputs).sum(0)
    assert len(results) == ranks and all(torch.equal(result, total) for result in results)
    for rank in range(ranks):
        assert sent[rank] == [n // ranks] * (2 * (ranks - 1)), (rank, sent[rank])


EIGHT_HEADS = replace(SMOLLM2_135M, n_layer=16, n_head=8, n_kv_head=8, d_model=1024, d_ff=4096, vocab_size=32000)


@pytest.mark.parametrize("config, ranks, buses", [(SMOLLM2_135M, 3, 3), (SMOLLM2_135M, 3, 1), (EIGHT_HEADS, 2, 2),
                                                  (EIGHT_HEADS, 4, 2), (EIGHT_HEADS, 8, 8)])
def test_exercise_5_the_cost_model_breaks_even_at_your_latency(answers, config, ranks, buses):
    machine = Machine(bandwidth=40e9, peak_flops=1e18, op_seconds=0.0, sync_seconds=0.0)  # bytes alone
    alone = predict(decode_step(config), machine)
    collectives = 2 * config.n_layer + 3
    latency = answers.breakeven_latency(alone, ranks, buses, collectives)
    if buses == 1:
        assert latency == 0
        return

    def split(seconds):
        probed = replace(machine, allreduce={ranks: ((1, seconds), (10**9, seconds))})
        return predict(sharded_decode_step(config, ranks, memory_buses=buses), probed)

    assert split(latency) == pytest.approx(alone, rel=0.01)
    assert split(0.8 * latency) < alone < split(1.25 * latency)
