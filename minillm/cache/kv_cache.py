"""Key/value caches behind one interface, with a length per row.

Attention at step t needs the keys and values of every earlier token. Recomputing
them costs a full forward over the whole sequence per new token (quadratic total
cost); a cache stores them once and each step adds one column (linear total cost).

Every cache honours the same calls, which is all the model and the decode session
(`minillm.runtime.session`) rely on:

    k_all, v_all = cache.update(layer, k_new, v_new)  # append T columns to every row, return what attention sees
    cache.lengths                                      # tokens stored, per row (rows may differ)
    cache.length                                       # the longest row: columns in use
    cache.key_span(T)                                  # S: columns `update` returns after appending T
    cache.crop(n)                                      # keep the first n tokens (an int, or one per row)
    cache.reorder(index)                               # keep / duplicate / drop batch rows
    cache.keep_positions(row, index)                   # keep only these columns of one row, compacted

Tensors are laid out [batch, n_kv_head, seq, head_dim]; row b's token at position p
sits in column p. Rows of different lengths leave stale columns after their end:
whoever calls the model then passes a mask that hides them (the session does).
`update` is called once per layer per forward; the lengths advance after the last layer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class KVCache:
    """The shared bookkeeping; subclasses decide where the columns live."""

    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self.lengths: list[int] = []  # per row, set on the first write
        self.copied_bytes = 0  # what `reorder` copied so far (lesson 10: beams over rows against shared blocks)

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    def reset(self) -> None:
        """Empty every row; the next write sets the batch size (the storage is kept)."""
        self.lengths = []

    def key_span(self, new_tokens: int) -> int:
        """Columns attention sees after `new_tokens` more are appended to every row."""
        return self.length + new_tokens

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """k_new, v_new [B, KV, T, hd] go after each row's stored tokens; returns k_all, v_all [B, KV, S, hd]."""
        if not self.lengths:
            self.lengths = [0] * k_new.shape[0]
        k_all, v_all = self._write(layer, k_new, v_new)
        if layer == self.n_layer - 1:
            T = k_new.shape[2]
            self.lengths = [n + T for n in self.lengths]
        return k_all, v_all

    def _write(self, layer, k_new, v_new):
        raise NotImplementedError

    def write_index(self, new_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [B, 1], columns [B, T]): where each row's T new tokens go. Made once per forward
        (every layer writes the same columns), not once per layer."""
        key = (tuple(self.lengths), new_tokens, device)
        if getattr(self, "_index_key", None) != key:
            rows = torch.arange(len(self.lengths), device=device)[:, None]
            columns = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(new_tokens, device=device)
            self._index_key, self._index = key, (rows, columns)
        return self._index

    def crop(self, n) -> None:
        """Forget every token after the first n of each row (n: an int for all rows, or a list per row)."""
        if isinstance(n, int):
            if not 0 <= n <= self.length:
                raise ValueError(f"crop({n}): the cache holds {self.length} tokens; keep between 0 and {self.length}")
            keep = [min(n, have) for have in self.lengths]
        else:
            keep = list(n)
        if len(keep) != len(self.lengths) or not all(0 <= k <= have for k, have in zip(keep, self.lengths)):
            raise ValueError(f"crop({n}): the cache holds {self.lengths} tokens per row; keep between 0 and that, "
                             f"one number per row")
        self.lengths = keep

    def reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def keep_positions(self, row: int, index: torch.Tensor) -> None:
        """Keep only columns `index` (ascending) of one row, moved to columns 0..len(index)-1.

        A token tree's accepted path: the prefix plus the accepted nodes, whose keys were
        computed at positions prefix + depth, i.e. exactly the columns they move to.
        """
        index = torch.as_tensor(index, dtype=torch.long).flatten()
        n = len(index)
        if n and (bool((index[1:] <= index[:-1]).any()) or int(index[-1]) >= self.lengths[row] or int(index[0]) < 0):
            raise ValueError(f"keep_positions: index must be ascending columns below the row's length "
                             f"{self.lengths[row]}, got {index.tolist()}")
        moved = (index != torch.arange(n)).nonzero()
        first = int(moved[0]) if len(moved) else n  # columns before `first` stay where they are
        if first < n:
            self._move_columns(row, index[first:], first)
        self.lengths[row] = n

    def _move_columns(self, row: int, source: torch.Tensor, start: int) -> None:
        raise NotImplementedError


class DynamicCache(KVCache):
    """Grows by concatenation: simple, but every step reallocates and copies the whole cache."""

    def __init__(self, n_layer: int):
        super().__init__(n_layer)
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def _write(self, layer, k_new, v_new):
        T = k_new.shape[2]
        stored = self.keys[layer]
        if stored is None:
            self.keys[layer], self.values[layer] = k_new, v_new
        elif len(set(self.lengths)) == 1 and stored.shape[2] == self.lengths[0]:
            self.keys[layer] = torch.cat((stored[:, :, : self.lengths[0]], k_new), dim=2)
            self.values[layer] = torch.cat((self.values[layer][:, :, : self.lengths[0]], v_new), dim=2)
        else:  # rows of different lengths: grow to the longest, then write each row at its own end
            span = self.key_span(T)
            for store in (self.keys, self.values):
                t = store[layer]
                if t.shape[2] < span:
                    store[layer] = torch.cat((t, t.new_zeros(*t.shape[:2], span - t.shape[2], t.shape[3])), dim=2)
                else:
                    store[layer] = t[:, :, :span]
            index = self.write_index(T, k_new.device)
            write_rows(self.keys[layer], k_new, index)
            write_rows(self.values[layer], v_new, index)
        return self.keys[layer], self.values[layer]

    def crop(self, n):
        super().crop(n)
        self._trim()

    def keep_positions(self, row, index):
        super().keep_positions(row, index)
        self._trim()

    def reset(self):
        super().reset()
        self.keys = [None] * self.n_layer
        self.values = [None] * self.n_layer

    def _trim(self) -> None:
        """Drop columns no row uses any more (the next append then concatenates again)."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t[:, :, : self.length]

    def reorder(self, index):
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, index.to(t.device))
                    self.copied_bytes += store[i].numel() * store[i].element_size()
        self.lengths = [self.lengths[i] for i in index.tolist()]

    def _move_columns(self, row, source, start):
        for store in (self.keys, self.values):
            for t in store:
                t[row, :, start : start + len(source)] = t[row, :, source.to(t.device)]


class StaticCache(KVCache):
    """Preallocated to `max_len` tokens and written in place: no allocation while decoding.

    Storage is [n_layer, max_batch, n_kv_head, max_len, head_dim]; `update` writes the
    new columns and returns views of the columns in use. With `fixed_shape=True` it
    returns all `max_len` columns instead, so every decode step sees tensors of the same
    shape (what torch.compile and ONNX export need); the caller's mask then hides the
    unwritten columns. `reorder` to fewer rows keeps the storage and shrinks the view.
    """

    def __init__(self, n_layer, batch, n_kv_head, head_dim, max_len, dtype=torch.float32, device=None,
                 fixed_shape: bool = False, value_dim: int | None = None):
        super().__init__(n_layer)
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(*shape[:-1], head_dim if value_dim is None else value_dim, dtype=dtype, device=device)
        self.k_layers = [self.k[layer] for layer in range(n_layer)]  # per-layer views, made once
        self.v_layers = [self.v[layer] for layer in range(n_layer)]
        self.max_len, self.fixed_shape = max_len, fixed_shape
        self.batch = batch

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, fixed_shape: bool = False) -> "StaticCache":
        c = model.config
        heads, key, value = c.cache_widths
        return cls(c.n_layer, batch, heads, key, max_len, dtype=model.dtype, device=model.device,
                   fixed_shape=fixed_shape, value_dim=value)

    def key_span(self, new_tokens):
        return self.max_len if self.fixed_shape else super().key_span(new_tokens)

    @contextmanager
    def columns_in_use(self):
        """While open, `update` returns only the columns written so far and the new ones, as a cache that is not
        fixed-shape does: an eager forward over a compiled run's cache (a long prompt) then attends causally over
        those alone, rather than over every column behind a mask."""
        fixed, self.fixed_shape = self.fixed_shape, False
        try:
            yield self
        finally:
            self.fixed_shape = fixed

    def _write(self, layer, k_new, v_new):
        B, T = k_new.shape[0], k_new.shape[2]
        if B > self.k.shape[1]:
            raise RuntimeError(f"static KV cache holds {self.k.shape[1]} rows, {B} were asked for: "
                               f"create it with a larger batch")
        self.batch = B
        end = self.length + T
        if end > self.max_len:
            raise RuntimeError(
                f"static KV cache is full: it holds {self.length} of {self.max_len} tokens and {T} more were "
                f"asked for; create it with a larger max_len"
            )
        k_all = self.k_layers[layer][:B, :, : self.key_span(T)]  # [B, n_kv_head, S, head_dim], a view
        v_all = self.v_layers[layer][:B, :, : self.key_span(T)]
        start = self.lengths[0]
        if all(n == start for n in self.lengths):
            k_all[:, :, start:end].copy_(k_new)
            v_all[:, :, start:end].copy_(v_new)
        else:
            index = self.write_index(T, k_new.device)
            write_rows(k_all, k_new, index)
            write_rows(v_all, v_new, index)
        return k_all, v_all

    def reorder(self, index):
        index = index.to(self.k.device)
        if len(index) > self.k.shape[1]:
            raise RuntimeError(f"reorder to {len(index)} rows: the static cache was built for {self.k.shape[1]}")
        n = self.length
        for store in (self.k, self.v):
            rows = store[:, index, :, :n].clone()  # gather first: index may read rows we overwrite
            store[:, : len(index), :, :n] = rows
            self.copied_bytes += rows.numel() * rows.element_size()
        self.batch = len(index)
        self.lengths = [self.lengths[i] for i in index.tolist()]

    def _move_columns(self, row, source, start):
        source = source.to(self.k.device)
        for store in (self.k, self.v):
            store[:, row, :, start : start + len(source)] = store[:, row, :, source]


def write_rows(store: torch.Tensor, new: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]) -> None:
    """store[b, :, columns[b, t]] = new[b, :, t] for every row b and t < T, in one indexed write.

    store [B, KV, S, hd]; new [B, KV, T, hd]; index = (rows [B, 1], columns [B, T]).
    """
    rows, columns = index
    store[rows, :, columns] = new.transpose(1, 2)  # indexed view is [B, T, KV, hd]


__all__ = ["KVCache", "DynamicCache", "StaticCache", "write_rows"]
