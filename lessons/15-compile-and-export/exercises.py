"""Lesson 15 exercises: write your answers here; `pytest lessons/15-compile-and-export` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/15_compile_and_export.py (try first!).

Conventions: the cache is fixed-shape, [B, n_kv_head, S, head_dim], and row b's token at position p sits in
column p; a mask is bool, True where a query may attend to a key.
"""

from __future__ import annotations

import torch  # noqa: F401


def mask_from_positions(positions: torch.Tensor, num_columns: int, window: int) -> torch.Tensor:
    """Exercise 1: The mask from the positions

    The notebook's graph computes its mask as `arange(S) <= positions`: column c holds position c. Build the mask
    for a cache laid out differently. A sliding-window layer (Mistral; Gemma 3's local layers;
    `ModelConfig.sliding_window`) lets the token at position p see only positions q with p − window < q <= p, so
    its cache need not hold the whole run: a ring of S = num_columns columns keeps the token at position q in
    column q % S, over the one S positions before it. The shape never changes, so one graph serves a run of any
    length, past S and past the context the model was trained with.

    positions: long [B, T], the positions of T consecutive new tokens per row (p0, p0 + 1, ..., a different p0
    per row; each row has written every position from 0 up to p0 − 1 before). These T tokens have just been
    written at columns positions % S. Return the bool mask [B, T, S]: True where new token t of row b may attend
    to column c, which is when the column holds a position of this row (not a column the row has not reached yet)
    inside token t's window and not after t. Assume S >= window + T − 1: why is that enough, and what would a
    ring of exactly `window` columns get wrong for a chunk of T > 1 tokens?

    Tensor operations only (no Python loop over values, no `.item()` or `int(...)`): the check traces your
    function once and runs the trace at other positions, as an exported graph would.
    """
    raise NotImplementedError


def write_by_index_put(store: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exercise 2: A cache write a graph can hold

    store [B, KV, S, hd]: one layer of a fixed-shape cache, a graph input; new [B, KV, T, hd]: T new keys per row;
    columns: long [B, T], where row b's t-th new key goes. Write them into `store` itself, in place, with one
    indexed assignment (`store[...] = ...`, which traces as `index_put_`), no Python loop: the columns are a tensor,
    so one graph serves every step. Return `store`.
    """
    raise NotImplementedError


def write_by_scatter_(store: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Exercise 2: A cache write a graph can hold

    The same write as `write_by_index_put`, in place into `store`, as one `store.scatter_(...)`. Return `store`.
    """
    raise NotImplementedError


def predicted_whole_layer_copies() -> dict[str, bool]:
    """Exercise 2: A cache write a graph can hold

    Predict, before compiling: lesson 15's README says one of these two writes, compiled by Inductor with `store`
    a graph input, copies the whole layer every step. Which? Returns {"index_put": bool, "scatter_": bool}, True
    where the compiled step allocates a buffer the size of the whole store (and copies it back).

    Then look: compile each (`torch.compile(fn, dynamic=False)`) through
    `torch._inductor.utils.run_and_get_code` and find the line in the generated wrapper (its `call`) that says so.
    The check compiles your two functions the same way and reads the wrapper.
    """
    raise NotImplementedError


def predicted_chunks() -> dict[int, list[tuple[int, int]]]:
    """Exercise 3: A prompt through a fixed-length prefill graph

    Write your prediction as literals, before you read `OnnxModel.prefill` (`minillm/speed/onnx_model.py`): a
    prefill graph takes exactly 8 tokens; a prompt of `length` tokens runs through it in chunks. For prompts of 1,
    8, 9, 16 and 17 tokens, what (start, padding) does each run of the graph get? The runner pads only a prompt
    of at most one chunk; a longer one never pads, so think about where its last chunk must start.

    Returns {length: [(start, padding), ...]} for those five lengths. The check replays the runner on a stub.
    """
    raise NotImplementedError


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """Exercise 3: A prompt through a fixed-length prefill graph

    The (start, padding) of each run of a `chunk`-token prefill graph for a prompt of `length` tokens, by the rule
    `minillm.speed.onnx_model.OnnxModel.prefill` follows (your prediction above, generalised). And: what would a
    padded last chunk (instead of the runner's) write past, and where does that fail?
    """
    raise NotImplementedError


def predict_dynamic_graphs() -> dict[str, int]:
    """Exercise 4: Count the graphs

    The notebook and the package pass `dynamic=False`, so every new shape compiles a new graph. Predict, before
    running anything, what torch.compile does without it. Each scenario starts from a fresh
    `torch._dynamo.reset()`, and graphs are counted with a backend that counts the graphs it is handed (no
    Inductor), as the notebook's `counting_inductor` does:

        def scale_rows(x):              # x: float32 [T, 4], T new tokens
            return x / x.abs().amax(-1, keepdim=True)

        def times(x, n: int):           # x: float32 [4, 4], n a Python int
            return x * n

    Return a dict with one count per key:
      "static":             torch.compile(scale_rows, dynamic=False), T = 2, 3, 4, 5, 6, 7 in turn
      "default":            torch.compile(scale_rows) (dynamic=None, the default), T = 2, 3, 4, 5, 6, 7
      "default_then_one":   torch.compile(scale_rows), T = 2, 3, 4, 5, 6, 7, then T = 1 (a decode token)
      "dynamic":            torch.compile(scale_rows, dynamic=True), T = 2, 3, 4, 5, 6, 7
      "default_int":        torch.compile(times), n = 2, 3, 4, 5, 6, 7

    Read the `dynamic` argument in torch.compile's docstring, and look up "automatic dynamic shapes" and
    "0/1 specialization". The check counts each scenario and compares. Then: why does the package pass
    dynamic=False anyway, and what does it do instead, so that a decode loop sees only one shape?
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
