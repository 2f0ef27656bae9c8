"""Worked answers for lesson 16's exercises (lessons/16-attention-kernels/exercises.py).

Check them: `pytest lessons/16-attention-kernels --solutions`.
"""

from __future__ import annotations

import math

import torch

# ------------------------------------------------------------------ Exercise 1


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 1: Merge two partial attentions"""
    lse = torch.logaddexp(lse_a, lse_b)  # [T]: log(Σ_A exp s + Σ_B exp s)
    # Each side's softmax is exp(s - lse_side); over both it is exp(s - lse) = that · exp(lse_side - lse).
    # A query that saw nothing anywhere has lse = -inf: use 0 as the reference (weights exp(-inf) = 0).
    reference = lse.masked_fill(lse == float("-inf"), 0.0)
    weight_a, weight_b = torch.exp(lse_a - reference), torch.exp(lse_b - reference)
    return weight_a[:, None] * out_a + weight_b[:, None] * out_b, lse
    # A long cache split across processors: each computes (out, lse) over its share of the keys, and one
    # cheap merge per query combines them exactly (flash-decoding, ring attention).


# ------------------------------------------------------------------ Exercise 2


def online_update(state, q, k, v, visible, scale):
    """One tile of the online softmax. state = (m [Tq], l [Tq], acc [Tq, hd])."""
    m, l, acc = state
    scores = (q @ k.T * scale).masked_fill(~visible, float("-inf"))  # [Tq, Sk]
    m_new = torch.maximum(m, scores.amax(dim=-1))
    reference = m_new.masked_fill(m_new == float("-inf"), 0.0)  # nothing visible yet: no -inf - (-inf)
    p = torch.exp(scores - reference[:, None])
    correction = torch.exp(m - reference)  # rescales what was summed under the old maximum
    return m_new, l * correction + p.sum(dim=-1), acc * correction[:, None] + p @ v


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int,
                    block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 2: A tiled attention loop of your own"""
    T, hd = q.shape
    S = k.shape[0]
    out, lse = torch.empty_like(q), torch.empty(T)
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        state = (torch.full((q1 - q0,), float("-inf")), torch.zeros(q1 - q0), torch.zeros(q1 - q0, hd))
        last_key = S - T + q1  # the tile's last query sees keys up to here (exclusive): later tiles are skipped
        for k0 in range(0, last_key, block_k):
            k1 = min(k0 + block_k, last_key)
            visible = torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None] + (S - T)  # [Tq, Sk]
            state = online_update(state, q[q0:q1], k[k0:k1], v[k0:k1], visible, 1 / math.sqrt(hd))
        m, l, acc = state
        out[q0:q1], lse[q0:q1] = acc / l[:, None], m + torch.log(l)  # every causal query sees key 0: l > 0
    return out, lse


# ------------------------------------------------------------------ Exercise 3


def causal_tiles(T: int, S: int, block_q: int, block_k: int) -> tuple[list[tuple[int, int]], float]:
    """Exercise 3: The tiles a causal mask computes"""
    tiles, covered = [], 0
    for i, q0 in enumerate(range(0, T, block_q)):
        rows = min(block_q, T - q0)
        last_visible = S - T + q0 + rows - 1  # the tile's last query sees up to this key
        for j, k0 in enumerate(range(0, S, block_k)):
            if k0 <= last_visible:  # the tile's first key is seen by its last query
                tiles.append((i, j))
                covered += rows * min(block_k, S - k0)
    # For a prefill (T = S = L) with fixed tiles the share tends to 1/2 as L grows (the diagonal tiles'
    # waste is L·block/2 of L²/2); for a decode step (T = 1) every key is visible: share 1.
    return tiles, covered / (T * S)


# ------------------------------------------------------------------ Exercise 4


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: list[int],
                 length: int) -> torch.Tensor:
    """Exercise 4: Decode through a block table"""
    block_size, hd = k_pool.shape[1], k_pool.shape[2]
    state = (torch.full((1,), float("-inf")), torch.zeros(1), torch.zeros(1, hd))
    for i in range(-(-length // block_size)):
        filled = min(block_size, length - i * block_size)  # the last block may be partly filled
        keys, values = k_pool[block_table[i], :filled], v_pool[block_table[i], :filled]  # read in place
        state = online_update(state, q[None], keys, values, torch.ones(1, filled, dtype=torch.bool),
                              1 / math.sqrt(hd))
    m, l, acc = state
    return (acc / l[:, None])[0]


# ------------------------------------------------------------------ Exercise 5


def online_softmax(tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5: Online softmax by hand"""
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    for tile in tiles:
        m_new = torch.maximum(m, tile.max())
        if m_new == float("-inf"):  # nothing visible yet: exp(-inf - (-inf)) would be NaN, and there is nothing to add
            continue
        # The sum so far was taken against the old maximum: exp(x - m) = exp(x - m_new) · exp(m - m_new).
        l = l * torch.exp(m - m_new) + torch.exp(tile - m_new).sum()
        m = m_new
    return m, l
    # Subtracting the maximum keeps every exp(x - m) in (0, 1]: no overflow, whatever the scores. The running
    # version never needs all scores at once, which is what lets flash attention (exercise 2) stream the keys
    # tile by tile: the same rescaling is applied to the output accumulator, acc · exp(m - m_new). m is the
    # exact maximum (max is exact in floating point), so exp(x - m) are the very floats torch.softmax computes;
    # only the sum l is added up in another order, which changes its last bits at most.


# ------------------------------------------------------------------ Exercise 6


def attention_cost(kind: str, T: int, S: int, H: int, KV: int, hd: int, block_q: int = 128,
                   element: int = 4) -> dict:
    """Exercise 6: The cost of attention at a context length"""
    io = 2 * H * T * hd * element  # q read once, the output written once
    if kind == "naive":
        pairs = T * S
        scores = 4 * H * T * S * element  # scores written, read (softmax), probabilities written, read (p v)
        moved = io + 2 * KV * S * hd * element + scores
    elif kind == "flash":
        tiles = range(0, T, block_q)
        last_key = [S - T + min(q0 + block_q, T) for q0 in tiles]  # keys 0 .. the tile's last query's last key
        pairs = sum(min(block_q, T - q0) * keys for q0, keys in zip(tiles, last_key))
        moved = io + sum(2 * KV * keys * hd * element for keys in last_key)  # k and v once per query tile
    else:
        raise ValueError(f"no cost model for {kind!r}: use naive or flash")
    return {"flops": 2 * 2 * pairs * hd * H, "bytes": moved}  # q kᵀ and p v: hd mul-adds each, per pair and head
    # Read at SmolLM2's shape (H = 9, KV = 3, hd = 64) in float32. A decode step at S = 8192 (T = 1): 18.9 MFLOP
    # and 12.6 MB, 1.5 FLOP per byte whatever S (each key is used by the H / KV = 3 query heads sharing it):
    # memory-bound on any machine, so a long context's decode costs the bytes of its cache (lesson 06). A
    # prefill of 4096 tokens: naive computes 38.7 GFLOP and moves 2.4 GB, nearly all of it scores (16 FLOP per
    # byte); flash with 128-row tiles computes 52% of those FLOPs and moves 5% of those bytes (162 FLOP per byte).
    # Flash's intensity grows with block_q, which is why a tiled kernel can be compute-bound where naive never is.
