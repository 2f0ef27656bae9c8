"""Attention backends: the seam between the model's attention module and the kernel that runs it.

The model computes queries, keys and values, lets the cache store the new keys and
values, and hands everything attention needs to a backend:

    y = backend(q, k, v, step)
    # q [B, H, T, hd]; k, v [B, KV, S, hd] (every key the cache holds for these rows, S >= T)
    # step: AttentionStep (positions [B, T], mask bool [B, T, S] or None); y [B, H, T, hd]

`mask=None` means plain causal attention where the T queries are the last T of the S
keys. Anything else (padding, rows of different lengths, a token tree) arrives as an
explicit boolean mask, True where a query may attend to a key. A continuous-batching
step packs many sequences into one row and keeps their keys in a paged cache; it
carries a `step.packed` description instead (`minillm.paged.PackedSequences`), which
only a backend that reads paged caches handles (`minillm.paged.PagedAttention` wraps
any other backend and takes those steps itself). A backend is any
callable with that signature; `set_attention_backend` swaps it in every layer, so a
paged, tree-aware, flash-style or compiled kernel is added without editing `model.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionStep:
    """What one forward tells every layer's attention (the same object for all layers)."""

    positions: torch.Tensor  # long [B, T]: each query's position in its sequence
    mask: torch.Tensor | None = None  # bool [B, T, S], True = may attend; None = causal, queries last
    packed: object | None = None  # several sequences packed into one row over a paged cache (`minillm.paged`)


def causal_mask_lower_right(num_queries: int, num_keys: int, device=None) -> torch.Tensor:
    """bool [T, S]: query t sees keys 0 .. S - T + t (the queries are the last T positions).

    SDPA's own `is_causal=True` aligns the triangle top-left, which is only right when
    T == S; a chunk that follows a cached prefix needs this lower-right alignment.
    """
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(diagonal=num_keys - num_queries)


class SDPABackend:
    """PyTorch's `scaled_dot_product_attention`, with grouped-query heads handled here.

    A query whose mask row is all False gets zeros, not NaN (SDPA's behaviour); callers
    never read such rows (they are padding).
    """

    name = "sdpa"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        B, H, T, hd = q.shape
        KV, S = k.shape[1], k.shape[2]
        mask = step.mask
        if mask is None and T > 1 and S > T:
            mask = causal_mask_lower_right(T, S, q.device)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, T, S]: the same mask for every head
        group = H // KV
        if T == 1 and group > 1:
            # Decoding: the `group` query heads that share a KV head become `group` queries
            # of that head. SDPA's own GQA path (enable_gqa) is much slower on CPU.
            return F.scaled_dot_product_attention(q.reshape(B, KV, group, hd), k, v,
                                                  attn_mask=mask).reshape(B, H, T, hd)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, S, hd]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1)


def set_attention_backend(model, backend) -> None:
    """Run every attention layer of `model` through `backend` (see the module docstring)."""
    for block in model.blocks:
        block.attn.backend = backend


__all__ = ["AttentionStep", "SDPABackend", "causal_mask_lower_right", "set_attention_backend"]
