"""Worked answers for lesson 15's exercises (lessons/15-compile-and-export/exercises.py).

Check them: `pytest lessons/15-compile-and-export --solutions`.
"""

from __future__ import annotations

import torch

# ------------------------------------------------------------------ Exercise 1


def mask_from_positions(positions: torch.Tensor, num_columns: int, window: int) -> torch.Tensor:
    """Exercise 1: The mask from the positions"""
    columns = torch.arange(num_columns, device=positions.device)  # [S]
    newest = positions[:, -1:, None]  # [B, 1, 1]: the last position written into the ring
    held = newest - (newest - columns) % num_columns  # [B, 1, S]: the latest position q <= newest with q % S == c
    query = positions[:, :, None]  # [B, T, 1]
    return (held >= 0) & (held <= query) & (held > query - window)  # [B, T, S]
    # A column holds the newest position that maps to it; negative means the row has not reached it yet (it holds
    # zeros, or another run's leftovers). Once the chunk p0 .. p0 + T − 1 is written, the ring holds positions
    # p0 + T − S .. p0 + T − 1, and the chunk's first token needs p0 − window + 1 .. p0: all still there when
    # S >= window + T − 1. A ring of exactly `window` columns is enough for decode (T = 1), but a prefill chunk
    # overwrites the oldest keys its own first tokens attend to; with this mask they would silently see fewer
    # keys. Mistral's rolling buffer cache is this ring; the positions alone give the mask, so the graph needs no
    # other input, and RoPE, which rotates each key by its own position, does not care where the key is stored.


# ------------------------------------------------------------------ Exercise 2


def write_by_index_put(store: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exercise 2: A cache write a graph can hold"""
    rows = torch.arange(new.shape[0], device=new.device)[:, None]  # [B, 1], broadcast against columns [B, T]
    store[rows, :, columns] = new.transpose(1, 2)  # advanced indices first: the target is indexed as [B, T, KV, hd]
    return store


def write_by_scatter_(store: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exercise 2: A cache write a graph can hold"""
    index = columns[:, None, :, None].expand_as(new)  # [B, KV, T, hd]: the column for every element of `new`
    return store.scatter_(2, index, new)


def predicted_whole_layer_copies() -> dict[str, bool]:
    """Exercise 2: A cache write a graph can hold"""
    # Inductor lowers index_put_ on a graph input to a kernel that stores the new rows straight into the input's
    # memory: the wrapper's `call` allocates nothing and passes the input to the kernel. scatter_ on an input is
    # functionalised into an out-of-place scatter plus a copy back: `buf0 = empty_strided_cpu((2, 2, 24, 8), ...)`,
    # a loop writing the whole scattered layer into it, and a loop copying all of it back into the input (the
    # kernel's name says `copy_`). For one decode token that is S columns moved to write one, in every layer at
    # every step; an exported graph that returns its cache (`present_*`) pays the same by design.
    # Slicing store[:, :, p:p + T] with a Python p would bake p into the graph instead: a new graph every step.
    return {"index_put": False, "scatter_": True}


# ------------------------------------------------------------------ Exercise 3


def predicted_chunks() -> dict[int, list[tuple[int, int]]]:
    """Exercise 3: A prompt through a fixed-length prefill graph"""
    # At most one chunk: one run from 0, padded to 8. Longer: whole chunks from 0 while one fits before the end,
    # then a last chunk that ends exactly at the prompt's end, overlapping the previous one (9: start 1, 7 tokens
    # computed twice; 17: start 9). 16 is two whole chunks: the "last" one is the second.
    return {1: [(0, 7)], 8: [(0, 0)], 9: [(0, 0), (1, 0)], 16: [(0, 0), (8, 0)], 17: [(0, 0), (8, 0), (9, 0)]}


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """Exercise 3: A prompt through a fixed-length prefill graph"""
    if length <= chunk:
        return [(0, chunk - length)]
    starts = list(range(0, length - chunk, chunk)) + [length - chunk]
    return [(start, 0) for start in starts]
    # The overlap recomputes a few keys that are already in the cache; they come out the same, since the
    # tokens before them are the same. A padded last chunk (17 tokens: start 16, 7 padding) would write keys at
    # positions 17-23, past the prompt's end: harmless while the next tokens overwrite them, but the exported
    # graph's cache holds a fixed number of positions (`--context`), and a prompt that ends within a chunk of it
    # would write past the cache itself. A short prompt can pad: its chunk starts at 0 and fits any context of at
    # least one chunk.


# ------------------------------------------------------------------ Exercise 4


def predict_dynamic_graphs() -> dict[str, int]:
    """Exercise 4: Count the graphs"""
    # dynamic=None ("automatic dynamic shapes"): the first call is traced with every size a constant; when a call
    # fails the guards because a size (or a Python int) changed, dynamo marks that one dynamic and traces again
    # with a symbol for it, which then serves every later value. Sizes 0 and 1 are never symbols (0/1
    # specialization: a size of 1 broadcasts, so code can branch on it); a symbolic size is assumed >= 2.
    return {
        "static": 6,  # dynamic=False: a graph per shape (under the recompile limit, 8)
        "default": 2,  # T = 2 as constants, then one graph for every T >= 2 from the second length on
        "default_then_one": 3,  # the symbolic graph's guard says T >= 2, so T = 1 gets a graph of its own
        "dynamic": 1,  # dynamic=True: symbolic from the first call
        "default_int": 2,  # a Python int goes the same way as a size: constant first, then a symbol
    }
    # The package still passes dynamic=False: with a symbol for T, Inductor writes its kernels for any size, so it
    # can neither specialise them nor time a matmul kernel for the one shape decode runs thousands of times. So
    # the step never sees a second shape: one token per decode step, a cache allocated at its full length, prompts
    # fed in chunks of one length (or run eagerly), positions as tensors, one graph per (batch, cache bucket). The
    # T = 1 graph above is also why decode needs a graph of its own even in dynamic mode.


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
