"""Worked answers for lesson 15's exercises (lessons/15-compile-and-export/exercises.py).

Check them: `pytest lessons/15-compile-and-export --solutions`.
"""

from __future__ import annotations

import torch

# ------------------------------------------------------------------ Exercise 1


def mask_from_positions(positions: torch.Tensor, num_columns: int) -> torch.Tensor:
    """Exercise 1: The mask from the positions"""
    columns = torch.arange(num_columns, device=positions.device)  # [S]
    return columns <= positions[:, :, None]  # [B, T, S] by broadcasting
    # In the session's layout the column of a token is its position, so "up to my position" is causal over the
    # prompt and the cached prefix at once, and it hides every column past the row's end.


# ------------------------------------------------------------------ Exercise 2


def write_columns(store: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exercise 2: A cache write a graph can hold"""
    index = columns[:, None, :, None].expand_as(new)  # [B, KV, T, hd]: the column for every element of `new`
    return store.scatter(2, index, new)
    # An exported graph uses this functional scatter and returns the result as its `present_*` output. The
    # compiled step writes the cache storage in place with an indexed assignment (store[rows, :, columns] = new),
    # which Inductor keeps in place. Slicing store[:, :, p:p + T] with a Python p would bake p into the graph: a
    # new graph every step.


# ------------------------------------------------------------------ Exercise 3


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """Exercise 3: A prompt through a fixed-length prefill graph"""
    if length <= chunk:
        return [(0, chunk - length)]
    starts = list(range(0, length - chunk, chunk)) + [length - chunk]
    return [(start, 0) for start in starts]
    # The overlap recomputes a few keys that are already in the cache; they come out the same, since the
    # tokens before them are the same. Padding instead would write past the prompt's end, which near the end of
    # the context may not fit.


# ------------------------------------------------------------------ Exercise 4


def count_graphs(fn, calls: list[tuple]) -> int:
    """Exercise 4: Count the graphs"""
    graphs = 0

    def counting_backend(graph_module, example_inputs):
        nonlocal graphs
        graphs += 1
        return graph_module.forward  # run the traced graph as it is

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=False)
    for args in calls:
        compiled(*args)
    return graphs
    # minillm.speed.compile.CompiledModel counts its Inductor graphs the same way (CompiledModel.graphs).


# ------------------------------------------------------------------ Exercise 5


def predict_graphs() -> dict[str, int]:
    """Exercise 5: Predict the recompiles"""
    # With dynamic=False, dynamo specialises a graph on every input's shape, dtype and device and on the value of
    # every Python number or bool it reads; guards check them on each call, and a failed guard compiles again.
    limit = torch._dynamo.config.recompile_limit  # 8 in torch 2.x: graphs kept per function before giving up
    return {
        "tensor_position": 1,  # a tensor's value is data, not a guard: one graph serves every position
        "int_position_5": 5,  # a Python int is baked in as a constant: a graph per position
        "int_position_12": min(12, limit),  # after `limit` graphs dynamo stops compiling it and runs it eagerly:
        # the decode loop silently falls back to eager speed (a warning in the log, nothing else)
        "batch_2_3_2": 2,  # a new batch size is a new shape; going back to 2 finds the first graph still cached
        "flag_toggled": 2,  # a Python bool picks a branch while tracing: one graph per value, both kept
        "dtype_change": 2,  # dtype is guarded like shape
        "growing_cache": 5,  # S changes every step: a new shape, a new graph, every step
    }
    # A compiled decode loop must avoid the int position, the growing cache and a changing batch: the package's
    # step (speed/compile.py) takes positions and write columns as tensors, writes into a cache allocated once at
    # its full length (StaticCache, mask over the unwritten columns), and keeps every row in the batch until the
    # run ends (finished rows are ignored, not dropped), so one graph serves every step. Settings that change a
    # branch (greedy or not) belong outside the graph: the step returns logits and sampling runs eagerly.
