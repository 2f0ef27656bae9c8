"""Lesson 12 (first part): the paged KV cache.

References: a brute-force record of what every pool slot holds (the block manager must
never hand out a block whose contents differ from the sequence's own prefix), counting
the block tables that hold each block (reference counts), and PyTorch's SDPA on the same
keys stored contiguously (paged attention must equal it).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minillm.cache.blocks import BlockManager, blocks_for
from minillm.cache.paged import PagedKVCache, paged_attention, slot_mapping
from minillm.model.attention import causal_mask_lower_right

# ------------------------------------------------------------------ block manager: properties


def weak_hash(key) -> int:
    """Three possible values: different prefixes collide all the time, so every hit must be confirmed."""
    return hash(key) % 3


class BlockManagerMachine(RuleBasedStateMachine):
    """Admissions (often sharing a prefix), forwards, appends, forks, rollbacks, completions and preemptions in any
    order.

    `holds[slot]` is the brute-force record: the whole prefix (tokens 0..p) whose keys the
    test last wrote into that slot. Keys at position p depend on exactly that prefix, so a
    sequence may read a slot only if the record equals its own tokens[:p + 1]. A forward
    (`compute`) writes some of a sequence's pending keys, as a chunked prefill does, and
    only then tells the manager (`mark_computed`): a hit on keys not yet written must never happen.
    A fork shares every block of a sequence whose keys are written; the copies copy-on-write
    asks for are made in the record as the engine makes them in the pool, before the next
    forward: a sequence that wrote into a block another still reads would break the record.
    """

    @initialize(num_blocks=st.integers(1, 10), block_size=st.integers(1, 4),
                prefixes=st.lists(st.lists(st.integers(0, 2), max_size=9), min_size=1, max_size=3),
                hash_fn=st.sampled_from([hash, weak_hash]))
    def setup(self, num_blocks, block_size, prefixes, hash_fn):
        self.manager = BlockManager(num_blocks, block_size, hash_fn)
        self.prefixes = prefixes  # shared "system prompts", so prefix hits happen
        self.tokens: dict[int, list[int]] = {}  # live sequence -> its tokens
        self.computed: dict[int, int] = {}  # live sequence -> leading tokens whose keys are written
        self.waiting: list[list[int]] = []  # preempted sequences' tokens, to be recomputed
        self.holds: dict[int, tuple[int, ...]] = {}
        self.next_id = 0
        self.admitted_tokens = self.hit_tokens = 0

    def snapshot(self):
        m = self.manager
        return m.free_blocks, list(m.ref_counts), {s: m.block_table(s) for s in self.tokens}

    def admit(self, tokens: list[int]) -> bool:
        m, seq_id = self.manager, self.next_id
        before = self.snapshot()
        if blocks_for(len(tokens), m.block_size) > m.num_blocks:
            assert not m.can_allocate(tokens) and not m.can_allocate(len(tokens))
            with pytest.raises(ValueError, match="larger pool"):
                m.allocate(seq_id, tokens)
            assert self.snapshot() == before
            return False
        if not m.can_allocate(tokens):
            assert not m.can_allocate(len(tokens)), "the conservative count said yes where the exact plan says no"
            with pytest.raises(RuntimeError, match="free or preempt"):
                m.allocate(seq_id, tokens)
            assert self.snapshot() == before, "a refused allocation changed the pool"
            return False
        table = m.allocate(seq_id, tokens)
        self.next_id += 1
        cached = m.cached_tokens(seq_id)
        assert cached % m.block_size == 0 and (cached < len(tokens) or cached == 0)
        slots = slot_mapping(table, range(len(tokens)), m.block_size).tolist()
        for p in range(cached):  # a prefix hit: the slot must already hold this very prefix
            assert self.holds.get(slots[p]) == tuple(tokens[: p + 1]), f"hit at position {p} holds other keys"
        self.tokens[seq_id] = list(tokens)
        self.computed[seq_id] = cached  # forwards (`compute`) write the rest
        self.admitted_tokens += len(tokens)
        self.hit_tokens += cached
        return True

    def pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=8))
    def add_request(self, data, suffix):
        prefix = data.draw(st.sampled_from(self.prefixes))
        self.admit(prefix + suffix)

    @rule(data=st.data())
    def compute(self, data):  # a forward writes the keys of some pending tokens
        pending = sorted(s for s, tokens in self.tokens.items() if self.computed[s] < len(tokens))
        if not pending:
            return
        seq_id = data.draw(st.sampled_from(pending))
        self.write_keys(seq_id, data.draw(st.integers(self.computed[seq_id] + 1, len(self.tokens[seq_id]))))

    def write_keys(self, seq_id: int, end: int) -> None:
        m, tokens, start = self.manager, self.tokens[seq_id], self.computed[seq_id]
        slots = slot_mapping(m.block_table(seq_id), range(len(tokens)), m.block_size).tolist()
        for p in range(start, end):
            self.holds[slots[p]] = tuple(tokens[: p + 1])
        m.mark_computed(seq_id, end)
        self.computed[seq_id] = end

    def ready(self) -> list[int]:
        return sorted(s for s, tokens in self.tokens.items() if self.computed[s] == len(tokens))

    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):  # a decoding sequence (all keys written) takes its next token
        if self.ready():
            self.grow(data.draw(st.sampled_from(self.ready())), token)

    def grow(self, seq_id: int, token: int) -> bool:
        m, tokens = self.manager, self.tokens[seq_id]
        before = self.snapshot()
        if blocks_for(len(tokens) + 1, m.block_size) > m.num_blocks:
            assert not m.can_append(seq_id)
            with pytest.raises(ValueError, match="larger pool"):
                m.append(seq_id, token)
        elif not m.can_append(seq_id):
            with pytest.raises(RuntimeError, match="free or preempt"):
                m.append(seq_id, token)
        else:
            slot = m.append(seq_id, token)
            tokens.append(token)
            assert slot == slot_mapping(m.block_table(seq_id), [len(tokens) - 1], m.block_size).item()
            for source, destination in m.take_copies():  # what the engine copies in the pool before the forward
                for offset in range(m.block_size):
                    if source * m.block_size + offset in self.holds:
                        self.holds[destination * m.block_size + offset] = self.holds[source * m.block_size + offset]
            return True
        assert self.snapshot() == before and m.take_copies() == [], "a refused append changed the pool"
        return False

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True))
    def fork(self, data, tokens):  # n samples or beams from one computed sequence: every block shared, none taken
        """Then (often) parent and child each take a different token and write its keys, as two samples do."""
        if not self.ready():
            return
        m, parent, child = self.manager, data.draw(st.sampled_from(self.ready())), self.next_id
        free = m.num_free
        assert m.fork(parent, child) == m.block_table(parent) and m.num_free == free
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
        self.next_id += 1
        for seq_id, token in zip((child, parent), tokens):
            if self.grow(seq_id, token):
                self.write_keys(seq_id, len(self.tokens[seq_id]))

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=2))
    def rollback(self, data, tokens):  # rejected drafts: keep a sequence's first n tokens, then decode others
        if self.tokens:
            seq_id = self.pick(data)
            n = data.draw(st.integers(0, len(self.tokens[seq_id])))
            self.manager.truncate(seq_id, n)
            del self.tokens[seq_id][n:]
            self.computed[seq_id] = min(self.computed[seq_id], n)
            for token in tokens if self.computed[seq_id] == n else ():
                if self.grow(seq_id, token):
                    self.write_keys(seq_id, len(self.tokens[seq_id]))

    @rule(data=st.data())
    def finish(self, data):  # completion or abort: the blocks go back
        if self.tokens:
            seq_id = self.pick(data)
            self.manager.free(seq_id)
            del self.tokens[seq_id], self.computed[seq_id]

    @rule(data=st.data())
    def preempt(self, data):  # free now, recompute everything later under a new id
        if self.tokens:
            seq_id = self.pick(data)
            self.manager.free(seq_id)
            self.waiting.append(self.tokens.pop(seq_id))
            del self.computed[seq_id]

    @rule(data=st.data())
    def readmit(self, data):
        if self.waiting:
            i = data.draw(st.integers(0, len(self.waiting) - 1))
            if self.admit(self.waiting[i]):
                self.waiting.pop(i)

    @invariant()
    def blocks_are_free_or_held(self):
        m = self.manager
        free = m.free_blocks
        assert len(set(free)) == len(free) == m.num_free
        assert set(free) == {b for b, n in enumerate(m.ref_counts) if n == 0}
        assert m.num_free + sum(n > 0 for n in m.ref_counts) == m.num_blocks

    @invariant()
    def ref_counts_equal_holders(self):
        m = self.manager
        holders = Counter(b for seq_id in self.tokens for b in m.block_table(seq_id))
        assert m.ref_counts == [holders[b] for b in range(m.num_blocks)]

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        m = self.manager
        for seq_id, tokens in self.tokens.items():
            table = m.block_table(seq_id)
            assert len(table) == blocks_for(len(tokens), m.block_size) and m.num_tokens(seq_id) == len(tokens)
            written = self.computed[seq_id]
            slots = slot_mapping(table, range(written), m.block_size).tolist()
            assert [self.holds.get(s) for s in slots] == [tuple(tokens[: p + 1]) for p in range(written)]

    @invariant()
    def counters_add_up(self):
        assert (self.manager.prompt_tokens, self.manager.prefix_hit_tokens) == (self.admitted_tokens, self.hit_tokens)

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        assert self.manager.num_free == self.manager.num_blocks, "blocks leaked"
        assert self.manager.ref_counts == [0] * self.manager.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_block_manager_properties = BlockManagerMachine.TestCase


# ------------------------------------------------------------------ block manager: prefix caching by example


def test_a_fork_shares_every_block_and_copies_a_shared_block_only_when_written():
    m = BlockManager(4, 4)
    full, partial = m.allocate("parent", [1, 2, 3, 4, 5, 6])  # a full block and a partial one
    m.mark_computed("parent", 6)
    assert m.fork("parent", "child") == [full, partial] and m.num_free == 2
    assert m.ref_counts[full] == m.ref_counts[partial] == 2
    m.append("child", 7)  # into the shared partial block: the child gets its own copy first
    (own,) = set(m.block_table("child")) - {full, partial}
    assert m.block_table("child") == [full, own] and m.take_copies() == [(partial, own)] and m.take_copies() == []
    m.append("parent", 8)  # the partial block is the parent's alone now: written in place
    assert m.block_table("parent") == [full, partial] and m.take_copies() == []
    assert (m.ref_counts[full], m.ref_counts[partial], m.ref_counts[own]) == (2, 1, 1)
    m.allocate("other", [9])  # the last free block
    m.fork("child", "grandchild")
    assert not m.can_append("grandchild")  # a shared partial block and no free block to copy it into
    with pytest.raises(RuntimeError, match="no free block to copy"):
        m.append("grandchild", 1)
    for seq in ("parent", "child", "grandchild", "other"):
        m.free(seq)
    assert m.num_free == 4 and m.ref_counts == [0] * 4


def test_a_block_rolled_back_into_leaves_the_prefix_cache():
    """Its slots past the cut will hold other keys: a later request with the old prefix must not hit it."""
    m = BlockManager(4, 4)
    (first, _) = m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    assert m.is_cached(first)
    m.truncate("a", 2)
    assert not m.is_cached(first) and m.block_table("a") == [first] and m.num_free == 3
    m.append("a", 9)
    m.allocate("b", [1, 2, 3, 4, 5])
    assert m.cached_tokens("b") == 0 and first not in m.block_table("b")


def test_a_fork_of_whole_blocks_copies_nothing():
    m = BlockManager(4, 4)
    m.allocate("parent", [1, 2, 3, 4])
    m.fork("parent", "child")
    m.append("child", 5)
    m.append("parent", 6)
    assert m.take_copies() == [] and m.block_table("child")[0] == m.block_table("parent")[0]


def test_shared_prefix_reuses_its_full_blocks():
    m = BlockManager(num_blocks=8, block_size=4)
    a = m.allocate("a", list(range(10)))  # blocks: [0-3] [4-7] [8 9]
    m.mark_computed("a", 10)  # its prefill wrote the keys
    b = m.allocate("b", list(range(8)) + [50, 51, 52])
    assert b[:2] == a[:2] and b[2] != a[2]
    assert m.cached_tokens("b") == 8 and m.prefix_hit_tokens == 8 and m.prompt_tokens == 21
    assert [m.ref_counts[x] for x in a] == [2, 2, 1] and m.num_free == 8 - 4
    c = m.allocate("c", [0, 1, 2, 99, 4, 5, 6, 7, 8])  # differs inside the first block: the whole prefix misses
    assert m.cached_tokens("c") == 0 and not set(c) & set(a)


def test_last_token_is_never_a_hit():
    m = BlockManager(num_blocks=8, block_size=4)
    a = m.allocate("a", list(range(8)))
    m.mark_computed("a", 8)
    b = m.allocate("b", list(range(8)))  # block-aligned and identical: its last block is computed again
    assert m.cached_tokens("b") == 4 and b[0] == a[0] and b[1] != a[1]


def test_a_block_joins_the_prefix_cache_once_its_keys_are_written():
    m = BlockManager(num_blocks=8, block_size=4)
    a = m.allocate("a", [7, 7, 7])
    m.mark_computed("a", 3)
    assert m.append("a", 8) == a[0] * 4 + 3 and not m.is_cached(a[0]), "cached before the forward wrote its keys"
    assert m.allocate("early", [7, 7, 7, 8, 1])[0] != a[0] and m.cached_tokens("early") == 0
    m.mark_computed("a", 4)
    assert m.is_cached(a[0])
    m.append("a", 9)  # starts a second block
    assert len(m.block_table("a")) == 2 and not m.is_cached(m.block_table("a")[1])
    assert m.allocate("b", [7, 7, 7, 8, 1])[0] == a[0] and m.cached_tokens("b") == 4


def test_freed_prefix_stays_cached_until_its_block_is_reused():
    m = BlockManager(num_blocks=4, block_size=2)
    a = m.allocate("a", [1, 2, 3, 4, 5])  # [1 2] [3 4] cached, [5] not
    m.mark_computed("a", 5)
    m.free("a")
    assert m.free_blocks[0] == a[2], "a block holding nothing reusable is reused first"
    assert m.is_cached(a[0]) and m.is_cached(a[1]) and not m.is_cached(a[2])
    m.allocate("x", [9])  # takes that block: the cached prefix survives
    assert m.allocate("b", [1, 2, 3, 4, 6])[:2] == a[:2] and m.cached_tokens("b") == 4
    m.free("b")
    m.free("x")
    m.allocate("y", [8] * 7)  # needs all four blocks: the cached prefix is overwritten
    m.mark_computed("y", 7)
    m.free("y")
    m.allocate("c", [1, 2, 3, 4, 5])
    assert m.cached_tokens("c") == 0, "a hit on a block whose storage was reused"


def test_a_hash_collision_never_hands_out_another_prefix():
    """The hash here ignores everything before the block, so [1 2 3 4 | 5 6] and [7 7 | 5 6] collide.

    Block 2 of b is computed after [1 2 3 4]; its parent is b's own copy of [3 4] (a copy, since
    the last token is never a hit). That parent is reused first, for [7 7], so a new [7 7 5 6 ...]
    hits [7 7] in that very block and then finds b's [5 6] under the colliding hash: only the
    check that the parent is the same block *in the same use* stops the wrong hit.
    """
    m = BlockManager(num_blocks=8, block_size=2, hash_fn=lambda key: key[1])
    a = m.allocate("a", [1, 2, 3, 4])
    m.mark_computed("a", 4)
    b = m.allocate("b", [1, 2, 3, 4])
    assert b[0] == a[0] and b[1] != a[1]
    m.append("b", 5)
    m.append("b", 6)
    m.mark_computed("b", 6)
    b = m.block_table("b")
    m.free("b")
    x = m.allocate("x", [7, 7, 1])
    m.mark_computed("x", 3)
    assert x[0] == b[1], "the uncached copy is reused first"
    c = m.allocate("c", [7, 7, 5, 6, 1])
    assert c[0] == x[0] and m.cached_tokens("c") == 2 and c[1] != b[2]


# ------------------------------------------------------------------ block manager: errors


def test_a_sequence_longer_than_the_pool_is_refused_clearly():
    m = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"9 tokens needs 3 blocks .* pool has 2 \(8 tokens\)"):
        m.allocate("a", list(range(9)))
    assert "a" not in m and m.num_free == 2
    m.allocate("b", list(range(8)))
    with pytest.raises(ValueError, match="larger pool"):
        m.append("b", 8)
    assert m.num_tokens("b") == 8


def test_unknown_and_duplicate_sequences_are_refused_clearly():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", [1, 2])
    for call in (lambda: m.append("zz", 1), lambda: m.free("zz"), lambda: m.block_table("zz")):
        with pytest.raises(ValueError, match="unknown sequence 'zz'"):
            call()
    m.free("a")
    with pytest.raises(ValueError, match="unknown sequence 'a'.*already freed"):
        m.free("a")
    m.allocate("b", [1])
    with pytest.raises(ValueError, match="'b' already holds blocks"):
        m.allocate("b", [1])


def test_a_full_pool_refuses_without_changing_anything():
    m = BlockManager(num_blocks=3, block_size=2)
    m.allocate("a", [1, 2, 3])
    m.mark_computed("a", 3)
    assert not m.can_allocate([4, 5, 6]) and m.can_allocate([4]) and m.can_allocate([1, 2, 4])  # a prefix hit
    with pytest.raises(RuntimeError, match="needs 2 free blocks, 1 are free"):
        m.allocate("b", [4, 5, 6])
    assert m.free_blocks == (2,) and "b" not in m and m.ref_counts == [1, 1, 0]


# ------------------------------------------------------------------ paged attention == contiguous SDPA


def contiguous_attention(q, k, v, num_queries):
    """SDPA over keys stored contiguously; the queries are the last `num_queries` positions. [H, T, hd]"""
    T, S = num_queries, k.shape[1]
    mask = causal_mask_lower_right(T, S)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]


def paged_against_contiguous(cache, tables, keys, values, queries):
    """Run paged attention on a right-padded batch and compare every sequence with contiguous SDPA."""
    B, T = len(tables), max(q.shape[1] for q in queries)
    H, hd = queries[0].shape[0], queries[0].shape[2]
    q = torch.zeros(B, H, T, hd)
    positions = torch.full((B, T), -1)
    for b, (qb, kb) in enumerate(zip(queries, keys)):
        t, length = qb.shape[1], kb.shape[1]
        q[b, :, :t] = qb
        positions[b, :t] = torch.arange(length - t, length)
    lengths = [k.shape[1] for k in keys]
    out = paged_attention(q, cache, 0, tables, lengths, positions)
    for b, (qb, kb, vb) in enumerate(zip(queries, keys, values)):
        t = qb.shape[1]
        gathered_k, gathered_v = cache.gather(0, tables[b], kb.shape[1])
        assert torch.equal(gathered_k, kb) and torch.equal(gathered_v, vb)
        torch.testing.assert_close(out[b, :, :t], contiguous_attention(qb, kb, vb, t), atol=1e-5, rtol=1e-5)
        assert torch.equal(out[b, :, t:], torch.zeros_like(out[b, :, t:])), "a padding query attended"


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 5), n_kv_head=st.integers(1, 2), group=st.integers(1, 3),
       head_dim=st.sampled_from([4, 8]), lengths=st.lists(st.integers(1, 23), min_size=1, max_size=3))
def test_paged_attention_equals_contiguous_sdpa(data, block_size, n_kv_head, group, head_dim, lengths):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    needed = [blocks_for(n, block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    cache = PagedKVCache(1, n_kv_head, head_dim, num_blocks, block_size)
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, never in order
    tables = [order[sum(needed[:b]) : sum(needed[: b + 1])] for b in range(len(lengths))]
    keys, values, queries = [], [], []
    for table, length in zip(tables, lengths):
        k, v = (torch.randn(n_kv_head, length, head_dim, generator=g) for _ in range(2))
        cache.write(0, slot_mapping(table, range(length), block_size), k.transpose(0, 1), v.transpose(0, 1))
        t = data.draw(st.integers(1, length))  # prefill (t == length), decode (t == 1), or a chunk after a prefix
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(n_kv_head * group, t, head_dim, generator=g))
    paged_against_contiguous(cache, tables, keys, values, queries)


def test_paged_attention_reads_shared_prefix_blocks():
    block_size, n_kv_head, group, head_dim = 3, 2, 2, 8
    m = BlockManager(num_blocks=12, block_size=block_size)
    cache = PagedKVCache(1, n_kv_head, head_dim, 12, block_size)
    prompt_a, prompt_b = list(range(11)), list(range(7)) + [40, 41, 42, 43]
    k_a, v_a = torch.randn(n_kv_head, 11, head_dim), torch.randn(n_kv_head, 11, head_dim)
    table_a = m.allocate("a", prompt_a)
    m.mark_computed("a", len(prompt_a))
    cache.write(0, slot_mapping(table_a, range(11), block_size), k_a.transpose(0, 1), v_a.transpose(0, 1))
    table_b = m.allocate("b", prompt_b)
    shared = m.cached_tokens("b")
    assert shared == 6 and table_b[:2] == table_a[:2]
    k_b, v_b = torch.randn(n_kv_head, 11, head_dim), torch.randn(n_kv_head, 11, head_dim)
    k_b[:, :shared], v_b[:, :shared] = k_a[:, :shared], v_a[:, :shared]  # the same prefix has the same keys
    new = range(shared, 11)  # b's prefill writes only what the cache did not hold
    k_new, v_new = k_b[:, shared:].transpose(0, 1), v_b[:, shared:].transpose(0, 1)  # [N, KV, hd]
    cache.write(0, slot_mapping(table_b, new, block_size), k_new, v_new)
    queries = [torch.randn(n_kv_head * group, t, head_dim) for t in (11, 11 - shared)]
    paged_against_contiguous(cache, [table_a, table_b], [k_a, k_b], [v_a, v_b], queries)


def test_attention_refuses_queries_past_the_stored_keys():
    cache = PagedKVCache(1, 1, 4, 2, 2)
    with pytest.raises(ValueError, match="position 3 but only 3 keys are stored"):
        paged_attention(torch.zeros(1, 1, 1, 4), cache, 0, [[0, 1]], [3], torch.tensor([[3]]))
    with pytest.raises(ValueError, match="holds at most 2 tokens, not 3"):
        cache.gather(0, [1], 3)
