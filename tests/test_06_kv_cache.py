"""Lesson 06: KV caches. Every cache kind must give exactly the tokens of recomputing everything."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minillm.cache.kinds import make_cache
from minillm.cache.kv_cache import DynamicCache, StaticCache
from minillm.model.tiny import tiny_pair
from minillm.model.transformer import Transformer, causal_positions
from minillm.strategies.generate import generate

CACHES = ("static", "dynamic", "blocks", "none")


def brute_force_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding the slow, obvious way: a full forward over the last context_length tokens per step."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            window = seq[-model.config.context_length:]
            logits = model(torch.tensor([window]), causal_positions(1, len(window)))
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("new_tokens", [20, 90], ids=["within-context", "past-context"])
def test_all_caches_give_brute_force_tokens(kind, new_tokens):
    _, model = tiny_pair(kind)  # context_length 64: 30 + 90 tokens slides the window 56 times
    prompt = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = brute_force_greedy(model, prompt, new_tokens)
    for cache in CACHES:
        out = generate(model, [prompt], cache=cache, max_new_tokens=new_tokens)
        assert out.token_ids[0] == expected, cache


def test_caches_agree_with_transformers_generate(tiny):
    hf_model, model = tiny
    prompt = [5, 17, 42, 8, 3, 60, 11]
    hf_model.generation_config.eos_token_id = None
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    for cache in CACHES:
        assert generate(model, [prompt], cache=cache, max_new_tokens=40).token_ids[0] == expected, cache


def test_batched_caches_agree_past_the_context(tiny):
    _, model = tiny
    prompts = [[1, 2, 3], list(range(10, 50))]
    outs = {c: generate(model, prompts, cache=c, max_new_tokens=45, window_slide=4).token_ids for c in CACHES}
    assert outs["static"] == outs["dynamic"] == outs["blocks"] == outs["none"]


def small_context_copy(model, context_length: int) -> Transformer:
    """The same weights with a shorter context: makes sliding-window runs on the real model affordable."""
    small = Transformer(replace(model.config, context_length=context_length))
    small.load_state_dict(model.state_dict(), strict=True)
    return small.eval()


def test_default_model_caches_agree_past_the_context(default_model):
    model, tokenizer = default_model
    small = small_context_copy(model, context_length=20)
    prompt = tokenizer.encode("The three primary colours are")
    outs = {c: generate(small, [prompt], cache=c, max_new_tokens=24, eos_token_id=()).token_ids[0] for c in CACHES}
    assert len(prompt) + 24 > 20  # the window really slid
    assert outs["static"] == outs["dynamic"] == outs["blocks"] == outs["none"]


def test_default_model_caches_agree_within_the_context(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.encode("Once upon a time")
    outs = {c: generate(model, [prompt], cache=c, max_new_tokens=16, eos_token_id=()).token_ids[0] for c in CACHES}
    assert outs["static"] == outs["dynamic"] == outs["blocks"] == outs["none"]


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_crop_then_refeed_gives_the_same_logits(tiny, cache_kind):
    _, model = tiny
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = causal_positions(2, 24)
    with torch.inference_mode():
        cache = make_cache(cache_kind, model, 2, 32)
        never_cropped = model(tokens, positions, cache=cache)[:, 15:]
        cache.crop(15)
        assert cache.length == 15
        refed = model(tokens[:, 15:], positions[:, 15:], cache=cache)
    torch.testing.assert_close(refed, never_cropped, atol=1e-5, rtol=1e-5)
    assert cache.length == 24


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_reorder_keeps_the_chosen_rows(tiny, cache_kind):
    _, model = tiny
    tokens = torch.randint(0, model.config.vocab_size, (3, 10))
    positions = causal_positions(3, 10)
    index = torch.tensor([2, 0, 0])  # drop row 1, keep row 2 first, duplicate row 0 (a beam search step)
    with torch.inference_mode():
        cache = make_cache(cache_kind, model, 3, 16)
        model(tokens, positions, cache=cache)
        cache.reorder(index)
        after = model(tokens[index, -1:], positions[index, -1:] + 1, cache=cache)
        fresh = make_cache(cache_kind, model, 3, 16)
        model(tokens[index], positions[index], cache=fresh)
        expected = model(tokens[index, -1:], positions[index, -1:] + 1, cache=fresh)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


def test_static_cache_never_reallocates_while_decoding(tiny):
    _, model = tiny
    cache = StaticCache.for_model(model, batch=1, max_len=40)
    storage = (cache.k.data_ptr(), cache.v.data_ptr())
    prompt = torch.arange(8)[None]
    with torch.inference_mode():
        logits = model(prompt, causal_positions(1, 8), cache=cache)
        for t in range(8, 40):
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(token, torch.tensor([[t]]), cache=cache)
            k_all, _ = cache.update(0, *([cache.k[0, :1, :, :0]] * 2))  # a zero-length write returns the view
            assert k_all.data_ptr() == cache.k.data_ptr()  # attention reads the preallocated storage itself
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == storage
    assert cache.length == 40


def test_static_cache_overflow_is_a_clear_error(tiny):
    _, model = tiny
    cache = StaticCache.for_model(model, batch=1, max_len=8)
    with torch.inference_mode():
        model(torch.arange(8)[None], causal_positions(1, 8), cache=cache)
        with pytest.raises(RuntimeError, match="static KV cache is full: it holds 8 of 8 tokens"):
            model(torch.tensor([[1]]), torch.tensor([[8]]), cache=cache)


def test_dynamic_cache_grows_by_one_column_per_step(tiny):
    _, model = tiny
    cache = DynamicCache(model.config.n_layer)
    with torch.inference_mode():
        model(torch.arange(5)[None], causal_positions(1, 5), cache=cache)
        model(torch.tensor([[7]]), torch.tensor([[5]]), cache=cache)
    assert cache.length == 6 and cache.keys[0].shape[2] == 6


def test_bad_cache_kind_and_crop_are_clear_errors(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="unknown cache kind 'paged'"):
        make_cache("paged", model, 1, 8)
    with pytest.raises(ValueError, match=r"crop\(5\)"):
        make_cache("static", model, 1, 8).crop(5)


def test_notebook_runs(run_notebook):
    run_notebook("06_kv_cache.ipynb", timeout=600)


def _linear_reference(layer, x):
    """F.linear in float64: the exact product the fast Linear must approximate to float32 rounding."""
    bias = None if layer.bias is None else layer.bias.double()
    return torch.nn.functional.linear(x.double(), layer.weight.double(), bias)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("out_features", [96, 50])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_linear_equals_plain_linear(rows, out_features, bias):
    """The decode-speed Linear (oneDNN on a prepacked weight) computes F.linear."""
    from minillm.speed.onednn import OneDNNLinear as Linear

    torch.manual_seed(0)
    layer = Linear(40, out_features, bias=bias).requires_grad_(False)
    x = torch.randn(2, rows, 40)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (2, rows, out_features)
    torch.testing.assert_close(got.double(), _linear_reference(layer, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("libraries_stream_matvecs", [True, False])
def test_fast_linear_sends_up_to_three_rows_to_mkl_where_it_streams_faster(monkeypatch, libraries_stream_matvecs):
    """One to three rows on an Intel CPU with AVX-512: MKL's product on the weight itself (F.linear, bit for bit, no
    packed copy made); elsewhere, and for four rows or more everywhere, oneDNN on its packed copy."""
    from minillm.speed import onednn

    monkeypatch.setattr(onednn, "libraries_stream_matvecs", lambda: libraries_stream_matvecs)
    torch.manual_seed(0)
    layer = onednn.OneDNNLinear(64, 96).requires_grad_(False)
    with torch.inference_mode():
        for shape in [(1, 1, 64), (2, 64), (3, 1, 64), (1, onednn.MKL_MAX_ROWS, 64)]:
            x = torch.randn(shape)
            y = layer(x)
            assert y.shape == (*shape[:-1], 96)
            assert ("_packed" in layer.__dict__) is not libraries_stream_matvecs
            if libraries_stream_matvecs:
                assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer(torch.randn(2, onednn.MKL_MAX_ROWS + 1, 64))
        assert "_packed" in layer.__dict__  # more rows: oneDNN on every machine


@pytest.mark.parametrize("bias", [True, False])
def test_unpacked_fast_linear_and_the_graphs_onednn_call_compute_linear(bias):
    """The one-shot prefill's Linear (oneDNN on the weight as it lies: no packed copy) and the call a compiled step
    makes over several rows (`onednn_linear`, on a copy packed once per weight and kept while the weight lives, made
    again after an edit) compute F.linear."""
    from minillm.speed import onednn

    torch.manual_seed(0)
    layer = onednn.use_unpacked_onednn(onednn.use_onednn(torch.nn.Linear(40, 96, bias=bias).requires_grad_(False)))
    graph_layer = onednn.linears_call_onednn(torch.nn.Sequential(torch.nn.Linear(40, 96, bias=bias)))[0]
    graph_layer.requires_grad_(False)
    x = torch.randn(2, 9, 40)
    with torch.inference_mode():
        got = layer(x)
        assert type(layer) is onednn.UnpackedOneDNNLinear and "_packed" not in layer.__dict__
        torch.testing.assert_close(got.double(), _linear_reference(layer, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph_layer(x).double(), _linear_reference(graph_layer, x), atol=1e-5, rtol=1e-5)
        packed = onednn.packed_for_graphs(graph_layer.weight)
        graph_layer(x)
        assert onednn.packed_for_graphs(graph_layer.weight) is packed  # packed once
    with torch.no_grad():
        graph_layer.weight.mul_(-1)  # edited in place: the packed copy is stale
    with torch.inference_mode():
        torch.testing.assert_close(graph_layer(x).double(), _linear_reference(graph_layer, x), atol=1e-5, rtol=1e-5)


def test_fast_linear_repacks_when_the_weight_changes():
    """A stale packed copy would keep computing with the old weight after a load or an edit."""
    from minillm.speed.onednn import OneDNNLinear as Linear

    torch.manual_seed(0)
    layer = Linear(16, 24).requires_grad_(False)
    x = torch.randn(3, 16)
    layer(x)
    layer.load_state_dict({"weight": torch.randn(24, 16), "bias": torch.randn(24)})  # copied in place
    torch.testing.assert_close(layer(x).double(), _linear_reference(layer, x), atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)  # a new tensor
    torch.testing.assert_close(layer(x).double(), _linear_reference(layer, x), atol=1e-5, rtol=1e-5)


def test_fast_linear_survives_deepcopy_and_dtype_changes():
    """Lessons copy models (drafts, precision variants); the packed copy must not get in the way."""
    import copy

    from minillm.speed.onednn import OneDNNLinear as Linear

    torch.manual_seed(0)
    layer = Linear(16, 24).requires_grad_(False)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        expected = layer(x)
        torch.testing.assert_close(copy.deepcopy(layer)(x), expected)
        torch.testing.assert_close(layer.double()(x.double()).float(), expected, atol=1e-5, rtol=1e-5)


def test_fast_linear_keeps_gradients_when_training():
    """With gradients wanted, Linear falls back to F.linear, which has a backward."""
    from minillm.speed.onednn import OneDNNLinear as Linear

    layer = Linear(8, 4)
    layer(torch.randn(2, 8)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_rope_table_grows_past_the_context_with_exact_angles():
    """Keeping a cache while sliding past the context numbers tokens beyond context_length: the table must grow,
    give the exact rotation there, and leave every position it already held unchanged."""
    import math

    from minillm.model.config import ModelConfig
    from minillm.model.rope import RopeTable

    config = ModelConfig(vocab_size=32, context_length=16, n_layer=1, n_head=2, d_model=16, positions="rope",
                         norm="rmsnorm", mlp="swiglu")
    table = RopeTable(config)
    inside = torch.arange(16)[None]
    cos_before, sin_before = table(inside, torch.float32)
    far = torch.tensor([[15, 16, 40, 1000]])
    cos, sin = table(far, torch.float32)  # [1, 4, 1, head_dim]
    hd, half = config.head_size, config.head_size // 2
    for i, p in enumerate(far[0].tolist()):
        angles = [p * config.rope_theta ** (-2 * j / hd) for j in range(half)] * 2  # float64 reference
        expected_sin = [-math.sin(a) for a in angles[:half]] + [math.sin(a) for a in angles[half:]]  # sign folded
        torch.testing.assert_close(cos[0, i, 0].double(), torch.tensor([math.cos(a) for a in angles], dtype=torch.float64),
                                   atol=2e-4, rtol=0)  # float32 angles of ~1000 rad: ~1e-4 absolute
        torch.testing.assert_close(sin[0, i, 0].double(), torch.tensor(expected_sin, dtype=torch.float64),
                                   atol=2e-4, rtol=0)
    cos_after, sin_after = table(inside, torch.float32)
    assert torch.equal(cos_after, cos_before) and torch.equal(sin_after, sin_before)
    assert len(table.tables[(torch.float32, inside.device)][0]) >= 1001


def test_model_runs_past_the_context_with_rope_only():
    """A RoPE model accepts positions past context_length (relative offsets are what it sees); GPT-2 cannot."""
    _, model = tiny_pair("llama")
    B = model.config.context_length
    tokens = torch.randint(0, model.config.vocab_size, (1, 10))
    with torch.inference_mode():
        at_start = model(tokens, causal_positions(1, 10))
        shifted = model(tokens, causal_positions(1, 10) + 3 * B)  # the same window, numbered past the context
    torch.testing.assert_close(shifted, at_start, atol=1e-4, rtol=1e-4)  # RoPE scores depend on offsets only
    _, gpt2 = tiny_pair("gpt2")
    with pytest.raises(IndexError):
        gpt2(tokens, causal_positions(1, 10) + gpt2.config.context_length)
