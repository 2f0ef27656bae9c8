"""Model families: which architectures minillm reads, and how each one's config.json becomes a `ModelConfig`.

One `Transformer` class runs every family; what differs is a handful of config
switches (lesson 17). Each family here says how to read them off a transformers
`config.json`, refusing in one line a setting minillm does not implement, and names
the function that renames (and fuses, or reorders) its tensors (`minillm.model.weight_names`):

    family = family_for(hf_config)            # refuses an unknown architecture in one line
    config = family.config(hf_config)         # -> ModelConfig
    state, origin = family.state(weights, config)   # our names -> tensors; our names -> theirs (for errors)

GGUF files name architectures and tensors their own way (llama.cpp's);
`minillm.model.gguf.GGUF_FAMILIES` maps those onto the Hugging Face names, so a GGUF is
converted once into an ordinary checkpoint folder and loaded like any other (`minillm.model.loading`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .config import ModelConfig
from .fetch import ModelLoadError
from .weight_names import (StateBuilder, deepseek_v3_state, gpt2_state, gpt_oss_state, gptj_state, llama_like_state,
                           opt_state)


class UnsupportedModel(ModelLoadError):
    """A checkpoint whose architecture, or one of whose settings, minillm does not implement."""


def rope_settings(hf: dict, layer_type: str | None = None) -> dict:
    """The RoPE settings of a config, old style (rope_theta, rope_scaling) or new (rope_parameters).

    Gemma 3 keeps one set per layer type ("full_attention", "sliding_attention").
    """
    params = hf.get("rope_parameters") or {}
    if layer_type is not None and layer_type in params:  # new style: one set per layer type
        rope = dict(params[layer_type])
    elif layer_type == "sliding_attention":  # old style: Gemma 3's sliding layers have their own base, unscaled
        rope = {"rope_theta": hf.get("rope_local_base_freq", hf.get("rope_theta", 10000.0))}
    else:
        rope = {**(hf.get("rope_scaling") or {}), **params}
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def yarn_magnitude(factor: float, scale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1·scale·ln(factor) + 1 (transformers'
    `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def yarn_switches(hf: dict, rope: dict) -> dict:
    """A YaRN RoPE's `ModelConfig` switches (`minillm.model.rope.yarn_inv_freq`), read as transformers reads them."""
    original = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (yarn_magnitude(factor, mscale) / yarn_magnitude(factor, all_dims) if mscale and all_dims
                            else yarn_magnitude(factor))
    return dict(rope_theta=float(rope["rope_theta"]), rope_yarn_factor=float(factor),
                rope_yarn_betas=(float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)),
                rope_yarn_truncate=bool(rope.get("truncate", True)), rope_original_max=int(original),
                rope_attention_factor=float(attention_factor))


def plain_rope_theta(hf: dict, layer_type: str | None = None) -> float:
    """The RoPE base of a model that uses plain RoPE (refusing scaled variants)."""
    rope = rope_settings(hf, layer_type)
    if rope["rope_type"] != "default":
        raise UnsupportedModel(f"unsupported RoPE scaling {rope['rope_type']!r} in a {hf['model_type']} config: "
                               f"minillm implements plain RoPE and YaRN here (and long-RoPE for phi3)")
    return float(rope["rope_theta"])


def refuse(hf: dict, condition: bool, what: str) -> None:
    if condition:
        raise UnsupportedModel(f"unsupported {hf['model_type']} variant: {what}")


def rotary_fraction(hf: dict) -> float:
    return float(rope_settings(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def sliding_layers(hf: dict, sliding_window: int | None) -> tuple[str, ...] | None:
    """transformers' per-layer types ("sliding_attention"/"full_attention") -> ours, or None for all alike."""
    types = hf.get("layer_types")
    if sliding_window is None or not types:
        return None
    return tuple("sliding" if t == "sliding_attention" else "full" for t in types)


def llama_like(hf: dict, **switches) -> ModelConfig:
    """The config of a Llama-shaped model (RMSNorm, RoPE, gated MLP, GQA), with the family's own switches."""
    refuse(hf, hf.get("mlp_bias", False), "mlp_bias=True")
    settings = dict(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_kv_head=hf.get("num_key_value_heads"), d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], head_dim=hf.get("head_dim"), norm="rmsnorm", norm_eps=hf["rms_norm_eps"],
        positions="rope", mlp="swiglu", bias=False, qkv_bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )
    if "rope_theta" not in switches:
        rope = rope_settings(hf)
        yarn = rope["rope_type"] == "yarn"
        settings.update(yarn_switches(hf, rope) if yarn else {"rope_theta": plain_rope_theta(hf)})
    settings.update(switches)
    return ModelConfig(**settings)


def silu_only(hf: dict, key: str = "hidden_act") -> None:
    refuse(hf, hf.get(key, "silu") != "silu", f"{key}={hf.get(key)!r} (this family's MLP uses silu)")


def llama_config(hf: dict) -> ModelConfig:
    silu_only(hf)
    refuse(hf, hf.get("attention_bias", False), "attention_bias=True")
    return llama_like(hf)


def qwen_config(hf: dict) -> ModelConfig:
    """Qwen2: a bias on q/k/v. Qwen3: QK-norm instead. Both may slide a window over their upper layers."""
    silu_only(hf)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    qwen3 = hf["model_type"] == "qwen3"
    return llama_like(hf, qkv_bias=hf.get("attention_bias", False) if qwen3 else True, qk_norm=qwen3,
                      sliding_window=window, layer_types=sliding_layers(hf, window))


def qwen3_moe_config(hf: dict) -> ModelConfig:
    """Qwen3 with mixtures of experts: every `decoder_sparse_step`-th layer's MLP (but `mlp_only_layers`) routes each
    token to `num_experts_per_tok` of `num_experts` experts."""
    silu_only(hf)
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    dense |= {i for i in range(hf["num_hidden_layers"]) if (i + 1) % step}
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers 5 writes the second name
    return llama_like(hf, qkv_bias=hf.get("attention_bias", False), qk_norm=True, sliding_window=window,
                      layer_types=sliding_layers(hf, window), num_experts=experts,
                      experts_per_token=hf["num_experts_per_tok"], moe_ff=hf["moe_intermediate_size"],
                      norm_topk_prob=hf.get("norm_topk_prob", False), dense_layers=tuple(sorted(dense)))


def gpt_oss_config(hf: dict) -> ModelConfig:
    """gpt-oss: every MLP a mixture of experts (router and experts biased, top-k then softmax, a clamped SwiGLU),
    biased attention with a learned sink per head, sliding and full layers in turn, YaRN RoPE."""
    window = hf.get("sliding_window")
    return llama_like(hf, qkv_bias=hf.get("attention_bias", True), attn_out_bias=hf.get("attention_bias", True),
                      attn_sinks=True, sliding_window=window, layer_types=sliding_layers(hf, window),
                      num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                      moe_ff=hf["intermediate_size"], expert_router="topk_softmax", expert_bias=True,
                      swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                      swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def deepseek_v3_config(hf: dict) -> ModelConfig:
    """DeepSeek-V3: multi-head latent attention, the first `first_k_dense_replace` layers dense, then experts routed
    by sigmoid scores within the best groups, with shared experts beside them; YaRN's temperature also scales the
    attention scores (by its mscale_all_dim, squared)."""
    silu_only(hf)
    rope = rope_settings(hf)
    qk_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    temperature = 1.0
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
        temperature = yarn_magnitude(rope["factor"], rope["mscale_all_dim"])
    dense = hf.get("first_k_dense_replace") or 0
    return llama_like(hf, head_dim=hf["qk_rope_head_dim"], qkv_bias=hf.get("attention_bias", False),
                      attn_out_bias=hf.get("attention_bias", False), kv_lora_rank=hf["kv_lora_rank"],
                      q_lora_rank=hf.get("q_lora_rank"), qk_nope_dim=hf["qk_nope_head_dim"],
                      v_head_dim=hf["v_head_dim"], rope_interleaved=bool(hf.get("rope_interleave", True)),
                      query_pre_attn_scalar=qk_dim / temperature ** 4, num_experts=hf["n_routed_experts"],
                      experts_per_token=hf["num_experts_per_tok"], moe_ff=hf["moe_intermediate_size"],
                      norm_topk_prob=bool(hf.get("norm_topk_prob", True)), expert_router="sigmoid_groups",
                      expert_groups=(hf.get("n_group") or 1, hf.get("topk_group") or 1),
                      routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
                      shared_ff=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
                      dense_layers=tuple(range(min(dense, hf["num_hidden_layers"]))))


def mistral_config(hf: dict) -> ModelConfig:
    """Mistral: Llama with a sliding window on every layer."""
    silu_only(hf)
    return llama_like(hf, sliding_window=hf.get("sliding_window"))


def phi3_config(hf: dict) -> ModelConfig:
    """Phi-3: fused projections (a weight-layout matter), partial RoPE, long-RoPE scaling, a window."""
    silu_only(hf)
    refuse(hf, hf.get("attention_bias", False), "attention_bias=True")
    rope = rope_settings(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rotary_dim = int(head_dim * rotary_fraction(hf))
    switches = dict(rope_theta=float(rope["rope_theta"]), sliding_window=hf.get("sliding_window"),
                    rotary_dim=rotary_dim if rotary_dim != head_dim else None)
    if rope["rope_type"] == "longrope":
        original = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        factor = rope.get("factor") or hf["max_position_embeddings"] / original
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:  # the LongRoPE paper's choice, as transformers computes it
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        switches.update(rope_short_factor=tuple(rope["short_factor"]), rope_long_factor=tuple(rope["long_factor"]),
                        rope_original_max=int(original), rope_attention_factor=float(attention_factor))
    elif rope["rope_type"] != "default":
        raise UnsupportedModel(f"unsupported RoPE scaling {rope['rope_type']!r} in a phi3 config: "
                               f"minillm implements plain RoPE and long-RoPE")
    return llama_like(hf, **switches)


def gemma_config(hf: dict) -> ModelConfig:
    """Gemma 2 and 3: x̂·(1 + w) norms, four per block, a scaled embedding, GeGLU, its own attention
    scale, interleaved sliding and global layers (Gemma 3: each with its own RoPE base, and QK-norm)."""
    kind = hf["model_type"]
    refuse(hf, hf.get("hidden_activation", hf.get("hidden_act")) not in ("gelu_pytorch_tanh", None),
           f"hidden_activation={hf.get('hidden_activation')!r} (Gemma's MLP uses gelu_pytorch_tanh)")
    refuse(hf, hf.get("attn_logit_softcapping") is not None,
           "attn_logit_softcapping is set: soft-capping attention scores needs an attention backend that "
           "sees the scores, which minillm's backends do not expose")
    refuse(hf, hf.get("use_bidirectional_attention", False), "use_bidirectional_attention=True")
    refuse(hf, hf.get("attention_bias", False), "attention_bias=True")
    window = hf.get("sliding_window")
    gemma3 = kind == "gemma3_text"
    local_theta = plain_rope_theta(hf, "sliding_attention") if gemma3 else None
    return llama_like(
        hf, norm="gemma_rmsnorm", mlp="geglu", post_norms=True, qk_norm=gemma3, embed_scale=True,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar"), sliding_window=window,
        layer_types=sliding_layers(hf, window), rope_theta=plain_rope_theta(hf, "full_attention"),
        rope_local_theta=local_theta, final_logit_softcap=hf.get("final_logit_softcapping"),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def gpt2_config(hf: dict) -> ModelConfig:
    refuse(hf, hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"),
           f"activation_function={hf.get('activation_function')!r} (only gelu_new)")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["n_positions"], n_layer=hf["n_layer"], n_head=hf["n_head"],
        d_model=hf["n_embd"], d_ff=hf.get("n_inner"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def gptj_config(hf: dict) -> ModelConfig:
    """GPT-J: attention and MLP side by side from one norm, partial interleaved RoPE, a bias on the LM head."""
    refuse(hf, hf.get("activation_function", "gelu_new") != "gelu_new", "activation_function is not gelu_new")
    head_dim = hf["n_embd"] // hf["n_head"]
    rotary_dim = hf.get("rotary_dim")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["n_positions"], n_layer=hf["n_layer"], n_head=hf["n_head"],
        d_model=hf["n_embd"], d_ff=hf.get("n_inner"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        positions="rope", rotary_dim=rotary_dim if rotary_dim not in (None, head_dim) else None, block="parallel",
        qkv_bias=False, attn_out_bias=False, lm_head_bias=True, tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def opt_config(hf: dict) -> ModelConfig:
    """OPT: learned positions (offset by 2 in the checkpoint), ReLU, pre- or post-LayerNorm, project in/out."""
    refuse(hf, hf.get("activation_function", "relu") != "relu", "activation_function is not relu")
    refuse(hf, not hf.get("layer_norm_elementwise_affine", True), "layer_norm_elementwise_affine=False")
    pre = hf.get("do_layer_norm_before", True)
    d_embed = hf.get("word_embed_proj_dim") or hf["hidden_size"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], d_model=hf["hidden_size"], d_ff=hf["ffn_dim"], mlp="relu",
        block="pre" if pre else "post", bias=hf.get("enable_bias", True), qkv_bias=hf.get("enable_bias", True),
        d_embed=d_embed if d_embed != hf["hidden_size"] else None,
        final_norm=pre and not hf.get("_remove_final_layer_norm", False),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


# ------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class Family:
    """How one architecture maps onto `ModelConfig` and our parameter names."""

    model_type: str  # transformers' `model_type`
    architecture: str  # its class in transformers
    config: Callable[[dict], ModelConfig]
    fill_state: Callable[[StateBuilder, ModelConfig], None]

    def state(self, hf_weights: dict[str, torch.Tensor], config: ModelConfig):
        """(our state dict, our name -> the checkpoint's name) from a transformers state dict."""
        builder = StateBuilder(hf_weights)
        self.fill_state(builder, config)
        return builder.finish(config)


FAMILIES = {f.model_type: f for f in (
    Family("gpt2", "GPT2LMHeadModel", gpt2_config, gpt2_state),
    Family("llama", "LlamaForCausalLM", llama_config, llama_like_state),
    Family("qwen2", "Qwen2ForCausalLM", qwen_config, llama_like_state),
    Family("qwen3", "Qwen3ForCausalLM", qwen_config, llama_like_state),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_config, llama_like_state),
    Family("gpt_oss", "GptOssForCausalLM", gpt_oss_config, gpt_oss_state),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", deepseek_v3_config, deepseek_v3_state),
    Family("mistral", "MistralForCausalLM", mistral_config, llama_like_state),
    Family("phi3", "Phi3ForCausalLM", phi3_config, llama_like_state),
    Family("gemma2", "Gemma2ForCausalLM", gemma_config, llama_like_state),
    Family("gemma3_text", "Gemma3ForCausalLM", gemma_config, llama_like_state),
    Family("opt", "OPTForCausalLM", opt_config, opt_state),
    Family("gptj", "GPTJForCausalLM", gptj_config, gptj_state),
)}


def family_for(hf: dict) -> Family:
    """The family of a transformers config.json, or UnsupportedModel naming the supported ones."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedModel(f"unsupported architecture {kind!r} (architectures={hf.get('architectures')}); "
                               f"minillm supports {', '.join(FAMILIES)}")
    return FAMILIES[kind]


__all__ = ["FAMILIES", "Family", "UnsupportedModel", "family_for"]
