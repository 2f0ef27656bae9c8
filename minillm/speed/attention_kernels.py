"""Attention written three ways, and the backends that run the model on them (lesson 16).

Every way computes the same thing, softmax(q kᵀ / √hd + mask) v, per query head:

- `naive_attention` materialises the scores, a [T, S] matrix per head, and softmaxes
  each row. Its memory grows with T·S: a 32k-token prefill holds a billion scores per head.
- `online_softmax_attention` reads the keys once, one at a time, keeping for each query a
  running maximum m, a running denominator l and a running weighted sum of values; when a
  larger score arrives, what was summed so far is rescaled by exp(m_old - m_new). No row of
  scores is ever held: memory is O(T·hd) whatever S is.
- `flash_attention` is that same update over tiles: a tile of `block_q` queries against a
  tile of `block_k` keys is one small matrix product, so the work is done by matmuls (what
  hardware is fast at) while the live scores never exceed one [block_q, block_k] tile.
  Causal tiles entirely above the diagonal are skipped, not computed and masked.
  `paged_flash_attention` runs the same loop with one key tile per block of a paged cache,
  read through the block table (`minillm.cache.paged`), as vLLM's FlashAttention and
  FlashInfer backends do; vLLM's original PagedAttention kernel read the blocks through the
  table too, but held a row's scores whole (two passes: the max, then the exponentials' sum),
  and its v2 split a long row into partitions merged at the end.

All three return (out [B, H, T, hd], lse [B, H, T]), where lse is the log-sum-exp of each
query's masked, scaled scores: what a backward pass, or a merge of two attentions over
different key sets (split-K decoding, ring attention), needs from the forward.

Shapes follow the attention seam (`minillm.model.attention`): q [B, H, T, hd]; k, v [B, KV, S, hd]
with H a multiple of KV (grouped-query heads: query head h reads key head h // (H // KV));
mask bool [B, T, S] (True = may attend) or None, meaning causal with the T queries the
last T of the S keys (the lower-right triangle: a chunk after a cached prefix). A query
that may attend to nothing (a padding row) gets zeros and lse = -inf, as SDPA gives zeros.
Internally q is viewed as [B, KV, G, T, hd] (G = H // KV) so that a key head is read once
for its G query heads instead of being copied G times.

Low-precision inputs (bf16, fp16) are computed in float32 and returned in their own dtype,
as flash kernels accumulate in fp32.
"""

from __future__ import annotations

import math

import torch

from ..cache.blocks import blocks_for
from ..cache.paged import PagedKVCache
from ..model.attention import AttentionStep, SDPABackend

# ------------------------------------------------------------------ shapes and masks


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """ValueError naming the bad shape: the kernels below would otherwise fail deep inside a matmul."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"attention takes q [B, H, T, hd] and k, v [B, KV, S, hd]; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    (B, H, T, hd), (Bk, KV, S, hdk) = q.shape, k.shape
    if B != Bk or hd != hdk or H % KV:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} disagree: the batch and head size must match "
                         f"and the query heads ({H}) must be a multiple of the key heads ({KV})")
    if mask is None and T > S:
        raise ValueError(f"causal attention (mask None) needs the {T} queries to be the last of the keys, but "
                         f"there are only {S} keys: pass an explicit mask")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, T, S)):
        raise ValueError(f"mask must be bool [B, T, S] = {[B, T, S]}; got {mask.dtype} {list(mask.shape)}")


def visible_tile(mask: torch.Tensor | None, T: int, S: int, q0: int, q1: int, k0: int, k1: int,
                 device) -> torch.Tensor:
    """bool [B or 1, 1, 1, q1 - q0, k1 - k0]: which keys k0..k1-1 queries q0..q1-1 may see.

    With mask None (causal, queries last) the tile is computed from indices, so no [T, S]
    mask is ever built: query t sees keys 0 .. S - T + t.
    """
    if mask is not None:
        return mask[:, None, None, q0:q1, k0:k1]
    queries = torch.arange(q0, q1, device=device)[:, None] + (S - T)
    return (torch.arange(k0, k1, device=device)[None, :] <= queries)[None, None, None]


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [B, H, T, hd] -> [B, KV, G, T, hd]; k, v [B, KV, S, hd] -> [B, KV, 1, S, hd] (views, no copy),
    in the dtype the arithmetic runs in (float32 for bf16/fp16 inputs)."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    return (q.to(compute).view(B, KV, H // KV, T, hd), k.to(compute)[:, :, None], v.to(compute)[:, :, None])


# ------------------------------------------------------------------ the online softmax


class OnlineSoftmax:
    """softmax(scores) @ values accumulated over key tiles that arrive one after another.

    For each query it keeps m (the largest score so far), l (the sum of exp(score - m))
    and acc (the sum of exp(score - m) · value). A new tile with scores s and values V:

        m' = max(m, max s)
        l' = l · exp(m - m') + Σ exp(s - m')
        acc' = acc · exp(m - m') + exp(s - m') @ V

    so after the last tile acc / l is exactly softmax(all scores) @ all values, and
    m + log l their log-sum-exp. Subtracting the running maximum keeps every exp() ≤ 1
    (no overflow); the rescaling factor exp(m - m') corrects what was summed under the
    old maximum. While a query has seen only masked keys, m is -inf; the update then uses 0
    as its reference so that no -inf - (-inf) = NaN appears, and the query ends with l = 0:
    zeros out, lse -inf.
    """

    def __init__(self, rows: tuple, head_dim: int, dtype, device, scale: float):
        self.m = torch.full(rows, float("-inf"), dtype=dtype, device=device)  # [..., Tq]
        self.l = torch.zeros(rows, dtype=dtype, device=device)  # [..., Tq]
        self.acc = torch.zeros(*rows, head_dim, dtype=dtype, device=device)  # [..., Tq, hd]
        self.scale = scale

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> None:
        """q [..., Tq, hd]; k, v [..., Sk, hd]; visible bool, broadcastable to [..., Tq, Sk]."""
        scores = (q @ k.transpose(-1, -2) * self.scale).masked_fill(~visible, float("-inf"))  # [..., Tq, Sk]
        m_new = torch.maximum(self.m, scores.amax(dim=-1))
        reference = m_new.masked_fill(m_new == float("-inf"), 0.0)  # nothing visible yet: any finite value
        p = torch.exp(scores - reference[..., None])  # masked scores give exp(-inf) = 0
        correction = torch.exp(self.m - reference)  # [..., Tq]; 0 while nothing was summed
        self.l = self.l * correction + p.sum(dim=-1)
        self.acc = self.acc * correction[..., None] + p @ v
        self.m = m_new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(acc / l, m + log l); rows that saw no visible key: (zeros, -inf)."""
        out = self.acc / self.l.masked_fill(self.l == 0, 1.0)[..., None]
        return out, self.m + torch.log(self.l)


def scale_of(q: torch.Tensor, scale: float | None) -> float:
    """1 / √hd (SDPA's default) unless a scale is given."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def ungrouped(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, KV, G, T, hd], [B, KV, G, T] -> [B, H, T, hd] in q's dtype, [B, H, T] in float32."""
    B, H, T, hd = q.shape
    return out.reshape(B, H, T, hd).to(q.dtype), lse.reshape(B, H, T).float()


# ------------------------------------------------------------------ three ways


def naive_attention(q, k, v, mask=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with the full score matrix in memory: [B, H, T, S] scores, the textbook formula."""
    check_shapes(q, k, v, mask)
    T, S = q.shape[2], k.shape[2]
    qg, kg, vg = grouped(q, k, v)
    scores = qg @ kg.transpose(-1, -2) * scale_of(q, scale)  # [B, KV, G, T, S]: the O(T·S) tensor
    scores = scores.masked_fill(~visible_tile(mask, T, S, 0, T, 0, S, q.device), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # [B, KV, G, T, 1]
    p = torch.exp(scores - m.masked_fill(m == float("-inf"), 0.0))  # a fully masked row: all zeros
    l = p.sum(dim=-1, keepdim=True)
    out = (p / l.masked_fill(l == 0, 1.0)) @ vg  # [B, KV, G, T, hd]
    return ungrouped(out, (m + torch.log(l))[..., 0], q)


def online_softmax_attention(q, k, v, mask=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the keys, one key at a time, never holding a row of scores.

    S steps of tiny operations: slow in Python, here to show the update. `flash_attention`
    is the same update over tiles.
    """
    check_shapes(q, k, v, mask)
    B, H, T, hd = q.shape
    S = k.shape[2]
    qg, kg, vg = grouped(q, k, v)
    state = OnlineSoftmax(qg.shape[:-1], hd, qg.dtype, q.device, scale_of(q, scale))
    for j in range(S):
        state.update(qg, kg[..., j:j + 1, :], vg[..., j:j + 1, :], visible_tile(mask, T, S, 0, T, j, j + 1, q.device))
    return ungrouped(*state.result(), q)


def flash_attention(q, k, v, mask=None, scale=None, block_q: int = 64,
                    block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention: for each tile of `block_q` queries, the online softmax over tiles of `block_k` keys.

    The live scores are one [G, block_q, block_k] tile per batch row and key head, whatever
    T and S are. Key tiles that no query of the tile may see are skipped: with mask None
    (causal) that is every tile above the diagonal, about half the work of a prefill.
    """
    check_shapes(q, k, v, mask)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q={block_q}, block_k={block_k}: tile sizes must be at least 1")
    B, H, T, hd = q.shape
    S = k.shape[2]
    qg, kg, vg = grouped(q, k, v)
    out = torch.empty_like(qg)  # [B, KV, G, T, hd]
    lse = torch.empty(qg.shape[:-1], dtype=qg.dtype, device=q.device)  # [B, KV, G, T]
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        state = OnlineSoftmax(qg[..., q0:q1, :].shape[:-1], hd, qg.dtype, q.device, scale_of(q, scale))
        # With mask None the last query of this tile sees keys up to S - T + q1 - 1: stop there.
        k_end = S if mask is not None else S - T + q1
        for k0 in range(0, k_end, block_k):
            k1 = min(k0 + block_k, k_end)
            visible = visible_tile(mask, T, S, q0, q1, k0, k1, q.device)
            if mask is not None and not visible.any():  # nothing to see in this tile (padding, a tree's branch)
                continue
            state.update(qg[..., q0:q1, :], kg[..., k0:k1, :], vg[..., k0:k1, :], visible)
        out[..., q0:q1, :], lse[..., q0:q1] = state.result()
    return ungrouped(out, lse, q)


def paged_flash_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, block_tables, lengths,
                          positions: torch.Tensor, block_q: int = 64, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention`'s loop over a paged cache: the key tile is one pool block, found through the block table.

    Takes what `minillm.cache.paged.paged_attention` (the reference) takes: q [B, H, T, hd];
    block_tables: B lists of block ids; lengths: B ints, keys stored per sequence;
    positions long [B, T], query t of sequence b seeing keys 0 .. positions[b, t] (a
    padding query, position -1, sees nothing and gets zeros). Nothing is gathered: each
    block is read in place from the pool [num_blocks, block_size, KV, hd], and the walk
    along the table stops at the block after the tile's last visible key.
    Returns (out [B, H, T, hd], lse [B, H, T]).
    """
    B, H, T, hd = q.shape
    KV, bs = cache.n_kv_head, cache.block_size
    if H % KV:
        raise ValueError(f"{H} query heads cannot share {KV} key heads: H must be a multiple of KV")
    k_pool, v_pool = cache.k[layer], cache.v[layer]  # [num_blocks, block_size, KV, hd]
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(B, KV, H // KV, T, hd, dtype=compute, device=q.device)
    lse = torch.empty(B, KV, H // KV, T, dtype=compute, device=q.device)
    for b in range(B):
        length, table = int(lengths[b]), block_tables[b]
        if blocks_for(length, bs) > len(table) or int(positions[b].max()) >= length:
            raise ValueError(f"sequence {b}: {length} keys in a table of {len(table)} blocks of {bs}, queries up to "
                             f"position {int(positions[b].max())}: write the step's keys and blocks before attention")
        qb = q[b].to(compute).view(KV, H // KV, T, hd)
        for q0 in range(0, T, block_q):
            q1 = min(q0 + block_q, T)
            seen = positions[b, q0:q1].to(q.device)  # [Tq]: each query sees keys 0 .. seen
            state = OnlineSoftmax(qb[..., q0:q1, :].shape[:-1], hd, compute, q.device, scale_of(q, scale))
            for i in range(blocks_for(min(length, int(seen.max()) + 1), bs)):
                k0, k1 = i * bs, min(i * bs + bs, length)
                block = table[i]
                keys = k_pool[block, : k1 - k0].to(compute).permute(1, 0, 2)[:, None]  # [KV, 1, Sk, hd]
                values = v_pool[block, : k1 - k0].to(compute).permute(1, 0, 2)[:, None]
                visible = torch.arange(k0, k1, device=q.device)[None, :] <= seen[:, None]  # [Tq, Sk]
                state.update(qb[..., q0:q1, :], keys, values, visible)
            out[b, ..., q0:q1, :], lse[b, ..., q0:q1] = state.result()
    return ungrouped(out, lse, q)


# ------------------------------------------------------------------ as backends of the model


class KernelBackend:
    """An attention backend (`backend(q, k, v, step) -> y`) running one of the functions above.

    Continuous batching's packed steps (`step.packed`) read a paged cache and are
    `minillm.cache.paged.PagedAttention`'s to compute: wrap this backend in it to serve them.
    """

    def __init__(self, name: str, kernel, **options):
        self.name, self.kernel, self.options = name, kernel, options

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        if step.packed is not None:
            raise ValueError(f"the {self.name} attention backend computes padded and tree steps, not packed "
                             f"continuous-batching steps: install minillm.cache.paged.PagedAttention over it")
        return self.kernel(q, k, v, step.mask, **self.options)[0]


BACKENDS = ("sdpa", "naive", "flash")


def make_backend(name: str, block_q: int | None = None, block_k: int | None = None):
    """The attention backend called `name`: sdpa (PyTorch's kernel, the default), naive, or flash with
    tiles of block_q queries and block_k keys (64 each unless given)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name != "flash" and (block_q, block_k) != (None, None):
        raise ValueError(f"tile sizes apply to the flash backend only, not {name!r}: drop block_q and block_k")
    if name == "sdpa":
        return SDPABackend()
    if name == "naive":
        return KernelBackend("naive", naive_attention)
    return KernelBackend("flash", flash_attention, block_q=64 if block_q is None else block_q,
                         block_k=64 if block_k is None else block_k)


__all__ = ["BACKENDS", "KernelBackend", "OnlineSoftmax", "check_shapes", "flash_attention", "make_backend",
           "naive_attention", "online_softmax_attention", "paged_flash_attention"]
