"""Checks for lesson 06's exercises: each compares your answer with a reference computed here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minillm.cache.kv_cache import DynamicCache, StaticCache
from minillm.model.config import ModelConfig
from minillm.model.tiny import tiny_pair
from minillm.model.transformer import causal_positions

CONFIGS = {
    "gpt2-small": ModelConfig(),  # 12 heads, plain multi-head attention
    "smollm2-135m": ModelConfig(vocab_size=49152, context_length=8192, n_layer=30, n_head=9, n_kv_head=3, d_model=576,
                                d_ff=1536, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False,
                                qkv_bias=False),
    "explicit-head-dim": ModelConfig(vocab_size=100, n_layer=3, n_head=8, n_kv_head=2, d_model=64, head_dim=24,
                                     norm="rmsnorm", positions="rope", mlp="swiglu"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_exercise_1_cache_bytes_for_any_model(answers, name, dtype):
    config = CONFIGS[name]
    for batch, max_len in ((1, 7), (3, 50)):
        fake_model = SimpleNamespace(config=config, dtype=dtype, device=None)
        allocated = StaticCache.for_model(fake_model, batch=batch, max_len=max_len)  # the real allocation
        expected = allocated.k.nbytes + allocated.v.nbytes
        assert answers.kv_cache_bytes(config, batch, max_len, dtype) == expected, (batch, max_len)


def cache_bytes_allocated(config, batch: int, max_len: int, dtype) -> int:
    """What `StaticCache.for_model` allocates, on the meta device (shapes and sizes, no memory)."""
    fake_model = SimpleNamespace(config=config, dtype=dtype, device="meta")
    allocated = StaticCache.for_model(fake_model, batch=batch, max_len=max_len)
    return allocated.k.nbytes + allocated.v.nbytes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exercise_1_when_the_cache_outgrows_the_weights(answers, name):
    """Against a search over the real allocation: the first length whose cache holds the weights, or None."""
    config = CONFIGS[name]
    for weight_bytes in (10**6, 538_000_000, 3 * 10**9):
        for batch in (1, 8, 64):
            for dtype in (torch.float32, torch.bfloat16):
                low, high = 1, config.context_length + 1  # the answer lies in [low, high]; high: never
                while low < high:
                    mid = (low + high) // 2
                    low, high = (low, mid) if cache_bytes_allocated(config, batch, mid, dtype) >= weight_bytes \
                        else (mid + 1, high)
                expected = None if low > config.context_length else low
                assert answers.outgrows_weights(config, weight_bytes, batch, dtype) == expected, \
                    (weight_bytes, batch, dtype)


def banded_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Brute force: every step forwards the whole sequence; query t sees keys t - context_length + 1 .. t."""
    window, seq = model.config.context_length, list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            L = len(seq)
            t = torch.arange(L)
            band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)  # [L, L]
            logits = model(torch.tensor([seq]), causal_positions(1, L), mask=band[None])
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("kind,context_length,prompt_len,new_tokens", [
    ("llama", 16, 10, 40),   # slides 33 times, positions up to 48
    ("qwen2", 8, 5, 40),     # a tiny window: nearly every token slides
])
def test_exercise_2_rope_sliding_without_re_prefill(answers, kind, context_length, prompt_len, new_tokens):
    _, model = tiny_pair(kind, context_length=context_length)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(3)).tolist()
    forwarded = []
    hook = model.register_forward_pre_hook(lambda module, args: forwarded.append(args[0].shape[1]))
    try:
        got = answers.generate_sliding(model, prompt, new_tokens)
    finally:
        hook.remove()
    assert got == banded_greedy(model, prompt, new_tokens)
    assert sum(forwarded) == prompt_len + new_tokens - 1, \
        f"{sum(forwarded)} tokens forwarded: prefill once, then one token per step (no re-prefill)"
    _, gpt2 = tiny_pair("gpt2")
    with pytest.raises(ValueError):
        answers.generate_sliding(gpt2, prompt[:5], 3)


def _decode_logits(model, cache, tokens, prefill: int):
    """Prefill `prefill` tokens, then feed the rest one at a time (teacher forcing); logits of each fed token."""
    B, L = tokens.shape
    out = [model(tokens[:, :prefill], causal_positions(B, prefill), cache=cache)]
    for t in range(prefill, L):
        out.append(model(tokens[:, t:t + 1], torch.full((B, 1), t), cache=cache))
    return torch.cat(out, dim=1)  # [B, L, V]


def test_exercise_3_an_int8_cache(answers):
    _, model = tiny_pair("llama")
    c = model.config
    # The stored values are the quantization formula's, exactly: on the int8 grid, within half a step.
    cache = answers.make_quantized_cache(c.n_layer)
    k_new, v_new = torch.randn(2, c.kv_heads, 5, c.head_size) * 3, torch.randn(2, c.kv_heads, 5, c.head_size)
    for layer in range(c.n_layer):
        k_all, v_all = cache.update(layer, k_new, v_new)
    for x, got in ((k_new, k_all), (v_new, v_all)):
        scale = x.abs().amax(dim=-1, keepdim=True) / 127
        assert got.shape == x.shape and got.dtype == x.dtype
        assert not torch.equal(got, x), "the cache must quantize"
        assert ((got - x).abs() <= scale / 2 * 1.0001 + 1e-7).all(), "more than half a quantization step off"
        steps = got / scale
        torch.testing.assert_close(steps, steps.round(), atol=1e-3, rtol=0)  # on the int8 grid
    assert cache.nbytes() == c.n_layer * 2 * 2 * c.kv_heads * 5 * (c.head_size * 1 + 4)  # int8 + one fp32 scale
    # Whole decodes against DynamicCache: close, within a bound that int8 keys and values allow.
    tokens = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact = _decode_logits(model, DynamicCache(c.n_layer), tokens, 12)
        quantized_cache = answers.make_quantized_cache(c.n_layer)
        quantized = _decode_logits(model, quantized_cache, tokens, 12)
        bound = 0.02 * exact.abs().max()
        assert (quantized - exact).abs().max() <= bound, f"logits differ by {(quantized - exact).abs().max():.4f}"
        assert not torch.equal(quantized, exact)
        assert quantized_cache.length == 24
        # crop + refeed gives the logits of never cropping (per-token scales: nothing is re-quantized).
        quantized_cache.crop(15)
        assert quantized_cache.length == 15
        refed = torch.cat([model(tokens[:, t:t + 1], torch.full((2, 1), t), cache=quantized_cache)
                           for t in range(15, 24)], dim=1)
        torch.testing.assert_close(refed, quantized[:, 15:], atol=1e-5, rtol=1e-5)
        # reorder keeps, duplicates and drops rows like a fresh run on the reordered batch.
        index = torch.tensor([1, 1, 0])
        quantized_cache.crop(20)
        quantized_cache.reorder(index)
        after = model(tokens[index, 20:21], torch.full((3, 1), 20), cache=quantized_cache)
        fresh = answers.make_quantized_cache(c.n_layer)
        _decode_logits(model, fresh, tokens[index, :20], 12)
        expected = model(tokens[index, 20:21], torch.full((3, 1), 20), cache=fresh)
        torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
