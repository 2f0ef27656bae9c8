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


def check_against_sdpa(device: str = "cuda") -> float:
    """The largest difference from SDPA (outputs) and from `naive_attention` (log-sum-exps) over prefill,
    chunk-after-prefix and decode shapes with odd lengths and tiles that do not divide them."""
    sdpa, worst = SDPABackend(), 0.0
    gen = torch.Generator().manual_seed(0)
    for B, H, KV, T, S in ((2, 6, 2, 37, 37), (1, 9, 3, 13, 45), (3, 4, 4, 1, 50)):
        q = torch.randn(B, H, T, 64, generator=gen).to(device)
        k, v = (torch.randn(B, KV, S, 64, generator=gen).to(device) for _ in range(2))
        out, lse = triton_flash_attention(q, k, v, block_q=16, block_k=16)
        expected = sdpa(q, k, v, AttentionStep(torch.zeros(B, T, dtype=torch.long, device=device)))
        worst = max(worst, float((out - expected).abs().max()), float((lse - naive_attention(q, k, v)[1]).abs().max()))
    return worst


__all__ = ["check_against_sdpa", "triton_flash_attention"]
