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

Prefix caching. Requests often begin with the same tokens (a system prompt, a few-shot
preamble). Keys and values at a position depend only on the tokens up to it, so a full
block can be shared by every sequence whose tokens up to that block's end are the same.
A full block is named by a chained hash, hash((previous block's hash, the block's
tokens)), which stands for the whole prefix; a new sequence walks its full blocks in
order and reuses each one found in the cache, up to its first miss. A hash can collide,
so a hit is confirmed: the stored tokens must equal the sequence's, and the block's
parent must be the very block (in the same use) that the sequence's previous block is,
so by induction from the first block the whole prefix is the same and a collision can
only cost a miss, never hand out another prefix's keys. A shared block has a reference
count; `free` decrements it, and a block nobody holds goes back to the free list but
keeps its contents and its hash, so a later request can still hit it until the block's
storage is reused (then its hash is evicted). Freed blocks are reused oldest first, and
blocks holding nothing reusable before any cached one, so popular prefixes live longest
(an LRU cache for free).

Two rules keep shared blocks read-only. Only full blocks are shared: a sequence appends
into its own partial last block. And the last token of a new sequence is never a hit:
its logits are needed, so it is computed again, into a block of its own.

A block joins the prefix cache only once its keys are written, or are being written by
the forward about to run: the caller (the scheduler) says how far with `mark_computed`.
Within one forward every layer writes all new keys before any sequence's attention
reads them, so a sequence admitted in the same step that hits the block reads finished
keys. Registering as soon as the tokens are known would let another request hit a block
whose keys a chunked prefill has not reached yet.

Here: `BlockManager` (bookkeeping only: which blocks each sequence holds, reference
counts, the prefix cache), `PagedKVCache` (the per-layer block pools: write at slots,
gather a sequence back), and `paged_attention`, a clear reference that gathers each
sequence's keys through its block table and runs plain softmax attention on them.
Wiring into the model's forward (an `update` that writes at the step's slots, and an
attention backend that calls `paged_attention`) is the engine's job.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class _SequenceState:
    tokens: list[int]  # every token the sequence holds a slot for
    table: list[int]  # its block table: block ids in token order
    hashes: list[int]  # chained hash of each of its full blocks
    cached_tokens: int  # leading tokens whose keys came from the prefix cache at allocation
    registered: int  # leading full blocks entered in the prefix cache (their keys are written)


@dataclass
class _Plan:
    """What `allocate` would do for a token list, computed before anything changes."""

    hits: list[int] = field(default_factory=list)  # cached blocks reused, in order
    full: list[tuple[int, tuple]] = field(default_factory=list)  # (chained hash, tokens) per full block
    blocks: int = 0  # blocks the sequence needs in all
    free_needed: int = 0  # blocks taken off the free list (new ones + hits nobody holds)


class BlockManager:
    """Which pool blocks each sequence holds, their reference counts, and the prefix cache.

    No tensors here: the manager hands out block ids; `PagedKVCache` holds the storage.
    `allocate` / `append` raise RuntimeError when the pool is momentarily full (free or
    preempt a sequence first; `can_allocate` / `can_append` ask beforehand) and ValueError
    for requests that can never succeed.

    hash_fn: the block hash (Python's `hash` by default; vLLM offers sha256 so that
    colliding prefixes cannot even be crafted). Hits are confirmed either way; the tests
    pass a weak one to check that. prefix_caching=False turns the prefix cache off (what
    it saves is then measurable).
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn=hash, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager({num_blocks}, {block_size}): need at least one block of at least one slot")
        self.num_blocks, self.block_size, self.hash_fn = num_blocks, block_size, hash_fn
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks  # sequences holding each block (read-only outside)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # reuse order: first = next
        self._cache: dict[int, int] = {}  # prefix cache: block hash -> block id
        self._block_hash: list[int | None] = [None] * num_blocks  # the hash a block is cached under
        self._block_key: list[tuple | None] = [None] * num_blocks  # (parent block, its use, tokens): confirms a hit
        self._uses = [0] * num_blocks  # how often each block was taken off the free list
        self._seqs: dict[object, _SequenceState] = {}
        self.prompt_tokens = 0  # tokens passed to `allocate`, summed
        self.prefix_hit_tokens = 0  # of those, tokens whose keys were reused from the prefix cache

    # ---------------------------------------------------------------- queries

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some still hold a cached prefix until reused)."""
        return len(self._free)

    @property
    def free_blocks(self) -> tuple[int, ...]:
        """The free block ids in the order they will be reused."""
        return tuple(self._free)

    @property
    def capacity(self) -> int:
        """Token slots in the whole pool: the longest sequence that can ever fit."""
        return self.num_blocks * self.block_size

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id).tokens)

    def cached_tokens(self, seq_id) -> int:
        """Leading tokens whose keys were already in the pool at allocation: the forward skips them."""
        return self._seq(seq_id).cached_tokens

    def is_cached(self, block: int) -> bool:
        """Whether the block is registered in the prefix cache (a later request can hit it)."""
        return self._block_hash[block] is not None

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def check_fits(self, n_tokens: int) -> None:
        """ValueError if a sequence of n_tokens can never fit the pool, however much is freed."""
        needed = blocks_for(n_tokens, self.block_size)
        if needed > self.num_blocks:
            raise ValueError(f"a sequence of {n_tokens} tokens needs {needed} blocks of {self.block_size}, but the "
                             f"pool has {self.num_blocks} ({self.capacity} tokens): shorten it or build a larger pool")

    def can_allocate(self, tokens) -> bool:
        """Whether `allocate` would succeed now. tokens: a count (assumes no prefix hit: conservative)
        or the token list itself (prefix hits counted exactly)."""
        if isinstance(tokens, int):
            return blocks_for(tokens, self.block_size) <= self.num_free
        fits_ever = blocks_for(len(tokens), self.block_size) <= self.num_blocks
        return fits_ever and self._plan(tokens).free_needed <= self.num_free

    def can_append(self, seq_id) -> bool:
        """Whether `append` would succeed now (it needs a free block when the last one is full)."""
        n = len(self._seq(seq_id).tokens)
        return n % self.block_size != 0 or (self.num_free > 0 and blocks_for(n + 1, self.block_size) <= self.num_blocks)

    # ---------------------------------------------------------------- changes

    def allocate(self, seq_id, tokens) -> list[int]:
        """Give a new sequence blocks for its tokens, reusing cached full blocks; returns its block table.

        All or nothing: if the pool cannot hold it now, RuntimeError and nothing changes.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks: free it before allocating again")
        tokens = list(tokens)
        self.check_fits(len(tokens))
        plan = self._plan(tokens)
        if plan.free_needed > self.num_free:
            raise RuntimeError(f"sequence {seq_id!r} needs {plan.free_needed} free blocks, {self.num_free} are "
                               f"free: free or preempt a sequence first (can_allocate asks beforehand)")
        for block in plan.hits:  # claim the hits first, so taking new blocks cannot evict them
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        table = plan.hits + [self._take_free_block() for _ in range(plan.blocks - len(plan.hits))]
        cached = len(plan.hits) * self.block_size
        self._seqs[seq_id] = _SequenceState(tokens, table, [h for h, _ in plan.full], cached, len(plan.hits))
        self.prompt_tokens += len(tokens)
        self.prefix_hit_tokens += cached
        return list(table)

    def append(self, seq_id, token: int) -> int:
        """Reserve the slot for one more token; returns the slot (a row of the pool).

        Takes a free block when the last one is full. A block this token fills joins the
        prefix cache once `mark_computed` says its keys are written.
        """
        seq = self._seq(seq_id)
        n = len(seq.tokens)
        if n % self.block_size == 0:
            self.check_fits(n + 1)
            if not self._free:
                raise RuntimeError(f"no free block for sequence {seq_id!r}'s token {n}: "
                                   f"free or preempt a sequence first (can_append asks beforehand)")
            seq.table.append(self._take_free_block())
        seq.tokens.append(token)
        if (n + 1) % self.block_size == 0:
            block_tokens = tuple(seq.tokens[-self.block_size:])
            seq.hashes.append(self.hash_fn((seq.hashes[-1] if seq.hashes else None, block_tokens)))
        return seq.table[n // self.block_size] * self.block_size + n % self.block_size

    def mark_computed(self, seq_id, n_tokens: int) -> None:
        """The keys of the sequence's first n_tokens are written (or will be by the forward about to run):
        its full blocks among them join the prefix cache."""
        seq = self._seq(seq_id)
        if not 0 <= n_tokens <= len(seq.tokens):
            raise ValueError(f"mark_computed({seq_id!r}, {n_tokens}): the sequence holds {len(seq.tokens)} tokens")
        bs = self.block_size
        for i in range(seq.registered, n_tokens // bs if self.prefix_caching else 0):
            self._register(seq.table, i, seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]))
        seq.registered = max(seq.registered, n_tokens // bs)

    def free(self, seq_id) -> None:
        """Release a finished, aborted or preempted sequence's blocks (shared ones stay with their other holders)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for block in reversed(seq.table):  # a sequence's tail is the least likely to be shared: reuse it first
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if not self.is_cached(block):  # nothing worth keeping: reuse before any cached block
                    self._free.move_to_end(block, last=False)

    # ---------------------------------------------------------------- inside

    def _seq(self, seq_id) -> _SequenceState:
        if seq_id not in self._seqs:
            raise ValueError(f"unknown sequence {seq_id!r}: it was never allocated or was already freed "
                             f"({len(self._seqs)} sequences hold blocks)")
        return self._seqs[seq_id]

    def _plan(self, tokens: list[int]) -> _Plan:
        bs, plan = self.block_size, _Plan()
        plan.blocks = blocks_for(len(tokens), self.block_size)
        reusable = (len(tokens) - 1) // bs  # full blocks before the last token (which is always computed)
        block_hash = None
        for i in range(len(tokens) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = self.hash_fn((block_hash, block_tokens))
            plan.full.append((block_hash, block_tokens))
            block = self._cache.get(block_hash)
            prefix_still_hits = len(plan.hits) == i  # a prefix ends at its first miss
            if prefix_still_hits and i < reusable and block is not None and \
                    self._block_key[block] == self._key(plan.hits, i, block_tokens):
                plan.hits.append(block)
        plan.free_needed = plan.blocks - len(plan.hits) + sum(self.ref_counts[b] == 0 for b in plan.hits)
        return plan

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        if self.is_cached(block):  # its storage is about to be overwritten: its prefix is gone
            del self._cache[self._block_hash[block]]
            self._block_hash[block] = self._block_key[block] = None
        self.ref_counts[block] = 1
        self._uses[block] += 1
        return block

    def _key(self, table: list[int], i: int, block_tokens: tuple) -> tuple:
        """What block i of `table` must match to be a hit: its parent block in its current use, and its tokens."""
        parent = (table[i - 1], self._uses[table[i - 1]]) if i else None
        return parent, block_tokens

    def _register(self, table: list[int], i: int, block_hash, block_tokens: tuple) -> None:
        """Enter block i of `table`, whose keys are written, into the prefix cache."""
        if block_hash not in self._cache:  # else another block already holds this prefix: keep that one
            block = table[i]
            self._cache[block_hash] = block
            self._block_hash[block], self._block_key[block] = block_hash, self._key(table, i, block_tokens)


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens (the last one possibly part full)."""
    return -(-n_tokens // block_size)


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
                 dtype=torch.float32, device=None):
        shape = (n_layer, num_blocks, block_size, n_kv_head, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_layer, self.num_blocks, self.block_size = n_layer, num_blocks, block_size
        self.n_kv_head, self.head_dim = n_kv_head, head_dim

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> "PagedKVCache":
        c = model.config
        return cls(c.n_layer, c.kv_heads, c.head_size, num_blocks, block_size, dtype=model.dtype, device=model.device)

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


def packed_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     packed: PackedSequences) -> torch.Tensor:
    """Attention for a packed step, each sequence over its own keys read from the pool.

    q [1, H, N, hd]; k_pool, v_pool [num_blocks, block_size, KV, hd] (one layer's pools).
    The one-token sequences (decodes) run as one batch: their blocks gathered into
    [D, KV, L, hd], padded to the longest and masked, and each KV head's `group` query
    heads treated as `group` queries of that head, as `SDPABackend` decodes. Each longer
    chunk (a prefill) runs alone, causal after the keys already in its sequence.
    Returns [1, H, N, hd], the same as `paged_attention` gives (the reference).
    """
    H, hd = q.shape[1], q.shape[3]
    KV = k_pool.shape[2]
    group = H // KV
    out = torch.empty_like(q)
    D = len(packed.decode_queries)
    if D:
        queries = q[0, :, packed.decode_queries].transpose(0, 1).reshape(D, KV, group, hd)
        keys = gather_blocks(k_pool, packed.decode_blocks)  # [D, KV, L, hd]
        values = gather_blocks(v_pool, packed.decode_blocks)
        y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=packed.decode_mask)  # [D, KV, group, hd]
        out[0, :, packed.decode_queries] = y.reshape(D, H, hd).transpose(0, 1)
    for first, end, table, causal in packed.chunks:
        keys = gather_blocks(k_pool, table)[None]  # [1, KV, L, hd]
        values = gather_blocks(v_pool, table)[None]
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

    def __call__(self, q, k, v, step):
        if step.packed is None:
            return self.inner(q, k, v, step)
        return packed_attention(q, k, v, step.packed)

    @staticmethod
    def install(model) -> None:
        """Wrap each attention layer's backend (once; a layer already wrapped is left alone)."""
        for block in model.blocks:
            if not isinstance(block.attn.backend, PagedAttention):
                block.attn.backend = PagedAttention(block.attn.backend)


__all__ = ["BlockManager", "PackedSequences", "PagedAttention", "PagedKVCache", "blocks_for", "packed_attention",
           "paged_attention", "slot_mapping"]
