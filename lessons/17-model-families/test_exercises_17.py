"""Checks for lesson 17's exercises: `pytest lessons/17-model-families` (yours) or `--solutions`.

References: minillm's and transformers' norms; a brute-force mask over a rolling cache, a simulation of the ring
and transformers' MistralForCausalLM; `minillm.model.weight_names.rotary_order` and GPT-J's own rotation of
neighbouring pairs; the package's config mapping (`minillm.model.checkpoint.config_from_hf`) and transformers'
Llama and Qwen2 logits.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.model.norms import GemmaRMSNorm
from minillm.model.rope import RopeTable, apply_rope
from minillm.model.tiny import TINY_WINDOW, tiny_pair
from minillm.model.weight_names import rotary_order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exercise_1_gemma_norm_equals_minillm_and_transformers(answers, dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    ours, theirs = GemmaRMSNorm(64, 1e-6), Gemma3RMSNorm(64, 1e-6)
    with torch.no_grad():
        ours.weight.uniform_(-0.5, 0.5)
        theirs.weight.copy_(ours.weight)
        got = answers.gemma_rms_norm(x, ours.weight.to(dtype), 1e-6)
        assert got.dtype == dtype
        assert torch.equal(got, ours.to(dtype)(x)) and torch.equal(got, theirs.to(dtype)(x))


def ring_positions(end, slots):
    """The position each slot of a rolling cache holds after positions 0 .. end - 1 were written: -1 if none."""
    held = torch.full((slots,), -1)
    for p in range(end):
        held[p % slots] = p
    return held


def brute_force_window(query_positions, key_positions, window):
    B, T = query_positions.shape
    mask = torch.zeros(B, T, key_positions.shape[1], dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for j, key in enumerate(key_positions[b].tolist()):
                mask[b, t, j] = key >= 0 and 0 <= int(query_positions[b, t]) - key < window
    return mask


def test_exercise_2_mask_over_a_rolling_cache_by_brute_force(answers):
    slots, chunk = 10, 2
    ends = (2, 13, 40)  # three rows: one that has not filled its ring, one just wrapped, one wrapped several times
    keys = torch.stack([ring_positions(end, slots) for end in ends])  # [3, 10]
    queries = torch.stack([torch.arange(end - chunk, end) for end in ends])  # [3, 2]: the step just written
    shuffled = torch.randperm(slots, generator=torch.Generator().manual_seed(2))  # a paged order: any columns
    for window in (1, 3, 8, 10):
        for key_positions in (keys, keys[:, shuffled]):
            got = answers.sliding_window_mask(queries, key_positions, window)
            expected = brute_force_window(queries, key_positions, window)
            assert got.dtype == torch.bool and got.shape == expected.shape, window
            wrong = (got != expected).nonzero().tolist()
            assert not wrong, (f"window {window}: (row, query, column) {wrong[0]} holds position "
                               f"{int(key_positions[wrong[0][0], wrong[0][2]])}, the query is at "
                               f"{int(queries[wrong[0][0], wrong[0][1]])}: expected {bool(expected[tuple(wrong[0])])}")


def fewest_slots(window, chunk):
    """Simulate the ring over a long sequence for 1, 2, ... slots: the first count that never loses a needed key."""
    length = 4 * (window + chunk)
    for slots in itertools.count(1):
        held, enough = [-1] * slots, True
        for start in range(0, length, chunk):
            for p in range(start, start + chunk):
                held[p % slots] = p
            kept = set(held)
            enough &= all(j in kept for q in range(start, start + chunk) for j in range(max(0, q - window + 1), q + 1))
        if enough:
            return slots


def test_exercise_2_rolling_cache_slots_by_simulation(answers):
    for window in range(1, 13):
        for chunk in range(1, 7):
            got, expected = answers.rolling_cache_slots(window, chunk), fewest_slots(window, chunk)
            assert got == expected, (f"window {window}, steps of {chunk}: {expected} slots are the fewest that "
                                     f"lose no key, you said {got}")


class RingCache:
    """A rolling cache for every layer: position p's keys and values go to slot p % slots, over what was there."""

    def __init__(self, config, batch: int, slots: int):
        shape = (config.n_layer, batch, config.kv_heads, slots, config.head_size)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.positions = torch.full((batch, slots), -1)  # [B, slots]: the position each slot holds, -1 if none
        self.columns = None

    def write(self, positions):
        """Before a forward: the slots this step's tokens (positions [B, T]) go to."""
        self.columns = positions % self.positions.shape[1]
        self.positions.scatter_(1, self.columns, positions)

    def update(self, layer, k, v):
        """The model's cache call: store k, v [B, KV, T, hd] in their slots; return the ring [B, KV, slots, hd]."""
        index = self.columns[:, None, :, None].expand_as(k)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)
        return self.k[layer], self.v[layer]


@pytest.mark.parametrize("chunk", [1, 5])
def test_exercise_2_rolling_cache_gives_transformers_mistral(answers, chunk):
    hf_model, model = tiny_pair("mistral")
    length = 3 * TINY_WINDOW
    tokens = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(4))
    slots = answers.rolling_cache_slots(TINY_WINDOW, chunk)
    ring = RingCache(model.config, 2, slots)
    for block in model.blocks:  # hand the window-free attention your mask instead of the package's
        block.attn.window = None
    logits = []
    with torch.no_grad():
        for start in range(0, length, chunk):  # a prefill chunk by chunk, or (chunk 1) one token at a time
            positions = torch.arange(start, min(start + chunk, length)).expand(2, -1)
            ring.write(positions)
            mask = answers.sliding_window_mask(positions, ring.positions.clone(), TINY_WINDOW)
            logits.append(model(tokens[:, start: start + chunk], positions, cache=ring, mask=mask))
        torch.testing.assert_close(torch.cat(logits, dim=1), hf_model(tokens).logits, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"window {TINY_WINDOW}, steps of {chunk}, {slots} slots: {m}")


def gptj_rotate(x, positions, rotary_dim):
    """GPT-J's rotation: neighbours (2i, 2i + 1) of the first rotary_dim dims, speed theta^(-2i/rotary_dim)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = positions[0, :, None].float() * inv_freq  # [T, rotary_dim/2]
    sin, cos = angles.sin().repeat_interleave(2, -1)[:, None], angles.cos().repeat_interleave(2, -1)[:, None]
    rot = x[..., :rotary_dim]
    pairs = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
    return torch.cat((rot * cos + pairs * sin, x[..., rotary_dim:]), dim=-1)


def minillm_rope(head_dim, rotary_dim, positions):
    table = RopeTable(ModelConfig(n_head=2, d_model=2 * head_dim, positions="rope", norm="rmsnorm", mlp="swiglu",
                                  rotary_dim=rotary_dim))
    return table(positions, torch.float32)


def test_exercise_3_predicted_orders(answers):
    predicted = answers.predicted_orders()
    assert set(predicted) == {(12, 4), (8, 8)}, "predict the orders for (12, 4) and (8, 8)"
    for (head_dim, rotary_dim), order in predicted.items():
        expected = rotary_order(head_dim, rotary_dim, interleaved=True).tolist()
        assert list(order) == expected, f"head_dim {head_dim}, rotary_dim {rotary_dim}: you said {list(order)}"


@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (8, 4), (16, 6), (64, 32)])
def test_exercise_3_order_matches_the_package_and_keeps_scores(answers, head_dim, rotary_dim):
    order = torch.as_tensor(answers.interleaved_to_halves(head_dim, rotary_dim))
    assert torch.equal(order, rotary_order(head_dim, rotary_dim, interleaved=True))
    torch.manual_seed(1)
    q, k = torch.randn(1, 6, 2, head_dim), torch.randn(1, 6, 2, head_dim)
    positions = torch.arange(6)[None]
    rope = minillm_rope(head_dim, rotary_dim, positions)
    ours = apply_rope(q[..., order], *rope) @ apply_rope(k[..., order], *rope).transpose(-1, -2)
    theirs = gptj_rotate(q, positions, rotary_dim) @ gptj_rotate(k, positions, rotary_dim).transpose(-1, -2)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_exercise_3_predicted_breaks(answers):
    head_dim, rotary_dim, T, d_model = 12, 4, 6, 24
    order = rotary_order(head_dim, rotary_dim, interleaved=True)
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, T, 1, head_dim) for _ in range(3))  # [1, T, 1 head, head_dim]: one head's rows
    w_o = torch.randn(d_model, head_dim)
    positions = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def attend(scores, v, w_o):
        weights = (scores / head_dim ** 0.5).masked_fill(~causal, float("-inf")).softmax(-1)
        return (weights @ v[0, :, 0]) @ w_o.T

    reference = gptj_rotate(q, positions, rotary_dim)[0, :, 0] @ gptj_rotate(k, positions, rotary_dim)[0, :, 0].T
    rope = minillm_rope(head_dim, rotary_dim, positions)
    cases = {"q and k": (order, order, None, False), "q only": (order, None, None, False),
             "q, k and v": (order, order, order, False), "q, k, v and W_o": (order, order, order, True)}
    truth = {}
    for case, (q_order, k_order, v_order, move_w_o) in cases.items():
        q_in = q if q_order is None else q[..., q_order]
        k_in = k if k_order is None else k[..., k_order]
        v_in = v if v_order is None else v[..., v_order]
        scores = apply_rope(q_in, *rope)[0, :, 0] @ apply_rope(k_in, *rope)[0, :, 0].T
        output = attend(scores, v_in, w_o[:, order] if move_w_o else w_o)
        truth[case] = {"same scores": torch.allclose(scores, reference, atol=1e-5),
                       "same output": torch.allclose(output, attend(reference, v, w_o), atol=1e-5)}
    predicted = answers.predicted_breaks()
    assert set(predicted) == set(truth), f"predict exactly these cases: {sorted(truth)}"
    wrong = {case: (predicted[case], truth[case]) for case in truth if dict(predicted[case]) != truth[case]}
    assert not wrong, "predicted vs measured: " + "; ".join(f"{c}: {p} vs {t}" for c, (p, t) in wrong.items())


def resolved(config):
    """A ModelConfig with its None defaults resolved, so that two ways of saying the same model compare equal."""
    return dataclasses.replace(config, n_kv_head=config.kv_heads, head_dim=config.head_size,
                               d_ff=config.d_ff or 4 * config.d_model)


def llama_or_qwen2(kind, seed, **settings):
    import transformers as tf

    from minillm.model.tiny import randomized

    torch.manual_seed(seed)
    common = dict(vocab_size=96, max_position_embeddings=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, rms_norm_eps=1e-6) | settings
    config = tf.LlamaConfig(**common) if kind == "llama" else tf.Qwen2Config(**common)
    model = (tf.LlamaForCausalLM if kind == "llama" else tf.Qwen2ForCausalLM)(config)
    return randomized(model, gemma=False).eval()


VARIANTS = [
    ("llama", dict(num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)),
    ("llama", dict(num_key_value_heads=4, rope_theta=500000.0, tie_word_embeddings=True)),  # plain multi-head
    ("llama", dict(num_key_value_heads=1, rope_theta=1000.0, tie_word_embeddings=False, head_dim=16)),  # MQA, wide
    ("qwen2", dict(num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True)),
    ("qwen2", dict(num_key_value_heads=1, rope_theta=10000.0, tie_word_embeddings=False)),
]


@pytest.mark.parametrize("kind, settings", VARIANTS, ids=lambda v: v if isinstance(v, str) else None)
def test_exercise_4_the_config_gives_transformers_logits(answers, kind, settings):
    from minillm.model.checkpoint import config_from_hf, hf_to_minillm_state
    from minillm.model.transformer import Transformer

    hf_model = llama_or_qwen2(kind, seed=len(settings), **settings)
    hf = hf_model.config.to_dict()
    mine = answers.config_from_transformers(hf)
    assert isinstance(mine, ModelConfig)
    assert resolved(mine) == resolved(config_from_hf(hf)), "your config differs from the package's mapping"
    model = Transformer(mine)
    model.load_state_dict(hf_to_minillm_state(hf_model.state_dict(), mine, kind), strict=True)
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = model.eval()(tokens, torch.arange(20).expand(2, 20))
        torch.testing.assert_close(got, hf_model(tokens).logits, rtol=1e-5, atol=1e-5)


def test_exercise_4_old_style_configs_and_refusals(answers):
    hf = llama_or_qwen2("qwen2", seed=0, num_key_value_heads=2, rope_theta=1000000.0).config.to_dict()
    old_style = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_theta": 1000000.0}
    assert answers.config_from_transformers(old_style).rope_theta == 1000000.0
    for bad in ({"model_type": "gpt2"}, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                {"use_sliding_window": True, "sliding_window": 16}, {"hidden_act": "gelu"}):
        with pytest.raises(ValueError):
            answers.config_from_transformers(hf | bad)
    llama = llama_or_qwen2("llama", seed=0, num_key_value_heads=2).config.to_dict()
    with pytest.raises(ValueError):
        answers.config_from_transformers(llama | {"attention_bias": True})


def test_exercise_5_latent_cache_bytes_equal_what_the_caches_allocate(answers):
    """The tiny DeepSeek-V3's static cache, allocated for one row of 8 tokens: its bytes per token are the latent
    answer. The per-head answer against a cache sized for keys and values per head (a static cache with the latent
    model's head count and widths), and DeepSeek-V3's published sizes against the package's own count."""
    from minillm.cache.kv_cache import StaticCache
    from minillm.model.checkpoint import config_from_hf

    hf_model, model = tiny_pair("deepseek_v3")
    hf, c = hf_model.config.to_dict(), model.config
    for width in (4, 2):
        cache = StaticCache.for_model(model.to(torch.float32 if width == 4 else torch.bfloat16), 1, 8)
        latent, per_head = answers.cache_bytes_per_token(hf, width)
        assert latent == (cache.k.numel() + cache.v.numel()) * cache.k.element_size() // 8
        plain = StaticCache(c.n_layer, 1, c.n_head, c.qk_nope_dim + c.head_size, 8, value_dim=c.v_head_dim)
        assert per_head == (plain.k.numel() + plain.v.numel()) * width // 8
    v3 = dict(hf, num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, num_key_value_heads=128, q_lora_rank=1536)
    latent, per_head = answers.cache_bytes_per_token(v3, 2)
    assert latent == config_from_hf(v3).cache_values_per_token * 2 == 61 * 576 * 2
    assert per_head // latent == 71  # 40,960 numbers per layer against 576
