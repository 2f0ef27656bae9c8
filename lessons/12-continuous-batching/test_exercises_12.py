"""Checks for lesson 12's exercises: `pytest lessons/12-continuous-batching` (yours) or `--solutions`.

References: the package's slot mapping, pool gather and block manager (`minillm.cache.paged`), a brute-force count of
shared blocks, each prompt's own forward on a tiny model, and the benchmark's `summarize` with NumPy's percentiles.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from minillm.bench.serving import Served, summarize
from minillm.cache.blocks import BlockManager, blocks_for
from minillm.cache.paged import PagedKVCache, slot_mapping
from minillm.model.tiny import tiny_pair


def test_exercise_1_slots_follow_the_block_table(answers):
    assert answers.slot_of([7, 2], 5, 4) == 9
    rng = random.Random(0)
    for _ in range(20):
        block_size = rng.randint(1, 6)
        table = rng.sample(range(40), rng.randint(1, 6))
        for position in range(len(table) * block_size):
            assert answers.slot_of(table, position, block_size) == slot_mapping(table, [position], block_size).item()
    with pytest.raises(ValueError):
        answers.slot_of([3], 4, 4)


def test_exercise_1_gathered_keys_are_the_sequence_in_order(answers):
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, 2, 8, num_blocks=12, block_size=3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    for table, length in (([5, 0, 11], 7), ([3], 1), ([9, 8, 7, 6], 12)):
        expected, _ = cache.gather(0, table, length)
        assert torch.equal(answers.gather_keys(cache.k[0], table, length), expected)


def held_by_the_block_manager(prompts, block_size) -> int:
    manager = BlockManager(sum(blocks_for(len(p), block_size) for p in prompts), block_size)
    for i, prompt in enumerate(prompts):
        manager.allocate(i, prompt)
        manager.mark_computed(i, len(prompt))
    return manager.num_blocks - manager.num_free


def test_exercise_2_shared_blocks_are_counted_once(answers):
    assert answers.blocks_held([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], 2) == 4
    assert answers.blocks_held([[1, 2, 3, 4], [1, 2, 3, 4]], 2) == 3
    rng = random.Random(2)
    for _ in range(40):
        block_size = rng.randint(1, 4)
        systems = [[rng.randint(0, 2) for _ in range(rng.randint(0, 9))] for _ in range(2)]
        prompts = [rng.choice(systems) + [rng.randint(0, 2) for _ in range(rng.randint(1, 6))]
                   for _ in range(rng.randint(1, 5))]
        assert answers.blocks_held(prompts, block_size) == held_by_the_block_manager(prompts, block_size), prompts


def test_exercise_3_a_packed_forward_equals_each_prompt_alone(answers):
    assert answers.packed_mask([2, 1]).tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    assert answers.packed_positions([2, 1]).tolist() == [0, 1, 0]
    for kind in ("gpt2", "llama"):
        model = tiny_pair(kind, seed=0)[1]
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 96, (n,), generator=g) for n in (5, 1, 12, 7)]
        lengths = [len(p) for p in prompts]
        packed = torch.cat(prompts)[None]
        with torch.no_grad():
            logits = model(packed, answers.packed_positions(lengths)[None], mask=answers.packed_mask(lengths)[None])
            start = 0
            for prompt in prompts:
                alone = model(prompt[None], torch.arange(len(prompt))[None])
                torch.testing.assert_close(logits[:, start : start + len(prompt)], alone, atol=1e-5, rtol=1e-5)
                start += len(prompt)


def test_exercise_4_metrics_equal_the_benchmarks(answers):
    rng = np.random.default_rng(4)
    arrivals = sorted(rng.uniform(0, 5, 30).tolist())
    token_times = []
    for a in arrivals:
        n = int(rng.integers(1, 12))
        token_times.append((a + np.cumsum(rng.exponential(0.2, n))).tolist())
    mine = answers.serving_metrics(arrivals, token_times)
    reference = summarize([Served(a, t) for a, t in zip(arrivals, token_times)], slo_ttft=1.0, slo_tpot=1.0)
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert mine[name] == pytest.approx((reference[name]["p50"], reference[name]["p99"]))
    ttft = [t[0] - a for a, t in zip(arrivals, token_times)]
    assert mine["ttft"] == pytest.approx(tuple(np.percentile(ttft, [50, 99])))
    assert mine["tokens_per_second"] == pytest.approx(reference["tokens_per_second"])
