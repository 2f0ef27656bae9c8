"""Tiny random models, in transformers and in minillm with the same weights.

The course checks every lesson against transformers. Real checkpoints are large
(and unreachable offline), but transformers builds any architecture from a config
with random weights and no download, so a 2-layer GPT-2, Llama or Qwen2 with a
small vocabulary is an exact, fast reference:

    hf_model, model = tiny_pair("llama")
    model(tokens, positions)  ==  hf_model(tokens).logits   (fp32, ~1e-6)
"""

from __future__ import annotations

import torch

from .loading import config_from_hf, hf_to_minillm_state
from .model import Transformer

TINY_KINDS = ("gpt2", "llama", "qwen2")


def tiny_hf_model(kind: str = "llama", seed: int = 0, vocab_size: int = 96, block_size: int = 64, n_layer: int = 2):
    """A small random transformers model (eval mode, float32)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=32, n_layer=n_layer, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=None, eos_token_id=None)
        model = tf.GPT2LMHeadModel(config)
    elif kind in ("llama", "qwen2"):
        common = dict(vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      tie_word_embeddings=kind == "qwen2")
        if kind == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(rope_theta=10000.0, **common))
        else:
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(rope_theta=1000000.0, **common))
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}: use one of {', '.join(TINY_KINDS)}")
    # Random init gives tiny logits; scale weights up a little so argmax is not decided by noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)
    return model.eval()


def from_hf_model(hf_model) -> Transformer:
    """The same weights in a minillm Transformer (shared storage is copied)."""
    config = config_from_hf(hf_model.config.to_dict())
    state = hf_to_minillm_state(hf_model.state_dict(), config, hf_model.config.model_type)
    model = Transformer(config)
    model.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return model.eval()


def tiny_pair(kind: str = "llama", seed: int = 0, **sizes):
    """(transformers model, minillm model) holding identical random weights."""
    hf_model = tiny_hf_model(kind, seed, **sizes)
    return hf_model, from_hf_model(hf_model)
