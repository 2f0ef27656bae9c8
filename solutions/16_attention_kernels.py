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


def online_update(state, scores, v):
    """One tile of the online softmax. state = (m [Tq], l [Tq], acc [Tq, hd]); scores [Tq, Sk], masked with -inf.

    A row whose running maximum is still -inf (it has seen nothing yet, in this tile or before) uses 0 as its
    reference: exp(-inf - 0) = 0 adds nothing, where exp(-inf - (-inf)) would be NaN.
    """
    m, l, acc = state
    m_new = torch.maximum(m, scores.amax(dim=-1))
    reference = m_new.masked_fill(m_new == float("-inf"), 0.0)
    p = torch.exp(scores - reference[:, None])  # [Tq, Sk]
    correction = torch.exp(m - reference)  # rescales what was summed under the old maximum
    return m_new, l * correction + p.sum(dim=-1), acc * correction[:, None] + p @ v


def tiled_attention(score, v: torch.Tensor, mask: torch.Tensor, block_q: int,
                    block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 2: A tiled attention loop of your own"""
    T, S = mask.shape
    hd = v.shape[1]
    out, lse = torch.zeros(T, hd, dtype=v.dtype), torch.full((T,), float("-inf"), dtype=v.dtype)
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        state = (torch.full((q1 - q0,), float("-inf")), torch.zeros(q1 - q0), torch.zeros(q1 - q0, hd))
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            visible = mask[q0:q1, k0:k1]  # [Tq, Sk]: reading the mask costs no product
            if not visible.any():  # padding, a masked band, the future: never compute this tile
                continue
            scores = score(q0, q1, k0, k1).masked_fill(~visible, float("-inf"))
            state = online_update(state, scores, v[k0:k1])
        m, l, acc = state
        # A row that saw nothing has l = 0 and acc = 0: divide by 1 instead, giving zeros, and m + log 0 = -inf.
        out[q0:q1] = acc / l.masked_fill(l == 0, 1.0)[:, None]
        lse[q0:q1] = m + torch.log(l)
    return out, lse
    # The notebook's loop knows one mask, causal, where every query sees key 0: its first tile gives every row a
    # finite maximum, so it never meets m = -inf. Under padding a row can meet its first visible key in a later
    # tile than the other rows of its query tile (or never): the tile is computed for the others, and that row
    # needs the guard. The left-padded prefill of 13 tokens with 5 pads in 4 x 4 tiles computes 6 of the 16 tiles
    # (query tile 0 is all padding, key tile 0 all padding): causal skipping alone would compute 10.


# ------------------------------------------------------------------ Exercise 3


def window_tiles(L: int, B: int, W: int) -> int:
    """Exercise 3: The tiles a causal mask computes"""
    # Query tile i (rows iB .. iB + B - 1) sees keys from max(0, iB - W + 1) to its last row, whose key tile is i
    # (the diagonal). floor((iB - (W - 1)) / B) = i - c with c = ceil((W - 1) / B), so the tile touches key tiles
    # max(0, i - c) .. i: min(i, c) + 1 of them. (A shorter last tile changes nothing: its first row already
    # reaches its diagonal tile.) Sum over the n query tiles:
    n = -(-L // B)  # ceil(L / B) in integers: at L = 10**18, L / B in floating point is no longer exact
    c = -(-(W - 1) // B)  # key tiles a full window reaches back, beyond the diagonal one
    k = min(c, n - 1)
    return n + k * (k + 1) // 2 + (n - 1 - k) * c  # Σ_{i<n} (min(i, c) + 1)
    # Linear in L once n > c: about n·(c + 1) tiles, against n(n + 1)/2 for plain causal. W >= L gives
    # c >= n - 1 and n(n + 1)/2 (the notebook's causal picture); W = 1 gives c = 0 and n (the diagonal only).
    # A Gemma 3 270M sliding layer (W = 512) at 32k tokens in 128 x 128 tiles: n = 256, c = 4, 1270 tiles instead of
    # 32 896, 3.9% of causal flash's work, and the share halves again each time the context doubles. Note the
    # off-by-one: with i - W < j (W keys, itself included) the window reaches W - 1 keys back, not W.


# ------------------------------------------------------------------ Exercise 4


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: list[int],
                 length: int) -> torch.Tensor:
    """Exercise 4: Decode through a block table"""
    block_size, hd = k_pool.shape[1], k_pool.shape[2]
    state = (torch.full((1,), float("-inf")), torch.zeros(1), torch.zeros(1, hd))
    for i in range(-(-length // block_size)):
        filled = min(block_size, length - i * block_size)  # the last block may be partly filled
        keys, values = k_pool[block_table[i], :filled], v_pool[block_table[i], :filled]  # read in place
        state = online_update(state, q[None] @ keys.T / math.sqrt(hd), values)
    m, l, acc = state
    return (acc / l[:, None])[0]


# ------------------------------------------------------------------ Exercise 5


def online_softmax_without_rescale(tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5: Online softmax by hand"""
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    for tile in tiles:
        m_new = torch.maximum(m, tile.max())
        if m_new == float("-inf"):  # nothing visible yet: exp(-inf - (-inf)) would be NaN, and there is nothing to add
            continue
        l = l + torch.exp(tile - m_new).sum()  # BROKEN on purpose: the correct loop has l * torch.exp(m - m_new) here
        m = m_new
    return m, l


def predict_rescale_error() -> dict[str, float]:
    """Exercise 5: Online softmax by hand"""
    e = math.exp
    return {
        "largest first": 1.0,  # the maximum is reached in the first tile and never grows: nothing is left out
        "rising": 4 / (1 + e(-1) + e(-2) + e(-3)),  # each score is a new maximum: broken l = 1 + 1 + 1 + 1
        "late jump": 4 / (1 + 3 * e(-10)),  # 3 (the zeros, against m = 0) + 1; the truth counts them at e^-10
        "masked first tile": 1.0,  # m grows from -inf, but then l = 0: the missing factor multiplies nothing
    }
    # Without the rescale each tile's terms stay measured against m_t, the maximum after that tile, so
    # l_broken = Σ_t exp(m - m_t) · S_t with S_t = Σ_{s in tile t} exp(s - m) and Σ_t S_t = l_true: the ratio
    # l_broken / l_true is a weighted mean of exp(m - m_t) >= 1, equal to 1 exactly when no tile with a finite
    # score comes before the final maximum. Every probability exp(s - m) / l_broken is too small by that same
    # factor, so they sum to l_true / l_broken < 1 (0.39 for "rising", 0.25 for "late jump": the key holding
    # nearly all the weight gets a quarter of it). A test whose largest score sits in the first tile cannot see
    # the bug; random scores in many tiles, or rising ones, do. In flash attention acc misses the same factor,
    # and out = acc / l cancels part of it: each earlier tile's values are over-weighted by exp(m - m_t).


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
    # Flash's intensity grows with block_q; naive's stays below hd / 4 = 16 at any length (further below with
    # eager PyTorch's extra passes over the scores), so where peak / bandwidth is above that, only a tiled kernel
    # is compute-bound. The course's machine (results/predictions.json's constants) counts both prefills
    # compute-bound and the decode memory-bound.
