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

from .checkpoint import config_from_hf, hf_to_minillm_state
from .transformer import Transformer

TINY_KINDS = ("gpt2", "llama", "qwen2")
# Lesson 17's families, each with every switch it brings turned on and a sliding window (8)
# shorter than the prompts the checks use.
FAMILY_KINDS = ("gemma3", "gemma2", "qwen3", "mistral", "phi3", "opt", "opt-pre", "gptj")
# Mixtures of experts (lesson 17's next families), built like FAMILY_KINDS: Qwen3-MoE, gpt-oss (sinks, YaRN) and
# DeepSeek-V3 (latent attention, experts in groups and shared ones).
MOE_KINDS = ("qwen3_moe", "gpt_oss", "deepseek_v3")
TINY_WINDOW = 8


def tiny_hf_model(kind: str = "llama", seed: int = 0, vocab_size: int = 96, context_length: int = 64, n_layer: int = 2):
    """A small random transformers model (eval mode, float32).

    TINY_KINDS keep transformers' own initialisation (scaled up a little). FAMILY_KINDS
    randomise every parameter, norms and biases included: Gemma initialises its norm
    weights to zero, and a zero hides a norm applied twice, or not at all.
    """
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab_size, n_positions=context_length, n_embd=32, n_layer=n_layer, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=None, eos_token_id=None)
        model = tf.GPT2LMHeadModel(config)
    elif kind in ("llama", "qwen2"):
        common = dict(vocab_size=vocab_size, max_position_embeddings=context_length, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      tie_word_embeddings=kind == "qwen2")
        if kind == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(rope_theta=10000.0, **common))
        else:
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(rope_theta=1000000.0, **common))
    elif kind in FAMILY_KINDS + MOE_KINDS:
        model = tiny_family_model(kind, vocab_size, context_length)
        return randomized(model, gemma=kind.startswith("gemma")).eval()
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}: use one of "
                         f"{', '.join(TINY_KINDS + FAMILY_KINDS + MOE_KINDS)}")
    # Random init gives tiny logits; scale weights up a little so argmax is not decided by noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)
    return model.eval()


def tiny_family_model(kind: str, vocab_size: int, context_length: int):
    """Four layers (sliding and global ones interleaved where the family has both), two KV heads."""
    import transformers as tf

    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    llama_like = dict(vocab_size=vocab_size, max_position_embeddings=context_length, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, **ids)
    gemma = dict(llama_like, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    if kind == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(rope_parameters=rope, **gemma))
    if kind == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(attn_logit_softcapping=None, final_logit_softcapping=3.0,
                                                    **gemma))
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, tie_word_embeddings=True, **llama_like))
    if kind == "qwen3_moe":  # 4 experts, 2 per token; layer 1 keeps a dense MLP
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=24, norm_topk_prob=True,
                                                        mlp_only_layers=[1], **llama_like))
    if kind == "gpt_oss":  # 4 experts, 2 per token; YaRN stretching a 16-token pretraining context 4 times
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": context_length // 4}
        return tf.GptOssForCausalLM(tf.GptOssConfig(
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope, sliding_window=TINY_WINDOW,
            **dict(llama_like, intermediate_size=32)))  # rows of whole MXFP4 blocks (32), as gpt-oss's are
    if kind == "deepseek_v3":  # latent attention; layer 0 dense, then 8 experts in 4 groups (2 kept), 2 per token
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": context_length // 4}
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            kv_lora_rank=12, q_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, rope_parameters=rope,
            **dict(llama_like, num_key_value_heads=4)))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=TINY_WINDOW, **llama_like))
    if kind == "phi3":
        # Trained for half the context: prompts past it switch to the long factors. Phi3Config takes the original
        # length at its top level too, and its default (4096) would otherwise replace the one in rope_parameters.
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 2.0,
                "original_max_position_embeddings": context_length // 2,
                "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0]}
        return tf.Phi3ForCausalLM(tf.Phi3Config(rope_parameters=rope, sliding_window=TINY_WINDOW,
                                                original_max_position_embeddings=context_length // 2,
                                                resid_pdrop=0.0, embd_pdrop=0.0, **llama_like))
    if kind in ("opt", "opt-pre"):
        return tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=vocab_size, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=context_length, word_embed_proj_dim=16, do_layer_norm_before=kind == "opt-pre",
            dropout=0.0, attention_dropout=0.0, **ids))
    return tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=vocab_size, n_positions=context_length, n_embd=32, n_layer=4,
                                            n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=None, eos_token_id=None))


def randomized(model, gemma: bool):
    """Every parameter random: matrices ~N(0, 0.1), biases ~N(0, 0.1), norm weights around 1 (Gemma: around 0,
    since it adds the 1 itself); DeepSeek-V3's expert-choice biases (buffers) ~N(0, 0.1) too."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(-0.5, 0.5).add_(0.0 if gemma else 1.0)
    return model


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
