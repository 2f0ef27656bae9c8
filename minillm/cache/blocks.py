"""Which blocks of the paged pool each sequence holds, and prefix caching: `BlockManager` (lesson 12).

A sequence's tokens live in fixed-size blocks of the pool (`minillm.cache.paged`); its
*block table* lists them in order. This module only does the bookkeeping: which blocks are
free, which each sequence holds, their reference counts, and the prefix cache.

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

Two rules keep shared blocks read-only. Only full blocks are shared through the prefix
cache: a sequence appends into its own partial last block. And the last token of a new
sequence is never a hit: its logits are needed, so it is computed again, into a block of
its own.

Forks. Several sequences may also grow from one (a request's n samples, beam search's
beams): `fork` gives the child the parent's whole block table, partial last block
included, each block's reference count raised, so the prompt is computed and stored
once. A block is copied only when a sequence is about to write into one it shares
(copy-on-write, as vLLM does): `append` then takes a free block for it alone and
records (source, destination), which the caller copies in the pool (`take_copies`)
before the forward that writes there. A shared block that no one writes is never copied.

A block joins the prefix cache only once its keys are written, or are being written by
the forward about to run: the caller (the scheduler) says how far with `mark_computed`.
Within one forward every layer writes all new keys before any sequence's attention
reads them, so a sequence admitted in the same step that hits the block reads finished
keys. Registering as soon as the tokens are known would let another request hit a block
whose keys a chunked prefill has not reached yet.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


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
        self._copies: list[tuple[int, int]] = []  # copy-on-write: (source, destination) blocks not copied yet
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
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - len(self._free)

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

    def can_allocate(self, tokens, reuse: bool = True, keep_free: int = 0) -> bool:
        """Whether `allocate` would succeed now and leave `keep_free` blocks free. tokens: a count (assumes no
        prefix hit: conservative) or the token list itself (prefix hits counted exactly)."""
        if isinstance(tokens, int):
            return blocks_for(tokens, self.block_size) + keep_free <= self.num_free
        fits_ever = blocks_for(len(tokens), self.block_size) <= self.num_blocks
        return fits_ever and self._plan(tokens, reuse).free_needed + keep_free <= self.num_free

    def can_append(self, seq_id) -> bool:
        """Whether `append` would succeed now (it needs a free block when the last one is full, or shared)."""
        seq = self._seq(seq_id)
        n = len(seq.tokens)
        in_place = n % self.block_size != 0 and self.ref_counts[seq.table[-1]] == 1
        return in_place or (self.num_free > 0 and blocks_for(n + 1, self.block_size) <= self.num_blocks)

    # ---------------------------------------------------------------- changes

    def allocate(self, seq_id, tokens, reuse: bool = True) -> list[int]:
        """Give a new sequence blocks for its tokens, reusing cached full blocks; returns its block table.

        reuse=False takes no cached block: every position is computed (a sequence whose prompt's
        logits are wanted). All or nothing: if the pool cannot hold it now, RuntimeError and nothing changes.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks: free it before allocating again")
        tokens = list(tokens)
        self.check_fits(len(tokens))
        plan = self._plan(tokens, reuse)
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
        elif self.ref_counts[seq.table[-1]] > 1:  # its partial last block is shared with a fork: copy it first
            if not self._free:
                raise RuntimeError(f"no free block to copy sequence {seq_id!r}'s shared last block into: "
                                   f"free or preempt a sequence first (can_append asks beforehand)")
            shared = seq.table[-1]
            self.ref_counts[shared] -= 1
            seq.table[-1] = self._take_free_block()
            self._copies.append((shared, seq.table[-1]))
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

    def fork(self, parent_id, child_id) -> list[int]:
        """A new sequence `child_id` holding everything `parent_id` holds: the same blocks, shared (see Forks in the
        module docstring); returns its block table. Takes no block now."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already holds blocks: free it before forking into it")
        parent = self._seq(parent_id)
        for block in parent.table:
            self.ref_counts[block] += 1
        self._seqs[child_id] = _SequenceState(list(parent.tokens), list(parent.table), list(parent.hashes),
                                              parent.cached_tokens, parent.registered)
        return list(parent.table)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies copy-on-write asked for since the last call: copy each in the
        pool before the forward that writes into the destination."""
        copies, self._copies = self._copies, []
        return copies

    def truncate(self, seq_id, n_tokens: int) -> None:
        """Keep a sequence's first n_tokens (rejected drafts, prompt padding): the blocks after them are released.
        A full block that becomes the partial last one leaves the prefix cache, since it will be written again."""
        seq = self._seq(seq_id)
        if not 0 <= n_tokens <= len(seq.tokens):
            raise ValueError(f"truncate({seq_id!r}, {n_tokens}): the sequence holds {len(seq.tokens)} tokens")
        bs, kept = self.block_size, blocks_for(n_tokens, self.block_size)
        self._release(seq.table[kept:])
        del seq.table[kept:], seq.tokens[n_tokens:], seq.hashes[n_tokens // bs:]
        seq.registered = min(seq.registered, n_tokens // bs)
        last = seq.table[-1] if n_tokens % bs else None
        if last is not None and self.is_cached(last) and self.ref_counts[last] == 1:
            del self._cache[self._block_hash[last]]
            self._block_hash[last] = self._block_key[last] = None

    def free(self, seq_id) -> None:
        """Release a finished, aborted or preempted sequence's blocks (shared ones stay with their other holders)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self._release(seq.table)

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # a sequence's tail is the least likely to be shared: reuse it first
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

    def _plan(self, tokens: list[int], reuse: bool) -> _Plan:
        bs, plan = self.block_size, _Plan()
        plan.blocks = blocks_for(len(tokens), self.block_size)
        reusable = (len(tokens) - 1) // bs if reuse else 0  # full blocks before the last token (always computed)
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


__all__ = ["BlockManager", "blocks_for"]
