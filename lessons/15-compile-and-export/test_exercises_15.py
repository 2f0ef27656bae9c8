"""Checks for lesson 15's exercises: `pytest lessons/15-compile-and-export` (yours) or `--solutions`.

References: the session's own mask (`minillm.runtime.session.new_token_mask`), a Python loop over the columns, the
onnxruntime runner's chunking replayed on a recording stub, and graph counts known from how dynamo specialises.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm.runtime.session import new_token_mask
from minillm.speed.onnx_model import OnnxModel


def test_exercise_1_the_mask_is_the_sessions(answers):
    gen = torch.Generator().manual_seed(0)
    for B, T, S in [(1, 1, 16), (1, 5, 16), (3, 4, 32), (2, 1, 7)]:
        starts = torch.randint(0, S - T + 1, (B,), generator=gen)
        positions = starts[:, None] + torch.arange(T)
        mask = answers.mask_from_positions(positions, S)
        assert mask.dtype == torch.bool and mask.shape == (B, T, S)
        expected = new_token_mask(starts, torch.ones(T, T, dtype=torch.bool).tril(), S)
        assert torch.equal(mask, expected), (B, T, S)


def test_exercise_2_the_write_replaces_exactly_the_columns(answers):
    gen = torch.Generator().manual_seed(1)
    B, KV, S, hd, T = 3, 2, 12, 4, 3
    store = torch.randn(B, KV, S, hd, generator=gen)
    original = store.clone()
    new = torch.randn(B, KV, T, hd, generator=gen)
    columns = torch.tensor([[0, 1, 2], [5, 6, 7], [9, 10, 11]])
    out = answers.write_columns(store, new, columns)
    expected = original.clone()
    for b in range(B):
        for t in range(T):
            expected[b, :, columns[b, t]] = new[b, :, t]
    assert torch.equal(out, expected)
    assert torch.equal(store, original), "write_columns must not change its input"


class Recorder(OnnxModel):
    """The runner's prefill with the graph replaced by a note of each run's start and padding."""

    def __init__(self, chunk):
        self.chunk, self.runs = chunk, []

    def empty_cache(self):
        return []

    def step(self, kind, tokens, start, cache):
        self.runs.append((start, len(tokens)))
        return np.zeros((len(tokens), 4), dtype=np.float32), cache


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
def test_exercise_3_chunks_match_the_runner(answers, chunk):
    assert answers.prefill_chunks(5, 8) == [(0, 3)] and answers.prefill_chunks(20, 8) == [(0, 0), (8, 0), (12, 0)]
    for length in range(1, 3 * chunk + 2):
        runner = Recorder(chunk)
        runner.prefill(list(range(length)))
        got = [tuple(run) for run in answers.prefill_chunks(length, chunk)]
        padding = max(chunk - length, 0)
        assert got == [(start, padding) for start, size in runner.runs], (length, chunk)


def test_exercise_4_graphs_counted_as_dynamo_compiles_them(answers):
    def step(x, n):
        return x * n + 1

    x = torch.ones(4)
    assert answers.count_graphs(step, [(x, 2)] * 5) == 1  # same shapes, same number: one graph
    assert answers.count_graphs(step, [(x, 2), (x, 3), (x, 4)]) == 3  # a Python number is baked in
    assert answers.count_graphs(step, [(torch.ones(4), 2), (torch.ones(8), 2)]) == 2  # a new shape
    assert answers.count_graphs(step, [(x, torch.tensor(2)), (x, torch.tensor(3))]) == 1  # a tensor is an input


def _step(x, cache, position):
    cache = cache.index_copy(1, position.reshape(1), x[:, None])
    return cache, cache.sum()


def _step_int(x, cache, position: int):
    cache = cache.clone()
    cache[:, position] = x
    return cache, cache[:, : position + 1].sum()


def _step_flag(x, cache, position, greedy: bool):
    out = cache.sum() + x.sum()
    return out.round() if greedy else out


def _measured_graphs(fn, calls) -> int:
    graphs = 0

    def counting_backend(graph_module, example_inputs):
        nonlocal graphs
        graphs += 1
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=False)
    for args in calls:
        compiled(*args)
    torch._dynamo.reset()
    return graphs


def test_exercise_5_predicted_recompiles_are_the_measured_ones(answers):
    predicted = answers.predict_graphs()
    x, cache = torch.ones(2, 4), torch.zeros(2, 16, 4)
    at = torch.tensor
    scenarios = {
        "tensor_position": (_step, [(x, cache, at(p)) for p in range(10)]),
        "int_position_5": (_step_int, [(x, cache, p) for p in range(5)]),
        "int_position_12": (_step_int, [(x, cache, p) for p in range(12)]),
        "batch_2_3_2": (_step, [(x, cache, at(1)), (torch.ones(3, 4), torch.zeros(3, 16, 4), at(1)),
                                (x, cache, at(1))]),
        "flag_toggled": (_step_flag, [(x, cache, at(1), greedy) for greedy in (True, False, True, False)]),
        "dtype_change": (_step, [(x, cache, at(1)), (x.bfloat16(), cache.bfloat16(), at(1))]),
        "growing_cache": (_step, [(x, torch.zeros(2, 4 + p, 4), at(p)) for p in range(5)]),
    }
    assert set(predicted) == set(scenarios), f"predict exactly these scenarios: {sorted(scenarios)}"
    wrong = {name: (predicted[name], _measured_graphs(fn, calls)) for name, (fn, calls) in scenarios.items()}
    wrong = {name: counts for name, counts in wrong.items() if counts[0] != counts[1]}
    assert not wrong, "predicted vs measured graphs: " + ", ".join(f"{n} {p} vs {m}" for n, (p, m) in wrong.items())
