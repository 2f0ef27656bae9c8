"""Lesson 16 exercises: write your answers here; `pytest lessons/16-attention-kernels` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/16_attention_kernels.py (try first!).

Conventions: one attention head, float32; scores are q kᵀ / √hd; lse is the log-sum-exp of a query's
masked, scaled scores (-inf for a query that sees no key, whose output is zeros).
"""

from __future__ import annotations

import torch  # noqa: F401


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 1: Merge two partial attentions

    out_a [T, hd], lse_a [T]: attention of T queries over a set A of keys; out_b, lse_b: over a disjoint
    set B. Return (out [T, hd], lse [T]), attention over A and B together, from these four alone.

    A query that saw no key of A has lse_a = -inf and out_a = 0 (likewise for B); one that saw no key at
    all gets zeros and -inf. No NaN anywhere.

    Hint: softmax over A ∪ B weighs A's softmax by exp(lse_a - lse), where lse = log(exp(lse_a) + exp(lse_b)).
    """
    raise NotImplementedError


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int,
                    block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 2: A tiled attention loop of your own

    q [T, hd]; k, v [S, hd] with T <= S; causal with the queries the last T keys: query t sees keys
    0 .. S - T + t. Loop over tiles of `block_q` queries; for each, keep the running max m, sum l and
    accumulator acc, and update them tile by tile over `block_k` keys (the last tiles may be shorter).
    Do not compute a key tile that lies entirely after the query tile's last visible key.
    Returns (out [T, hd], lse [T]).

    The check compares with SDPA and torch.logsumexp over odd lengths and tile sizes.
    """
    raise NotImplementedError


def causal_tiles(T: int, S: int, block_q: int, block_k: int) -> tuple[list[tuple[int, int]], float]:
    """Exercise 3: The tiles a causal mask computes

    The score matrix [T, S] under the lower-right causal mask (query t sees keys 0 .. S - T + t) is cut
    into tiles: query tile i holds queries i·block_q .. (i+1)·block_q - 1, key tile j keys
    j·block_k .. (j+1)·block_k - 1 (the last ones shorter). Return (tiles, share):

    - tiles: every (i, j) whose tile holds at least one visible (query, key) pair, sorted;
    - share: the fraction of the T·S scores that those tiles cover (what a tiled kernel computes).

    Example: T = S = 4, tiles of 2: [(0, 0), (1, 0), (1, 1)], share 12 / 16 = 0.75.
    """
    raise NotImplementedError


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: list[int],
                 length: int) -> torch.Tensor:
    """Exercise 4: Decode through a block table

    q [hd]: one new token's query, which sees all `length` keys of its sequence. k_pool, v_pool
    [num_blocks, block_size, hd]: the pools; the sequence's key at position p lives in block
    block_table[p // block_size], row p % block_size. Walk the table one block at a time (the last one
    may be partly filled), updating the online softmax; do not gather the keys into one tensor.
    Returns out [hd].
    """
    raise NotImplementedError


def online_softmax(tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5: Online softmax by hand

    `tiles` is an iterator over consecutive tiles (1-D float32 tensors) of one row of scores; it can be walked
    once. Walk it, keeping only two numbers: the running maximum m and the running sum l of exp(score - m),
    rescaling l whenever m grows. Return (m, l) as 0-d float32 tensors, so that softmax(scores) =
    exp(scores - m) / l and logsumexp(scores) = m + log(l).

    Scores may be -inf (masked keys), a whole tile may be -inf (even the first one), and there may be no
    finite score at all: then return m = -inf and l = 0. No NaN anywhere.

    The check compares exp(scores - m) / l with torch.softmax in float32 (m must be the maximum exactly, so
    the numerators are the very same floats; l may differ from torch's sum only by float32 rounding).
    """
    raise NotImplementedError


def attention_cost(kind: str, T: int, S: int, H: int, KV: int, hd: int, block_q: int = 128,
                   element: int = 4) -> dict:
    """Exercise 6: The cost of attention at a context length

    Predict from the shapes alone the FLOPs and the bytes moved by a causal attention of T queries (the last T
    of S keys; T = S is a prefill, T = 1 a decode step), H query heads sharing KV key/value heads of size hd,
    `element` bytes per value. Return {"flops": ..., "bytes": ...} for kind "naive" or "flash", counting as the
    lesson's benchmark does:

    - FLOPs: 2 per multiply-add, in q kᵀ and in p v, over the (query, key) pairs the kernel computes. Naive
      computes all T·S pairs (and masks half). Flash walks query tiles of `block_q` rows (the last one shorter)
      and, for each, every key up to the tile's last visible key: query t sees keys 0 .. S - T + t.
    - Bytes, at the least: q read and the output written once (H·T·hd values each). Naive reads k and v once
      (KV·S·hd each) and also writes the [H, T, S] scores, reads them for the softmax, writes the
      probabilities and reads them again for p v. Flash reads k and v up to the tile's last visible key once
      per query tile, and never stores a score.

    Raise ValueError for any other kind. The check compares with the benchmark's own accounting,
    `minillm.bench.attention.attention_cost`, over many shapes.
    """
    raise NotImplementedError
