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
carries a `step.packed` description instead (`minillm.cache.paged.PackedSequences`), which
only a backend that reads paged caches handles (`minillm.cache.paged.PagedAttention` wraps
any other backend and takes those steps itself). A backend is any
callable with that signature; `set_attention_backend` swaps it in every layer, so a
paged, tree-aware, flash-style or compiled kernel is added without editing `model.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionStep:
    """What one forward tells every layer's attention (the same object for all layers)."""

    positions: torch.Tensor  # long [B, T]: each query's position in its sequence
    mask: torch.Tensor | None = None  # bool [B, T, S], True = may attend; None = causal, queries last
    packed: object | None = None  # several sequences packed into one row over a paged cache (`minillm.cache.paged`)
    sinks: torch.Tensor | None = None  # [H]: this layer's learned sink logits (gpt-oss), see `attention_with_sinks`
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # see `once`

    def once(self, key, make):
        """`make()` for the first layer that asks for `key`, the same result for every later one.

        What a backend derives from the step (a mask repeated per query head, say) is the
        same in every layer of one forward; building it once saves a copy per layer.
        """
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]


@functools.lru_cache(maxsize=4)  # every layer of one forward asks for the same mask
def causal_mask_lower_right(num_queries: int, num_keys: int, device=None) -> torch.Tensor:
    """bool [T, S]: query t sees keys 0 .. S - T + t (the queries are the last T positions).

    SDPA's own `is_causal=True` aligns the triangle top-left, which is only right when
    T == S; a chunk that follows a cached prefix needs this lower-right alignment.
    """
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(diagonal=num_keys - num_queries)


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per query head: the head's learned sink (gpt-oss).

        weights = softmax([q·k_1/√hd, ..., q·k_S/√hd, sink_h])[:S]        y = weights · v

    The sink is a key with no value: whatever weight it takes is attention paid to nothing,
    so a head can stay quiet where plain softmax must spread a whole unit of attention over
    the keys it sees (the "attention sink" that models otherwise make of their first token).
    Written out, scores and all, because SDPA has no term for it.

    q [B, H, T, hd]; k, v [B, KV, S, hd]; mask: bool broadcastable to [B, H, T, S] (True = may
    attend), or None for causal with the queries last; sinks [H]. A query that may attend to
    no key gives zeros (all its weight on the sink). Returns [B, H, T, hd].
    """
    B, H, T, hd = q.shape
    group = H // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, S, hd]
    scores = q @ k.transpose(-1, -2) * hd ** -0.5  # [B, H, T, S]
    if mask is None and T > 1:
        mask = causal_mask_lower_right(T, k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return weights @ v


def within_window(positions: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """bool [..., num_keys]: which key columns a query at each of `positions` [...] sees through a sliding window,
    the keys less than `window` positions behind it (column j holds position j; causality is the mask's job)."""
    return positions[..., None] - torch.arange(num_keys, device=positions.device) < window


class SDPABackend:
    """PyTorch's `scaled_dot_product_attention`, with grouped-query heads handled here.

    A query whose mask row is all False gets zeros, not NaN (SDPA's behaviour); callers
    never read such rows (they are padding). A layer with sinks goes to `attention_with_sinks`.
    """

    name = "sdpa"
    handles_sinks = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        B, H, T, hd = q.shape
        KV, S = k.shape[1], k.shape[2]
        group = H // KV
        mask = step.mask
        if step.sinks is not None:
            return attention_with_sinks(q, k, v, mask[:, None] if mask is not None and mask.dim() == 3 else mask,
                                        step.sinks)
        if mask is None and T == S:  # a whole sequence from its start: SDPA's own causal kernel skips the future
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, S, hd]
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        if mask is None and T > 1:
            mask = causal_mask_lower_right(T, S, q.device)  # [T, S]
        elif mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, T, S]: the same mask for every head
        if group == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # Grouped-query heads without copying keys and values: the `group` query heads that share a
        # KV head become group * T queries of that head (SDPA's own enable_gqa is much slower on CPU).
        # Query row g * T + t is head g's query t, so the mask repeats once per head of the group.
        if mask is not None and T > 1:
            mask = step.once(("grouped mask", group, T, S),
                             lambda: mask.repeat(*[1] * (mask.dim() - 2), group, 1))  # [..., group * T, S]
        grouped = F.scaled_dot_product_attention(q.reshape(B, KV, group * T, hd), k, v, attn_mask=mask)
        return grouped.reshape(B, H, T, -1)  # the values' width (latent attention's differs from hd)


def set_attention_backend(model, backend) -> None:
    """Run every attention layer of `model` through `backend` (see the module docstring)."""
    for block in model.blocks:
        block.attn.backend = backend


def uses_default_attention(model) -> bool:
    """Whether every layer runs the default backend (SDPA): a compiled graph writes its own attention, so a run
    asked to use another kernel (lesson 16) must stay eager to use it. A wrapper that only adds a kind of step
    (the engine's `PagedAttention`, which keeps its `inner` backend for every other step) counts as what it wraps."""
    return all(isinstance(getattr(block.attn.backend, "inner", block.attn.backend), SDPABackend)
               for block in model.blocks)


__all__ = ["AttentionStep", "SDPABackend", "attention_with_sinks", "causal_mask_lower_right", "set_attention_backend",
           "uses_default_attention", "within_window"]
