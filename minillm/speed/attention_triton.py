"""Flash attention as a Triton kernel: `minillm.speed.attention_kernels.flash_attention`'s loop, one program per query tile.

Import this module only where `triton` is installed (it is not a requirement of the
course). On a GPU each program, one (query tile, batch row, head), keeps its queries,
running maximum m, denominator l and accumulator in registers and streams the key and
value tiles past them: the [block_q, block_k] scores never leave the chip, which is
the whole point of flash attention (on a CPU the PyTorch version writes each tile to
memory). Without a GPU, `TRITON_INTERPRET=1` (set before triton is imported) runs the
same kernel on CPU tensors through Triton's interpreter: slow, but it checks the kernel.

Causal attention with the T queries the last T of the S keys (lower-right: decode and
chunks after a cached prefix), grouped-query heads; head size a power of two.

Decoding (one query per row) gives that kernel one program per (row, head): nine programs
for the default model at batch 1, on a GPU of 132 multiprocessors. Flash-decoding
(`triton_flash_decode`) splits each row's keys into chunks as well, one program per (row,
head, chunk), each keeping its own running maximum and sum; a second pass weighs the
chunks' outputs by their log-sum-exps (the online softmax's merge, once per chunk), so a
long cache is read by every multiprocessor at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..model.attention import AttentionStep, SDPABackend
from .attention_kernels import naive_attention


@triton.jit
def _flash_forward(Q, K, V, Out, Lse, T, S, H, group, scale,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
                   HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv = h // group  # the key head this query head reads
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query indices 0 .. T - 1
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :]
    q = tl.load(Q + q_offsets, mask=rows[:, None] < T, other=0.0)  # [BLOCK_Q, HEAD_DIM]
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    offset = S - T  # query t sees keys 0 .. offset + t
    k_end = tl.minimum(S, offset + (tile + 1) * BLOCK_Q)  # past the tile's last visible key: skipped
    kv_base = b * stride_kb + kv * stride_kh
    for k0 in range(0, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kv_offsets = kv_base + cols[:, None] * stride_ks + dims[None, :]
        k = tl.load(K + kv_offsets, mask=cols[:, None] < S, other=0.0)  # [BLOCK_K, HEAD_DIM]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_Q, BLOCK_K]
        visible = (cols[None, :] <= rows[:, None] + offset) & (cols[None, :] < S)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        reference = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: no -inf - -inf
        p = tl.exp(scores - reference[:, None])
        correction = tl.exp(m - reference)
        l = l * correction + tl.sum(p, 1)
        v = tl.load(V + kv_offsets, mask=cols[:, None] < S, other=0.0)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(Out + q_offsets, out.to(Out.dtype.element_ty), mask=rows[:, None] < T)
    tl.store(Lse + bh * T + rows, m + tl.log(l), mask=rows < T)


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 64,
                           block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal flash attention, queries last.

    q [B, H, T, hd]; k, v [B, KV, S, hd] -> (out [B, H, T, hd], lse [B, H, T] float32).
    """
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    if H % KV or hd & (hd - 1) or T > S:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}: the Triton kernel needs H a multiple of KV, a "
                         f"power-of-two head size and at most as many queries as keys; use flash_attention")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, block_q), B * H)
    _flash_forward[grid](q, k, v, out, lse, T, S, H, H // KV, 1.0 / math.sqrt(hd),
                         q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                         HEAD_DIM=hd, BLOCK_Q=block_q, BLOCK_K=block_k)
    return out, lse


@triton.jit
def _flash_decode_chunk(Q, K, V, Lengths, Out, Lse, H, group, scale, chunk,
                        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
                        HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr):
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv = h // group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + dims).to(tl.float32)  # [HEAD_DIM]
    length = tl.load(Lengths + b)  # this row's keys: columns 0 .. length - 1
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    m = tl.zeros([1], dtype=tl.float32) - float("inf")  # one-element blocks: loop-carried, typed from the start
    l = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    kv_base = b * stride_kb + kv * stride_kh
    for k0 in range(start, end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        inside = cols < end
        offsets = kv_base + cols[:, None] * stride_ks + dims[None, :]
        k = tl.load(K + offsets, mask=inside[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, HEAD_DIM]
        scores = tl.where(inside, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        correction = tl.exp(m - m_new)
        v = tl.load(V + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
        l = l * correction + tl.sum(p, 0)
        acc = acc * correction + tl.sum(p[:, None] * v, 0)
        m = m_new
    slot = bh * tl.num_programs(1) + split
    empty = l == 0.0  # a chunk past the row's keys: log-sum-exp -inf, so it weighs nothing in the merge
    tl.store(Out + slot * HEAD_DIM + dims, acc / tl.where(empty, 1.0, l))
    tl.store(Lse + slot + tl.arange(0, 1), tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l))))


def triton_flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None,
                        splits: int | None = None, block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over the first `lengths[b]` keys of each row (default: all S), split into chunks.

    q [B, H, 1, hd]; k, v [B, KV, S, hd]; lengths long [B] -> (out [B, H, 1, hd], lse [B, H, 1] float32).
    splits: chunks per row (default: enough for 128 programs, about one per multiprocessor of a
    large GPU, and at most one per `block_k` keys).
    """
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    if T != 1 or H % KV or hd & (hd - 1):
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}: flash-decoding takes one query per row, H a "
                         f"multiple of KV and a power-of-two head size; use triton_flash_attention")
    if lengths is None:
        lengths = torch.full((B,), S, dtype=torch.long, device=q.device)
    if splits is None:
        splits = max(1, min(-(-128 // (B * H)), -(-S // block_k)))
    chunk = -(-S // splits)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    partial = torch.empty(B * H, splits, hd, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(B * H, splits, dtype=torch.float32, device=q.device)
    _flash_decode_chunk[(B * H, splits)](q, k, v, lengths, partial, partial_lse, H, H // KV, 1.0 / math.sqrt(hd),
                                         chunk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                                         HEAD_DIM=hd, BLOCK_K=block_k)
    lse = torch.logsumexp(partial_lse, dim=1)  # [B * H]: the merge of the chunks' softmaxes
    weights = torch.exp(partial_lse - lse[:, None]).nan_to_num(0.0)  # an empty chunk (-inf) weighs 0
    out = (weights[..., None] * partial).sum(1)
    return out.view(B, H, 1, hd).to(q.dtype), lse.view(B, H, 1)


def check_against_sdpa(device: str = "cuda") -> float:
    """The largest difference from SDPA (outputs) and from `naive_attention` (log-sum-exps) over prefill,
    chunk-after-prefix and decode shapes with odd lengths and tiles that do not divide them; and of flash-decoding
    from naive attention over each row's own keys (rows of different lengths, chunks past a row's end, a row of
    one key)."""
    sdpa, worst = SDPABackend(), 0.0
    gen = torch.Generator().manual_seed(0)
    for B, H, KV, T, S in ((2, 6, 2, 37, 37), (1, 9, 3, 13, 45), (3, 4, 4, 1, 50)):
        q = torch.randn(B, H, T, 64, generator=gen).to(device)
        k, v = (torch.randn(B, KV, S, 64, generator=gen).to(device) for _ in range(2))
        out, lse = triton_flash_attention(q, k, v, block_q=16, block_k=16)
        expected = sdpa(q, k, v, AttentionStep(torch.zeros(B, T, dtype=torch.long, device=device)))
        worst = max(worst, float((out - expected).abs().max()), float((lse - naive_attention(q, k, v)[1]).abs().max()))
    decodes = ((2, 6, 2, 50, (50, 17), 4), (1, 9, 3, 45, (45,), None), (3, 4, 4, 40, (1, 40, 33), 7))
    for B, H, KV, S, lengths, splits in decodes:  # rows, heads, key heads, cache, each row's keys, chunks per row
        q = torch.randn(B, H, 1, 64, generator=gen).to(device)
        k, v = (torch.randn(B, KV, S, 64, generator=gen).to(device) for _ in range(2))
        out, lse = triton_flash_decode(q, k, v, torch.tensor(lengths, device=device), splits, block_k=16)
        for b, n in enumerate(lengths):  # each row against naive attention over its own keys alone
            expected, expected_lse = naive_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
            worst = max(worst, float((out[b:b + 1] - expected).abs().max()),
                        float((lse[b:b + 1] - expected_lse).abs().max()))
    return worst


__all__ = ["check_against_sdpa", "triton_flash_attention", "triton_flash_decode"]
