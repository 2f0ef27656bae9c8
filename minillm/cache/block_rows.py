"""`BlockCache`: the decode session's rows kept in a paged block pool, so that beams share blocks (lessons 10, 12).

Beam search reorders its cache every step: each surviving beam keeps its parent's keys,
a beam chosen twice is duplicated, an abandoned one dropped. A contiguous cache
(`StaticCache.reorder`) does that by copying rows: every layer's keys and values of every
beam, the prompt's included, each step, although the beams' prompt and most of their
history are the same tokens. Here each row is a sequence of the paged pool (`BlockManager`
over `PagedKVCache`), and reordering moves no key: a row that survives keeps its block
table, a row chosen twice is forked (its blocks shared, reference counts raised), a row
dropped releases its blocks. A block is copied only when a row is about to write into
one it shares, its partial last block (copy-on-write), so a step copies at most one
block per beam, whatever the length, where a contiguous reorder copies all of it.

`copied_bytes` counts what copy-on-write copied (lesson 10 sets it beside the contiguous
cache's), and `peak_bytes` the most the pool's held blocks took at once (beside the contiguous
cache's rows, which hold every beam's prompt and history apart). Attention reads each row's
keys through its block table (`gather_blocks`); that read is every paged cache's cost, not a
copy of the cache's state.
"""

from __future__ import annotations

import torch

from .blocks import BlockManager, blocks_for
from .kv_cache import KVCache
from .paged import PagedKVCache, gather_blocks


class BlockCache(KVCache):
    """The `KVCache` interface over a block pool; `reorder` forks rather than copies (see the module docstring)."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype=torch.float32, device=None, value_dim: int | None = None):
        super().__init__(n_layer)
        self.pool = PagedKVCache(n_layer, n_kv_head, head_dim, num_blocks, block_size, dtype, device, value_dim)
        self.manager = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.seqs: list[int] = []  # each row's sequence in the pool
        self._next_seq = 0
        self.block_bytes = sum(pool[0, 0].numel() * pool.element_size() for pool in (self.pool.k, self.pool.v)) \
            * n_layer  # one block, every layer, keys and values (`copied_bytes` counts copy-on-write's copies)
        self.peak_blocks = 0  # the most blocks held at once

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, block_size: int = 16) -> "BlockCache":
        """A pool that holds `batch` rows of `max_len` tokens even if they share nothing."""
        c = model.config
        heads, key, value = c.cache_widths
        return cls(c.n_layer, heads, key, max(1, batch * blocks_for(max_len, block_size)), block_size,
                   dtype=model.dtype, device=model.device, value_dim=value)

    @property
    def peak_bytes(self) -> int:
        """The most bytes of keys and values the held blocks took at once, every layer."""
        return self.peak_blocks * self.block_bytes

    def reset(self) -> None:
        for seq in self.seqs:
            self.manager.free(seq)
        self.seqs = []
        super().reset()

    def _new_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def _write(self, layer, k_new, v_new):
        B, KV, T, _ = k_new.shape
        if layer == 0:  # every layer writes the same slots: reserve them (and copy shared blocks) once
            while len(self.seqs) < B:
                self.seqs.append(self._new_seq())
                self.manager.allocate(self.seqs[-1], [])
            self._slots = torch.tensor([[self.manager.append(seq, 0) for _ in range(T)] for seq in self.seqs],
                                       device=k_new.device)  # [B, T]
            copies = self.manager.take_copies()
            self.pool.copy_blocks(copies)
            self.copied_bytes += len(copies) * self.block_bytes
            self.peak_blocks = max(self.peak_blocks, self.manager.num_used)
            tables = [self.manager.block_table(seq) for seq in self.seqs]
            padded = torch.zeros(B, max(map(len, tables)), dtype=torch.long)  # past a row's end: masked columns
            for row, table in enumerate(tables):
                padded[row, : len(table)] = torch.tensor(table)
            self._tables = padded.to(k_new.device)
        self.pool.write(layer, self._slots.flatten(), k_new.transpose(1, 2).flatten(0, 1),
                        v_new.transpose(1, 2).flatten(0, 1))
        span = self.key_span(T)
        return tuple(gather_blocks(pool[layer], self._tables)[:, :, :span] for pool in (self.pool.k, self.pool.v))

    def crop(self, n) -> None:
        super().crop(n)
        for seq, length in zip(self.seqs, self.lengths):
            self.manager.truncate(seq, length)

    def reorder(self, index: torch.Tensor) -> None:
        """Rows follow `index`: a row kept keeps its blocks, a row repeated is forked, a row left out is released."""
        rows = index.tolist()
        kept, seqs = set(), []
        for row in rows:
            seq = self.seqs[row]
            if seq in kept:
                seqs.append(self._new_seq())
                self.manager.fork(seq, seqs[-1])
            else:
                kept.add(seq)
                seqs.append(seq)
        for seq in self.seqs:
            if seq not in kept:
                self.manager.free(seq)
        self.seqs, self.lengths = seqs, [self.lengths[row] for row in rows]

    def _move_columns(self, row, source, start):
        raise ValueError("a block cache keeps whole rows for beams; a token tree's accepted path (lesson 11) is "
                         "kept in a contiguous cache: use cache='static'")


__all__ = ["BlockCache"]
