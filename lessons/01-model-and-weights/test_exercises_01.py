"""Checks for lesson 01's exercises: transformers' GPT-2, the package's own modules, and the gguf package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from minillm.model.checkpoint import config_from_hf
from minillm.model.config import ModelConfig
from minillm.model.gguf import unpermute_rope as package_unpermute
from minillm.model.tiny import tiny_hf_model, tiny_pair
from minillm.model.transformer import Transformer, causal_positions


@pytest.mark.parametrize("seed", [0, 1])
def test_exercise_1_gpt2_forward_matches_transformers(answers, seed):
    hf_model, model = tiny_pair("gpt2", seed=seed)
    tokens = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(seed))
    state = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        ours = answers.gpt2_logits(state, model.config, tokens)
        theirs = hf_model(tokens).logits
        package = model(tokens, causal_positions(*tokens.shape))
    assert ours.shape == theirs.shape == (3, 20, model.config.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours, package, atol=2e-5, rtol=1e-5)


def test_exercise_1_gpt2_forward_is_causal(answers):
    """Changing the last token must not change the logits at earlier positions."""
    _, model = tiny_pair("gpt2", seed=2)
    state = dict(model.state_dict())
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    other = tokens.clone()
    other[0, -1] = (other[0, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = answers.gpt2_logits(state, model.config, tokens), answers.gpt2_logits(state, model.config, other)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, -1], b[:, -1])


SMOLLM2 = ModelConfig(vocab_size=49152, context_length=8192, n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536,
                      norm="rmsnorm", positions="rope", rope_theta=100000.0, mlp="swiglu", bias=False, qkv_bias=False)
CONFIGS = {
    "gpt2-small": ModelConfig(),
    "smollm2-135m": SMOLLM2,
    "tiny-qwen2": config_from_hf(tiny_hf_model("qwen2").config.to_dict()),  # q/k/v bias, tied
    "tiny-llama": config_from_hf(tiny_hf_model("llama").config.to_dict()),  # untied LM head
    "gpt2-untied-gqa": ModelConfig(n_layer=3, n_head=8, n_kv_head=2, d_model=64, vocab_size=100, context_length=32,
                                   tie_embeddings=False),
}


def counted_by_kind(config: ModelConfig) -> dict[str, int]:
    """The reference: build the model on the meta device (no memory) and add up its parameters by name."""
    with torch.device("meta"):
        model = Transformer(config)
    kinds = {"embeddings": 0, "attention": 0, "mlp": 0, "norms": 0}
    for name, p in model.named_parameters():  # a tied matrix is listed once
        kind = ("embeddings" if name.split(".")[0] in ("tok_emb", "pos_emb", "lm_head") else
                "attention" if ".attn." in name else "mlp" if ".mlp." in name else "norms")
        kinds[kind] += p.numel()
    return kinds | {"total": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("name", CONFIGS)
def test_exercise_2_parameters_from_the_config(answers, name):
    config = CONFIGS[name]
    ours = answers.count_parameters(config)
    assert ours == counted_by_kind(config)


def test_exercise_2_known_totals(answers):
    assert answers.count_parameters(ModelConfig())["total"] == 124_439_808  # GPT-2 small, as published
    assert answers.count_parameters(SMOLLM2)["total"] == 134_515_008  # SmolLM2-135M


@pytest.mark.parametrize("shape", [(1, 32), (4, 64), (3, 2, 96)])
def test_exercise_3_q5_1_matches_gguf(answers, shape):
    values = np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32) * 0.1
    values[..., :32] += 0.5  # one block with a positive minimum
    raw = quantize(values, gguf.GGMLQuantizationType.Q5_1)  # uint8 [..., 24 bytes per 32 weights]
    assert raw.shape[-1] == values.shape[-1] // 32 * 24
    ours = answers.dequantize_q5_1(raw)
    expected = dequantize(raw, gguf.GGMLQuantizationType.Q5_1)
    assert ours.shape == expected.shape == values.shape
    np.testing.assert_array_equal(np.asarray(ours, dtype=np.float32), expected)
    assert np.abs(ours - values).max() < 0.03  # and it is the weights, within a 5-bit step


def test_exercise_3_q5_1_reads_every_fifth_bit(answers):
    # One block whose q_i run 0..31 in a scrambled order: each weight's fifth bit is in play, and a wrong
    # bit order (or a big-endian qh) puts some weight 16 steps off.
    q = np.random.default_rng(0).permutation(32).astype(np.float32)
    raw = quantize(q[None] * 0.125 - 1.0, gguf.GGMLQuantizationType.Q5_1)  # d = 0.125, m = -1: exact in float16
    np.testing.assert_array_equal(np.asarray(answers.dequantize_q5_1(raw), dtype=np.float32)[0], q * 0.125 - 1.0)


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to the q and k rows (LlamaModel.permute)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 8), (2, 4)])
def test_exercise_4_unpermute_undoes_llama_cpp(answers, n_head, head_dim):
    w = np.random.default_rng(n_head).normal(size=(n_head * head_dim, 16)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    ours = answers.unpermute_rope(permuted, n_head)
    np.testing.assert_array_equal(ours, w)
    np.testing.assert_array_equal(ours, package_unpermute(permuted, n_head))
