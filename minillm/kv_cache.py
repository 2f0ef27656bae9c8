"""Key/value caches behind one interface.

Attention at step t needs the keys and values of every earlier token. Recomputing
them costs a full forward over the whole sequence per new token (quadratic total
cost); a cache stores them once and each step adds one column (linear total cost).

Every cache honours the same four calls, which is all the model and the later
lessons (batching, speculative decoding, beam search) rely on:

    k_all, v_all = cache.update(layer, k_new, v_new)  # append, return what attention sees
    cache.length                                       # tokens stored
    cache.crop(n)                                      # forget everything after the first n tokens
    cache.reorder(index)                               # keep / duplicate / drop batch rows

Tensors are laid out [batch, n_kv_head, seq, head_dim].
"""

from __future__ import annotations

import torch


class KVCache:
    """The interface; see the module docstring."""

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        raise NotImplementedError

    @property
    def length(self) -> int:
        raise NotImplementedError

    def crop(self, n: int) -> None:
        raise NotImplementedError

    def reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def _check_crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}): the cache holds {self.length} tokens; keep between 0 and {self.length}")


class DynamicCache(KVCache):
    """Grows by concatenation: simple, but every step reallocates and copies the whole cache."""

    def __init__(self, n_layer: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def update(self, layer, k_new, v_new):
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k_new, v_new
        else:
            self.keys[layer] = torch.cat((self.keys[layer], k_new), dim=2)
            self.values[layer] = torch.cat((self.values[layer], v_new), dim=2)
        return self.keys[layer], self.values[layer]

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def crop(self, n):
        self._check_crop(n)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t[:, :, :n]

    def reorder(self, index):
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, index.to(t.device))


class StaticCache(KVCache):
    """Preallocated to `max_len` tokens and written in place: no allocation while decoding.

    Storage is [n_layer, max_batch, n_kv_head, max_len, head_dim]; `update` writes the
    new columns and returns views of the filled prefix, so attention never sees the
    unwritten tail. `reorder` to fewer rows keeps the storage and shrinks the view.
    """

    def __init__(self, n_layer, batch, n_kv_head, head_dim, max_len, dtype=torch.float32, device=None):
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_layers = [self.k[layer] for layer in range(n_layer)]  # per-layer views, made once
        self.v_layers = [self.v[layer] for layer in range(n_layer)]
        self.max_len = max_len
        self.batch = batch
        self.filled = [0] * n_layer  # tokens written per layer (equal between forwards)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "StaticCache":
        c = model.config
        return cls(c.n_layer, batch, c.kv_heads, c.head_size, max_len, dtype=model.dtype, device=model.device)

    def update(self, layer, k_new, v_new):
        start, T = self.filled[layer], k_new.shape[2]
        end = start + T
        if end > self.max_len:
            raise RuntimeError(
                f"static KV cache is full: it holds {start} of {self.max_len} tokens and {T} more were written; "
                f"create it with a larger max_len"
            )
        k_all = self.k_layers[layer][: self.batch, :, :end]  # [B, n_kv_head, end, head_dim], a view
        v_all = self.v_layers[layer][: self.batch, :, :end]
        k_all[:, :, start:].copy_(k_new)
        v_all[:, :, start:].copy_(v_new)
        self.filled[layer] = end
        return k_all, v_all

    @property
    def length(self) -> int:
        return self.filled[0]

    def crop(self, n):
        self._check_crop(n)
        self.filled = [min(f, n) for f in self.filled]

    def reorder(self, index):
        index = index.to(self.k.device)
        if len(index) > self.k.shape[1]:
            raise RuntimeError(f"reorder to {len(index)} rows: the static cache was built for {self.k.shape[1]}")
        n = self.length
        for store in (self.k, self.v):
            rows = store[:, index, :, :n].clone()  # gather first: index may read rows we overwrite
            store[:, : len(index), :, :n] = rows
        self.batch = len(index)


def make_cache(kind: str, model, batch: int, max_len: int) -> KVCache | None:
    """'static', 'dynamic' or 'none' (None: the model recomputes everything each step)."""
    if kind == "static":
        return StaticCache.for_model(model, batch, max_len)
    if kind == "dynamic":
        return DynamicCache(model.config.n_layer)
    if kind == "none":
        return None
    raise ValueError(f"unknown cache kind {kind!r}: use 'static', 'dynamic' or 'none'")
