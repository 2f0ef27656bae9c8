"""Lesson 15 exercises: write your answers here; `pytest lessons/15-compile-and-export` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/15_compile_and_export.py (try first!).

Conventions: the cache is fixed-shape, [B, n_kv_head, S, head_dim], and row b's token at position p sits in
column p; a mask is bool, True where a query may attend to a key.
"""

from __future__ import annotations

import torch  # noqa: F401


def mask_from_positions(positions: torch.Tensor, num_columns: int) -> torch.Tensor:
    """Exercise 1: The mask from the positions

    positions: long [B, T], the positions of T new tokens per row. Return the bool mask [B, T, S] (S =
    num_columns) that an exported graph computes for itself: a token sees every column up to and including its
    own position, and no column after it (those are not written yet, or hold another run's leftovers).

    Use tensor operations only (no Python loop, no `.item()`): the mask must be traceable into a graph.
    """
    raise NotImplementedError


def write_columns(store: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exercise 2: A cache write a graph can hold

    store [B, KV, S, hd]: a fixed-shape cache; new [B, KV, T, hd]: T new keys per row; columns: long [B, T],
    where row b's t-th new key goes. Return a new tensor equal to `store` with those columns replaced (leave
    `store` itself unchanged), using one indexed operation and no Python loop: the columns are a tensor, so one
    graph serves every step.
    """
    raise NotImplementedError


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """Exercise 3: A prompt through a fixed-length prefill graph

    A prefill graph takes exactly `chunk` tokens. Return the (start, padding) of each run of the graph for a
    prompt of `length` tokens, following `minillm.speed.onnx_model`: a prompt of at most `chunk` tokens is one run
    from 0, padded with `chunk - length` tokens; a longer one runs chunks from 0, chunk, 2·chunk, ... while a
    whole chunk fits before the prompt's end, and then one last chunk that ends exactly at the prompt's end
    (overlapping the previous one, no padding).

    Example: length 5, chunk 8 -> [(0, 3)]; length 20, chunk 8 -> [(0, 0), (8, 0), (12, 0)].
    """
    raise NotImplementedError


def count_graphs(fn, calls: list[tuple]) -> int:
    """Exercise 4: Count the graphs

    Compile `fn` with `torch.compile` and a backend of your own that counts the graphs it is handed and returns
    each graph unchanged (no Inductor: only tracing is measured, and it is quick). Call the compiled function
    with each argument tuple in `calls`, in order, and return how many graphs were compiled. Pass
    `dynamic=False`, so that every new shape or Python number compiles a new graph, as the compiled decode step
    is set up. Start from a fresh compile (`torch._dynamo.reset()`), so earlier calls do not count.
    """
    raise NotImplementedError


def predict_graphs() -> dict[str, int]:
    """Exercise 5: Predict the recompiles

    Predict, before running anything, how many graphs `torch.compile(step, dynamic=False)` builds in each
    scenario below (each from a fresh `torch._dynamo.reset()`, counted as in exercise 4). x is [B, 4], cache is
    [B, S, 4], float32 unless said otherwise.

        def step(x, cache, position):             # position: a 0-d long tensor
            cache = cache.index_copy(1, position.reshape(1), x[:, None])
            return cache, cache.sum()

        def step_int(x, cache, position: int):    # the same step, the position a Python int
            cache = cache.clone()
            cache[:, position] = x
            return cache, cache[:, : position + 1].sum()

        def step_flag(x, cache, position, greedy: bool):
            out = cache.sum() + x.sum()
            return out.round() if greedy else out

    Return a dict with one count per key:
      "tensor_position":  step, B = 2, S = 16, positions 0..9 as tensors (10 calls)
      "int_position_5":   step_int, B = 2, S = 16, positions 0..4 (5 calls)
      "int_position_12":  step_int, B = 2, S = 16, positions 0..11 (12 calls)   (look up dynamo's recompile limit)
      "batch_2_3_2":      step at position 1 with B = 2, then B = 3, then B = 2 again
      "flag_toggled":     step_flag with greedy True, False, True, False (same tensors)
      "dtype_change":     step in float32, then the same shapes in bfloat16
      "growing_cache":    step with S = 4, 5, 6, 7, 8 (a cache that grows by one column a step), position 0..4

    The check builds each scenario with a counting backend and compares. Then say which of these a compiled
    decode loop must avoid, and how the package's fixed-shape step avoids each.
    """
    raise NotImplementedError
