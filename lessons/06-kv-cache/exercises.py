"""Lesson 06 exercises: write your answers here; `pytest lessons/06-kv-cache` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/06_kv_cache.py
(try first: `pytest lessons/06-kv-cache --solutions` runs the checks on them).
"""

from __future__ import annotations

import torch

from minillm.cache.kv_cache import KVCache  # noqa: F401  (exercises 2 and 3 subclass it)


def kv_cache_bytes(config, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """Exercise 1: When the cache outgrows the weights

    config: a `minillm.model.transformer.ModelConfig` (GPT-2, Llama, Qwen2, SmolLM2, ... any of them).
    Return how many bytes a KV cache for `batch` rows of `max_len` tokens stores in `dtype`:
    keys and values of every layer (use `config.kv_heads` and `config.head_size`, which resolve
    the None defaults). The check compares it with what `StaticCache.for_model` really allocates.
    """
    raise NotImplementedError


def outgrows_weights(config, weight_bytes: int, batch: int, dtype: torch.dtype) -> int | None:
    """Exercise 1: When the cache outgrows the weights

    Use `kv_cache_bytes` to predict when the cache, not the weights, is most of what a decode step
    reads: the shortest length (tokens per row) at which a cache of `batch` rows stores at least
    `weight_bytes`, or None when that length is beyond `config.context_length` (the cache never
    outgrows the weights for this model at this batch). Before running anything, predict it on paper
    for SmolLM2-135M in FP32 (538 MB of weights) at batch 1 and at batch 8.
    """
    raise NotImplementedError


def generate_sliding(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 2: RoPE sliding without re-prefill

    Greedy-decode `prompt_ids` (at most context_length tokens, batch of one) for `max_new_tokens`
    tokens WITHOUT ever re-prefilling: prefill once, then forward one token per step. Once the
    cache holds context_length - 1 tokens, drop the oldest column before appending the new one, so
    every token attends to at most context_length tokens (itself included). Keep the cached keys as
    they are and keep counting positions past context_length (`RopeTable` grows to any position).

    Write the cache as a subclass of `minillm.cache.kv_cache.KVCache` whose `_write(layer, k_new, v_new)`
    returns what attention sees (see DynamicCache for the pattern) and call
    `model(tokens, positions, cache=your_cache)` yourself. Raise ValueError for a model with
    learned positions (GPT-2: its position table stops at context_length).

    Returns the generated token ids. The check compares them with a brute-force forward over
    the whole sequence under a banded causal mask (query t sees keys t - context_length + 1 .. t).
    """
    raise NotImplementedError


def make_quantized_cache(n_layer: int):
    """Exercise 3: An int8 cache

    Return a cache (a subclass of `minillm.cache.kv_cache.KVCache`) that stores K and V as int8 with
    one float32 scale per (row, KV head, token): scale = max |x| over head_dim / 127,
    q = round(x / scale) clamped to [-127, 127]. `update` returns the dequantized keys and
    values (q * scale, in the input's dtype) of every stored token. It must honour `crop(n)`
    and `reorder(index)` (rows of equal length are enough) and have a method `nbytes()`:
    the bytes it stores (int8 values plus scales).

    The check runs a tiny model with it against `DynamicCache`: the returned keys equal the
    quantization formula exactly, the logits stay within a stated bound, crop/reorder behave
    like DynamicCache's, and `nbytes()` counts what the formula says.
    """
    raise NotImplementedError
