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


def tiled_attention(score, v: torch.Tensor, mask: torch.Tensor, block_q: int,
                    block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 2: A tiled attention loop of your own

    Flash attention for one head under ANY mask, not only causal. mask: bool [T, S], True where query t may see
    key s (padding, a masked band, a token tree, causal: whatever it says). v [S, hd]. The scores come only
    from `score(q0, q1, k0, k1)`, which returns the [q1 - q0, k1 - k0] tile of q kᵀ / √hd: it stands for the
    kernel's tile matmul, and the check counts every call.

    Walk the grid of tiles: query tile i holds queries i·block_q .. (i+1)·block_q - 1, key tile j keys
    j·block_k .. (j+1)·block_k - 1 (the last ones shorter). For each query tile keep the running max m, sum l
    and accumulator acc [rows, hd], and update them key tile by key tile. Call `score` exactly once for every
    tile in which the mask holds at least one True, and never for a tile where it holds none (read the mask
    instead: a bool costs no product). Inside a computed tile, a row may still see nothing (a padding query,
    a row whose first visible key lies in a later tile): its m is -inf, and the update must not make a NaN.

    Returns (out [T, hd], lse [T]); a query that sees no key at all gets zeros and lse = -inf.

    The notebook's `tiled` (section 3) is causal only: give it a padding mask in place of its `seen` first, and
    watch where the NaN comes from.
    """
    raise NotImplementedError


def window_tiles(L: int, B: int, W: int) -> int:
    """Exercise 3: The tiles a causal mask computes

    A sliding-window prefill of L tokens: query i sees key j when i - W < j <= i (W keys, itself included:
    transformers' rule, lesson 17). The [L, L] score matrix is cut into B x B tiles (the last ones shorter).
    Return how many tiles hold at least one visible (query, key) pair: the tiles a flash kernel computes.

    Derive it as a closed form in L, B and W, in exact integer arithmetic: no loop over tiles (the check calls
    it with L = 10**18 and a one-second limit, where L / B in floating point is no longer exact). Hint: count
    the key tiles one query tile touches, then sum over query tiles.
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


def online_softmax_without_rescale(tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5: Online softmax by hand

    BREAK the online softmax on purpose, to see what the rescale is for. `tiles` is a one-pass iterator over
    consecutive tiles (1-D float32 tensors) of one row of scores. Walk it keeping the running maximum m and the
    running sum l, but when m grows, do NOT rescale l by exp(m_old - m_new): add the tile's Σ exp(s - m_new)
    to l as it stands. Keep everything else right: m is the exact maximum, a tile (even the first) may be all
    -inf and adds nothing, a row with no finite score gives m = -inf and l = 0, and nothing is NaN.
    Return (m, l) as 0-d float32 tensors.

    The check compares l with the broken sum computed from its definition, on rows where the maximum grows.
    """
    raise NotImplementedError


def predict_rescale_error() -> dict[str, float]:
    """Exercise 5: Online softmax by hand

    Predict, before running anything, l_broken / l_true (the broken loop's l over the true Σ exp(s - max)) for
    these rows, walked in tiles of the given size:

        "largest first":      [4, 1, 3, 0]             tiles of 2
        "rising":             [0, 1, 2, 3]             tiles of 1
        "late jump":          [0, 0, 0, 10]            tiles of 3
        "masked first tile":  [-inf, -inf, 2, 2, 1, 0] tiles of 2

    Return {name: ratio} as floats; write each as an expression (math.exp is fine), not by running your loop.
    The check computes every ratio by brute force.
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
