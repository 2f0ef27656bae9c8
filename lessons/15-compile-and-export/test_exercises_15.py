"""Checks for lesson 15's exercises: `pytest lessons/15-compile-and-export` (yours) or `--solutions`.

References: a ring-buffer cache simulated write by write, a Python loop over the columns, the onnxruntime runner's
chunking replayed on a recording stub, and graphs counted by a counting backend as dynamo hands them over.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from minillm.speed.onnx_model import OnnxModel


def ring_mask_by_simulation(positions: torch.Tensor, num_columns: int, window: int) -> torch.Tensor:
    """Write every position of each row into a ring of columns, one at a time; then read off what each query sees."""
    B, T = positions.shape
    mask = torch.zeros(B, T, num_columns, dtype=torch.bool)
    for b in range(B):
        held = [-1] * num_columns  # -1: not written by this row yet
        for q in range(int(positions[b, -1]) + 1):
            held[q % num_columns] = q
        for t, p in enumerate(positions[b].tolist()):
            for c in range(num_columns):
                mask[b, t, c] = held[c] >= 0 and p - window < held[c] <= p
            assert mask[b, t].sum() == min(window, p + 1)  # the ring is large enough: every key in the window kept
    return mask


@pytest.mark.parametrize("B, T, S, window", [(1, 1, 8, 8), (3, 1, 8, 8), (2, 4, 11, 8), (3, 4, 16, 8),
                                             (2, 5, 12, 4), (2, 3, 3, 1)])
def test_exercise_1_the_ring_mask_is_the_simulated_ring(answers, B, T, S, window):
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + S)

    def positions():
        starts = torch.randint(0, 4 * S, (B,), generator=gen)  # rows before the ring wraps and after
        if B > 1:
            starts[0] = 0  # a row at the start of its run: most columns not reached yet
            starts[-1] = max(int(starts[-1]), S - T + 1)  # a row that has gone round the ring at least once
        return starts[:, None] + torch.arange(T)

    first = positions()
    mask = answers.mask_from_positions(first, S, window)
    assert mask.dtype == torch.bool and mask.shape == (B, T, S)
    assert torch.equal(mask, ring_mask_by_simulation(first, S, window)), f"positions {first.tolist()}"
    try:  # trace once, as an exported graph is, then run the trace at other positions
        traced = make_fx(lambda p: answers.mask_from_positions(p, S, window))(first)
    except RuntimeError as error:
        pytest.fail(f"the mask could not be traced into a graph (a Python value read from a tensor?): {error}")
    for _ in range(4):
        other = positions()
        assert torch.equal(traced(other), ring_mask_by_simulation(other, S, window)), (
            f"traced at {first.tolist()}, the mask is wrong at {other.tolist()}: does it bake in a Python value?")


def _write_case():
    gen = torch.Generator().manual_seed(1)
    B, KV, S, hd, T = 2, 2, 24, 8, 3  # a store shape nothing else in the step has
    store = torch.randn(B, KV, S, hd, generator=gen)
    new = torch.randn(B, KV, T, hd, generator=gen)
    columns = torch.tensor([[0, 1, 2], [9, 10, 23]])
    expected = store.clone()
    for b in range(B):
        for t in range(T):
            expected[b, :, columns[b, t]] = new[b, :, t]
    return store, new, columns, expected


@pytest.mark.parametrize("name, op", [("write_by_index_put", "index_put"), ("write_by_scatter_", "scatter")])
def test_exercise_2_both_writes_replace_exactly_the_columns_in_place(answers, name, op):
    from torch.fx.experimental.proxy_tensor import make_fx

    store, new, columns, expected = _write_case()
    out = getattr(answers, name)(store, new, columns)
    assert out is store, f"{name} must write into store itself and return it"
    assert torch.equal(store, expected), "a Python loop over the columns wrote other values"
    traced = make_fx(lambda s, n, c: getattr(answers, name)(s, n, c))(*_write_case()[:3])
    ops = [str(node.target) for node in traced.graph.nodes if node.op == "call_function"]
    assert any(op in target for target in ops), f"{name} traced as {ops}: write it with one {op}"
    other = "scatter" if op == "index_put" else "index_put"
    assert not any(other in target for target in ops), f"{name} traced as {ops}: write it with {op} only"


def test_exercise_2_predicted_whole_layer_copies_are_in_the_generated_code(answers, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    predicted = answers.predicted_whole_layer_copies()
    monkeypatch.setitem(sys.modules, answers._module.__name__, answers._module)  # dynamo reads the answers' globals
    assert set(predicted) == {"index_put", "scatter_"}, "predict for exactly 'index_put' and 'scatter_'"
    measured = {}
    for key, name in (("index_put", "write_by_index_put"), ("scatter_", "write_by_scatter_")):
        store, new, columns, expected = _write_case()
        torch._dynamo.reset()
        _, codes = run_and_get_code(torch.compile(getattr(answers, name), dynamic=False), store, new, columns)
        assert torch.equal(store, expected), f"compiled, {name} wrote other values"
        wrapper = codes[-1]  # the Python wrapper: its `call` allocates buffers and calls the generated kernels
        measured[key] = f"empty_strided_cpu({tuple(store.shape)}" in wrapper  # a buffer the size of the layer
    torch._dynamo.reset()
    assert measured == {"index_put": False, "scatter_": True}, f"the generated code: {measured}"
    assert dict(predicted) == measured, f"predicted {predicted}, the generated code says {measured}"


class Recorder(OnnxModel):
    """The runner's prefill with the graph replaced by a note of each run's start and padding."""

    def __init__(self, chunk):
        self.chunk, self.runs = chunk, []

    def empty_cache(self):
        return []

    def step(self, kind, tokens, start, cache):
        self.runs.append((start, len(tokens)))
        return np.zeros((len(tokens), 4), dtype=np.float32), cache


def runner_chunks(length, chunk):
    runner = Recorder(chunk)
    runner.prefill(list(range(length)))
    return [(start, max(chunk - length, 0)) for start, size in runner.runs]


def test_exercise_3_predicted_chunks(answers):
    predicted = answers.predicted_chunks()
    assert set(predicted) == {1, 8, 9, 16, 17}, "predict for prompts of 1, 8, 9, 16 and 17 tokens"
    wrong = {length: ([tuple(run) for run in runs], runner_chunks(length, 8)) for length, runs in predicted.items()
             if [tuple(run) for run in runs] != runner_chunks(length, 8)}
    assert not wrong, "predicted vs the runner's (start, padding): " + "; ".join(
        f"{length} tokens: {p} vs {r}" for length, (p, r) in wrong.items())


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
def test_exercise_3_chunks_match_the_runner(answers, chunk):
    assert answers.prefill_chunks(5, 8) == [(0, 3)] and answers.prefill_chunks(20, 8) == [(0, 0), (8, 0), (12, 0)]
    for length in range(1, 3 * chunk + 2):
        got = [tuple(run) for run in answers.prefill_chunks(length, chunk)]
        assert got == runner_chunks(length, chunk), (length, chunk)


def _scale_rows(x):
    return x / x.abs().amax(-1, keepdim=True)


def _times(x, n: int):
    return x * n


def test_exercise_4_predicted_graphs_with_dynamic_shapes_are_the_measured_ones(answers):
    predicted = answers.predict_dynamic_graphs()
    rows = [(torch.ones(T, 4),) for T in range(2, 8)]
    scenarios = {  # name: (function, calls, torch.compile's `dynamic`)
        "static": (_scale_rows, rows, False),
        "default": (_scale_rows, rows, None),
        "default_then_one": (_scale_rows, rows + [(torch.ones(1, 4),)], None),
        "dynamic": (_scale_rows, rows, True),
        "default_int": (_times, [(torch.ones(4, 4), n) for n in range(2, 8)], None),
    }
    assert set(predicted) == set(scenarios), f"predict exactly these scenarios: {sorted(scenarios)}"
    measured = {name: _measured_graphs(fn, calls, dynamic) for name, (fn, calls, dynamic) in scenarios.items()}
    wrong = {name: (predicted[name], measured[name]) for name in scenarios if predicted[name] != measured[name]}
    assert not wrong, "predicted vs measured graphs: " + ", ".join(f"{n} {p} vs {m}" for n, (p, m) in wrong.items())


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


def _measured_graphs(fn, calls, dynamic: bool | None = False) -> int:
    """How many graphs torch.compile(fn, dynamic=dynamic) hands its backend over `calls`, from a fresh start."""
    graphs = 0

    def counting_backend(graph_module, example_inputs):
        nonlocal graphs
        graphs += 1
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=dynamic)
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
