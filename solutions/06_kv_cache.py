"""Worked answers for lesson 06's exercises (try them first: `pytest lessons/06-kv-cache` checks yours)."""

from __future__ import annotations

import torch

from minillm.cache.kv_cache import KVCache


def kv_cache_bytes(config, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """Exercise 1: When the cache outgrows the weights"""
    # Per token, per layer, per row: one key and one value vector for each KV head (not each query head:
    # with grouped-query attention several query heads share one KV head, which is what GQA saves).
    element = torch.empty((), dtype=dtype).element_size()
    per_token_per_layer = 2 * config.kv_heads * config.head_size * element
    return config.n_layer * batch * max_len * per_token_per_layer


def outgrows_weights(config, weight_bytes: int, batch: int, dtype: torch.dtype) -> int | None:
    """Exercise 1: When the cache outgrows the weights"""
    per_token = kv_cache_bytes(config, batch, 1, dtype)  # the cache grows by the same bytes every token
    length = -(-weight_bytes // per_token)  # ceil: the first length whose cache holds at least the weights
    # SmolLM2-135M in FP32 stores 46,080 bytes per token and row, so its 538 MB of weights take about 11,700 tokens at
    # batch 1: beyond its 8192-token context, the weights dominate every step. At batch 8 it is 1,460 tokens, and
    # from there a decode step reads more cache than weights (lessons 07 and 12: why a server's batches are
    # memory-hungry, and why GQA's 3 KV heads instead of 9 matter).
    return length if length <= config.context_length else None


class SlidingWindowCache(KVCache):
    """Keeps the newest `window - 1` tokens' keys and values; each new token attends to at most `window`.

    The keys keep the rotation of the position they were computed at. RoPE scores depend only on
    q_pos - k_pos, so nothing needs re-rotating: the new token simply gets the next position, past
    context_length if need be. Rows must stay the same length (batch of equal rows, plain decoding).
    """

    def __init__(self, n_layer: int, window: int):
        super().__init__(n_layer)
        self.window = window
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def _write(self, layer, k_new, v_new):
        if k_new.shape[2] > self.window:
            raise ValueError(f"{k_new.shape[2]} new tokens do not fit a window of {self.window}")
        keep = self.window - k_new.shape[2]  # room left for stored tokens next to the new ones
        if self.keys[layer] is None or keep == 0:
            k_all, v_all = k_new, v_new
        else:
            k_all = torch.cat((self.keys[layer][:, :, -keep:], k_new), dim=2)  # evict the oldest columns
            v_all = torch.cat((self.values[layer][:, :, -keep:], v_new), dim=2)
        self.keys[layer], self.values[layer] = k_all, v_all
        return k_all, v_all


@torch.inference_mode()
def generate_sliding(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 2: RoPE sliding without re-prefill"""
    config = model.config
    if config.positions != "rope":
        raise ValueError(f"positions={config.positions!r}: learned absolute positions stop at context_length "
                         f"({config.context_length}); sliding without re-prefill needs RoPE")
    cache = SlidingWindowCache(config.n_layer, window=config.context_length)
    tokens = torch.tensor([prompt_ids], device=model.device)
    positions = torch.arange(len(prompt_ids), device=model.device)[None]
    logits = model(tokens, positions, cache=cache, last_only=True)  # one prefill, never repeated
    out = []
    for step in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if step == max_new_tokens - 1:
            break
        position = len(prompt_ids) + step  # keeps counting past context_length: RopeTable grows to it
        logits = model(torch.tensor([[token]], device=model.device), torch.tensor([[position]], device=model.device),
                       cache=cache)
    return out


class QuantizedCache(KVCache):
    """K and V stored as int8, one float32 scale per (row, head, token): absmax over head_dim / 127.

    A per-token scale means appending never re-quantizes what is stored; a per-head one follows
    each head's own range (heads differ by orders of magnitude). `update` returns dequantized
    tensors in the input dtype, so attention is unchanged. Rows must stay the same length.
    """

    def __init__(self, n_layer: int):
        super().__init__(n_layer)
        self.store: list[list[torch.Tensor] | None] = [None] * n_layer  # [k_int8, k_scale, v_int8, v_scale]

    @staticmethod
    def quantize(x):
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127  # [B, KV, T, 1]
        return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale

    def _write(self, layer, k_new, v_new):
        new = [*self.quantize(k_new), *self.quantize(v_new)]
        if self.store[layer] is not None:
            n = self.lengths[0]
            new = [torch.cat((old[:, :, :n], t), dim=2) for old, t in zip(self.store[layer], new)]
        self.store[layer] = new
        kq, ks, vq, vs = new
        return (kq.float() * ks).to(k_new.dtype), (vq.float() * vs).to(v_new.dtype)

    def crop(self, n):
        super().crop(n)  # checks n and sets the lengths
        self.store = [None if s is None else [t[:, :, : self.length] for t in s] for s in self.store]

    def reorder(self, index):
        self.store = [None if s is None else [t.index_select(0, index.to(t.device)) for t in s] for s in self.store]
        self.lengths = [self.lengths[i] for i in index.tolist()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.store if s is not None for t in s)


def make_quantized_cache(n_layer: int) -> QuantizedCache:
    """Exercise 3: An int8 cache"""
    return QuantizedCache(n_layer)
