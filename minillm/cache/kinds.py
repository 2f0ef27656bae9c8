"""`make_cache`: a decode session's KV cache of a kind named by a string (the runner's and the CLI's `cache`)."""

from __future__ import annotations

from .block_rows import BlockCache
from .kv_cache import DynamicCache, KVCache, StaticCache


def make_cache(kind: str, model, batch: int, max_len: int, fixed_shape: bool = False) -> KVCache | None:
    """'static', 'dynamic', 'blocks' (rows in a paged pool, beams sharing blocks: `minillm.cache.block_rows`) or
    'none' (None: the model recomputes everything each step).

    fixed_shape: a static cache that always returns all `max_len` columns (see StaticCache).
    """
    if fixed_shape and kind != "static":
        raise ValueError(f"fixed_shape needs cache='static' (a {kind!r} cache changes shape as it grows)")
    if kind == "static":
        return StaticCache.for_model(model, batch, max_len, fixed_shape)
    if kind == "dynamic":
        return DynamicCache(model.config.n_layer)
    if kind == "none":
        return None
    if kind == "blocks":
        return BlockCache.for_model(model, batch, max_len)
    raise ValueError(f"unknown cache kind {kind!r}: use 'static', 'dynamic', 'blocks' or 'none'")


__all__ = ["make_cache"]
