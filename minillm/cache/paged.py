"""A paged KV cache: a pool of fixed-size blocks, a block table per sequence, prefix caching.

Why paging. A contiguous cache (lesson 06's `StaticCache`) gives each row one strip of
`max_len` columns. A server does not know how long a request will run, so it reserves
the longest it might be, and most of that reservation is never written; finished rows
leave holes of different sizes that a new request may not fit into (fragmentation).
vLLM's PagedAttention (Kwon et al., 2023) borrows the operating system's answer: cut the
storage into small blocks of `block_size` token slots and give each sequence a *block
table*, the list of blocks that hold its tokens in order, like a page table maps virtual
pages to physical frames. A sequence takes one more block only when its last one is
full, so at most `block_size - 1` slots per sequence are unused, and any free block
serves any sequence, so there is no fragmentation. The price: a sequence's keys are no
longer contiguous, so attention reads them through the block table.

    token at position p  ->  block_table[p // block_size], offset p % block_size
    slot = block_table[p // block_size] * block_size + p % block_size   (its row in the pool)

Here: the bookkeeping of which blocks each sequence holds, and prefix caching, are
`minillm.cache.blocks`'s (`BlockManager`); this module holds the storage and the reads:
`PagedKVCache` (the per-layer block pools: write at slots, gather a sequence back),
`PackedSequences` (one continuous-batching step's tokens back to back, with what attention
needs to find each sequence's keys), `paged_attention` (a clear reference that gathers each
sequence's keys through its block table) and `PagedAttention`, the backend the engine's
runner installs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..model.attention import attention_with_sinks, within_window
from .blocks import blocks_for


def slot_mapping(block_table, positions, block_size: int) -> torch.Tensor:
    """The pool rows (slots) of a sequence's tokens at `positions`. long [len(positions)]"""
    table = torch.as_tensor(block_table, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


@dataclass
class PackedSequences:
    """One continuous-batching step: several sequences' new tokens packed into one row.

    Sequence i contributes counts[i] new tokens at positions starts[i] .. starts[i] +
    counts[i] - 1 (a prefill, a chunk of one, or a single decode token), so the row holds
    N = sum(counts) tokens with no padding. Everything attention needs to find each
    sequence's keys in the pool is computed once here, not once per layer. Attention
    gathers keys a whole block at a time (one contiguous copy of block_size tokens per
    block, not one per token); the slots after a sequence's last key are masked out.
    """

    slots: torch.Tensor  # long [N]: the pool row each new token's keys go to
    positions: torch.Tensor  # long [N]: each new token's position in its own sequence
    query_starts: list[int]  # sequence i's new tokens are row entries query_starts[i] .. query_starts[i + 1] - 1
    decode_queries: torch.Tensor  # long [D]: row entry of each one-token sequence's query
    decode_blocks: torch.Tensor  # long [D, nb]: their block tables, padded to the longest with block 0
    decode_mask: torch.Tensor  # bool [D, 1, 1, nb * block_size]: True at each sequence's keys
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (first, end, block table [nb], causal [n, nb * bs])

    @classmethod
    def build(cls, block_tables: list[list[int]], starts: list[int], counts: list[int], block_size: int,
              device=None) -> "PackedSequences":
        if not counts or min(counts) < 1:
            raise ValueError(f"every packed sequence needs at least one new token, got counts {counts}")
        key_lengths = [s + n for s, n in zip(starts, counts)]  # keys each sequence attends over
        query_starts = [0]
        for n in counts:
            query_starts.append(query_starts[-1] + n)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        tables = [torch.as_tensor(table[: blocks_for(n, block_size)], dtype=torch.long)
                  for table, n in zip(block_tables, key_lengths)]  # the blocks holding each sequence's keys
        slots = torch.cat([slot_mapping(table, torch.arange(s, s + n), block_size)
                           for table, s, n in zip(tables, starts, counts)])
        decode = [i for i, n in enumerate(counts) if n == 1]
        widest = max((len(tables[i]) for i in decode), default=0)
        decode_blocks = torch.zeros(len(decode), widest, dtype=torch.long)
        decode_mask = torch.zeros(len(decode), 1, 1, widest * block_size, dtype=torch.bool)
        for row, i in enumerate(decode):
            decode_blocks[row, : len(tables[i])] = tables[i]
            decode_mask[row, ..., : key_lengths[i]] = True
        # A chunk's query t (position starts[i] + t) sees keys up to its own position; the slots past
        # the sequence's last key lie beyond every query's position, so the causal mask hides them too.
        chunks = [(query_starts[i], query_starts[i + 1], tables[i].to(device),
                   torch.ones(n, len(tables[i]) * block_size, dtype=torch.bool, device=device)
                   .tril(diagonal=starts[i])) for i, n in enumerate(counts) if n > 1]
        return cls(slots.to(device), positions.to(device), query_starts,
                   torch.tensor([query_starts[i] for i in decode], dtype=torch.long, device=device),
                   decode_blocks.to(device), decode_mask.to(device), chunks)

    def windowed(self, window: int) -> "PackedSequences":
        """The same step for a sliding-window layer: each query also hides the keys `window` or more positions
        behind it (a sequence's keys are gathered in position order, so key column j is position j)."""
        decode_mask = self.decode_mask & within_window(self.positions[self.decode_queries], self.decode_mask.shape[-1],
                                                       window)[:, None, None]
        chunks = [(first, end, table, causal & within_window(self.positions[first:end], causal.shape[1], window))
                  for first, end, table, causal in self.chunks]
        return replace(self, decode_mask=decode_mask, chunks=chunks)

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    @property
    def last_tokens(self) -> torch.Tensor:
        """long [num sequences]: the row entry of each sequence's last new token (where its logits are)."""
        return torch.tensor(self.query_starts[1:], device=self.slots.device) - 1


class PagedKVCache:
    """The per-layer block pools that `BlockManager`'s block ids index.

    Layout: k[layer], v[layer] are [num_blocks, block_size, n_kv_head, head_dim], the layout
    vLLM's flash-attention backend uses. Flattened to [num_blocks * block_size, n_kv_head,
    head_dim] (a view, no copy), row `slot` is one token's keys, so writing a step's new
    tokens is one indexed copy at their slots and gathering a sequence is one indexed read.
    (A head-major [num_blocks, n_kv_head, block_size, head_dim] layout would need a
    two-index write and a copy to put a sequence's tokens back in order.)

    As the model's cache (`model(..., cache=paged, packed=step)`), it honours the one call
    the model makes, `update(layer, k_new, v_new)`: the engine first names the step with
    `begin_step(packed)`, `update` writes the step's keys at its slots and returns the
    layer's whole pool, and the attention backend (`PagedAttention`) reads each sequence's
    keys out of it. Rolling back, reordering and freeing are the block manager's business:
    a sequence's keys are wherever its block table says.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype=torch.float32, device=None, value_dim: int | None = None):
        shape = (n_layer, num_blocks, block_size, n_kv_head, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(*shape[:-1], head_dim if value_dim is None else value_dim, dtype=dtype, device=device)
        self.n_layer, self.num_blocks, self.block_size = n_layer, num_blocks, block_size
        self.n_kv_head, self.head_dim = n_kv_head, head_dim

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> "PagedKVCache":
        c = model.config
        heads, key, value = c.cache_widths
        return cls(c.n_layer, heads, key, num_blocks, block_size, dtype=model.dtype, device=model.device,
                   value_dim=value)

    def begin_step(self, packed: PackedSequences) -> None:
        """The next forward writes these new tokens (at packed.slots)."""
        self.step = packed

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new [1, KV, N, hd] (the packed row) -> stored; returns the layer's pools
        [num_blocks, block_size, KV, hd]."""
        step = getattr(self, "step", None)
        if step is None or step.num_tokens != k_new.shape[2] or k_new.shape[0] != 1:
            raise ValueError(f"a paged cache stores one packed row of the tokens named by begin_step(); got keys "
                             f"of shape {list(k_new.shape)}: call begin_step(PackedSequences.build(...)) first")
        self.write(layer, step.slots, k_new[0].transpose(0, 1), v_new[0].transpose(0, 1))
        return self.k[layer], self.v[layer]

    def slots_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pools as [num_blocks * block_size, n_kv_head, head_dim] views: row = slot."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)

    def block_pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values, one [num_blocks, block_size, n_kv_head, head_dim] view per layer (what the compiled
        step writes into and reads through its block tables)."""
        return list(self.k), list(self.v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's keys and values in every layer (`BlockManager`'s copy-on-write)."""
        if copies:
            source, destination = (torch.tensor(blocks, device=self.k.device) for blocks in zip(*copies))
            for pool in (self.k, self.v):
                pool[:, destination] = pool[:, source]

    def write(self, layer: int, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store N tokens' keys and values at their slots. slots long [N]; k_new, v_new [N, n_kv_head, head_dim]."""
        k_pool, v_pool = self.slots_view(layer)
        slots = torch.as_tensor(slots, dtype=torch.long, device=k_pool.device)
        k_pool[slots] = k_new.to(k_pool.dtype)
        v_pool[slots] = v_new.to(v_pool.dtype)

    def gather(self, layer: int, block_table, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` tokens' keys and values, in order. k, v [n_kv_head, length, head_dim]"""
        if blocks_for(length, self.block_size) > len(block_table):
            raise ValueError(f"a block table of {len(block_table)} blocks holds at most "
                             f"{len(block_table) * self.block_size} tokens, not {length}")
        slots = slot_mapping(block_table, torch.arange(length), self.block_size).to(self.k.device)
        k_pool, v_pool = self.slots_view(layer)
        return k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, block_tables, lengths,
                    positions: torch.Tensor) -> torch.Tensor:
    """Attention of each sequence's queries over its keys read through its block table (reference).

    q [B, H, T, hd]; block_tables: B lists of block ids; lengths: B ints, tokens stored per
    sequence (the new ones written already); positions long [B, T]: query t of sequence b
    sees keys 0 .. positions[b, t] (causal). A padding query (position -1) sees nothing and
    gets zeros. Query head h reads key head h // (H // n_kv_head) (grouped-query heads).
    Returns [B, H, T, hd].
    """
    B, H, T, hd = q.shape
    group = H // cache.n_kv_head
    out = torch.zeros_like(q)
    for b in range(B):
        length = int(lengths[b])
        if int(positions[b].max()) >= length:
            raise ValueError(f"sequence {b}: a query at position {int(positions[b].max())} but only {length} "
                             f"keys are stored; write the step's keys before attention")
        k, v = cache.gather(layer, block_tables[b], length)  # [KV, L, hd]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [H, L, hd]
        scores = q[b] @ k.transpose(1, 2).to(q.dtype) / math.sqrt(hd)  # [H, T, L]
        visible = torch.arange(length, device=q.device)[None, :] <= positions[b][:, None].to(q.device)  # [T, L]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        weights = weights.masked_fill(~visible.any(dim=-1)[:, None], 0.0)  # padding queries: zeros, not NaN
        out[b] = weights @ v.to(q.dtype)
    return out


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """pool [num_blocks, block_size, KV, hd], tables long [..., nb] -> keys [..., KV, nb * block_size, hd]."""
    _, bs, KV, hd = pool.shape
    gathered = pool.index_select(0, tables.flatten()).view(*tables.shape[:-1], tables.shape[-1] * bs, KV, hd)
    return gathered.transpose(-3, -2)


def packed_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, packed: PackedSequences,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a packed step, each sequence over its own keys read from the pool.

    q [1, H, N, hd]; k_pool [num_blocks, block_size, KV, hd], v_pool [..., KV, hv] (one layer's pools; the
    values' width hv is hd but for latent attention's, which reads its values off its keys).
    The one-token sequences (decodes) run as one batch: their blocks gathered into
    [D, KV, L, hd], padded to the longest and masked, and each KV head's `group` query
    heads treated as `group` queries of that head, as `SDPABackend` decodes. Each longer
    chunk (a prefill) runs alone, causal after the keys already in its sequence. A layer
    with sinks (gpt-oss) runs both through `attention_with_sinks`.
    Returns [1, H, N, hv], the same as `paged_attention` gives (the reference).
    """
    H, hd = q.shape[1], q.shape[3]
    KV = k_pool.shape[2]
    group = H // KV
    out = q.new_empty(*q.shape[:-1], v_pool.shape[-1])
    D = len(packed.decode_queries)
    if D:
        queries = q[0, :, packed.decode_queries].transpose(0, 1)  # [D, H, hd]
        keys = gather_blocks(k_pool, packed.decode_blocks)  # [D, KV, L, hd]
        values = gather_blocks(v_pool, packed.decode_blocks)
        if sinks is not None:
            y = attention_with_sinks(queries[:, :, None], keys, values, packed.decode_mask, sinks)  # [D, H, 1, hd]
        else:  # [D, KV, group, hd]
            y = F.scaled_dot_product_attention(queries.reshape(D, KV, group, hd), keys, values,
                                               attn_mask=packed.decode_mask)
        out[0, :, packed.decode_queries] = y.reshape(D, H, -1).transpose(0, 1)
    for first, end, table, causal in packed.chunks:
        keys = gather_blocks(k_pool, table)[None]  # [1, KV, L, hd]
        values = gather_blocks(v_pool, table)[None]
        if sinks is not None:
            out[:, :, first:end] = attention_with_sinks(q[:, :, first:end], keys, values, causal, sinks)
            continue
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out[:, :, first:end] = F.scaled_dot_product_attention(q[:, :, first:end], keys, values, attn_mask=causal)
    return out


class PagedAttention:
    """An attention backend for packed steps over a paged cache, wrapping the model's own backend.

    Steps that carry `step.packed` are computed by `packed_attention`; every other step
    (plain, padded, tree) goes to the wrapped backend unchanged, so installing it never
    changes what the rest of the course computes with the same model.
    """

    name = "paged"

    def __init__(self, inner):
        self.inner = inner
        self.handles_sinks = getattr(inner, "handles_sinks", False)  # packed steps always do

    def __call__(self, q, k, v, step):
        if step.packed is None:
            return self.inner(q, k, v, step)
        return packed_attention(q, k, v, step.packed, step.sinks)

    @staticmethod
    def install(model) -> None:
        """Wrap each attention layer's backend (once; a layer already wrapped is left alone)."""
        for block in model.blocks:
            if not isinstance(block.attn.backend, PagedAttention):
                block.attn.backend = PagedAttention(block.attn.backend)


__all__ = ["PackedSequences", "PagedAttention", "PagedKVCache", "packed_attention", "paged_attention",
           "slot_mapping"]
