"""Model families: a checkpoint's architecture -> a `ModelConfig` and our parameter names.

One `Transformer` class runs every family; what differs is a handful of config
switches (lesson 17). Each family here says how to read them off a transformers
`config.json` and how to rename (and fuse, or reorder) its tensors:

    family = family_for(hf_config)            # refuses an unknown architecture in one line
    config = family.config(hf_config)         # -> ModelConfig
    state, origin = family.state(weights, config)   # our names -> tensors; our names -> theirs (for errors)

GGUF files name architectures and tensors their own way (llama.cpp's); `GGUF_FAMILIES`
maps those onto the Hugging Face names, so a GGUF is converted once into an ordinary
checkpoint folder and loaded like any other (`minillm.model.loading`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch

from .config import ModelConfig
from .fetch import ModelLoadError


class UnsupportedModel(ModelLoadError):
    """A checkpoint whose architecture, or one of whose settings, minillm does not implement."""


# ------------------------------------------------------------------ reading a config.json


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


def plain_rope_theta(hf: dict, layer_type: str | None = None) -> float:
    """The RoPE base of a model that uses plain RoPE (refusing scaled variants)."""
    rope = rope_settings(hf, layer_type)
    if rope["rope_type"] != "default":
        raise UnsupportedModel(f"unsupported RoPE scaling {rope['rope_type']!r} in a {hf['model_type']} config: "
                               f"minillm implements plain RoPE here (and long-RoPE for phi3)")
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
    settings.update(switches)
    if "rope_theta" not in switches:
        settings["rope_theta"] = plain_rope_theta(hf)
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


# ------------------------------------------------------------------ renaming the tensors


class StateBuilder:
    """Our state dict, filled from a transformers one, remembering where each tensor came from.

    `origin` maps our names to the checkpoint's, so an error about a tensor of the wrong
    shape can name the one in the file.
    """

    def __init__(self, hf_weights: dict[str, torch.Tensor]):
        self.weights = hf_weights
        self.w = {re.sub(r"^(transformer|model)\.(decoder\.)?", "", k): v for k, v in hf_weights.items()}
        self.state: dict[str, torch.Tensor] = {}
        self.origin: dict[str, str] = {}

    def put(self, ours: str, *theirs: str, change: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """state[ours] = the named tensors, stacked along rows when several (q/k/v, gate/up), then `change`d."""
        tensors = [self.weights[name] if name.startswith("lm_head.") else self.w[name] for name in theirs]
        tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        self.state[ours] = change(tensor) if change is not None else tensor
        self.origin[ours] = brace(theirs)

    def put_linear(self, ours: str, theirs: list[str], bias: bool, change=None) -> None:
        self.put(f"{ours}.weight", *[f"{t}.weight" for t in theirs], change=change)
        if bias:
            self.put(f"{ours}.bias", *[f"{t}.bias" for t in theirs], change=change)

    def put_norm(self, ours: str, theirs: str, bias: bool = False) -> None:
        self.put_linear(ours, [theirs], bias)

    def finish(self, config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Tied: the same tensor under both names, so strict loading sees every parameter."""
        if config.tie_embeddings:
            self.state["lm_head.weight"], self.origin["lm_head.weight"] = self.state["tok_emb.weight"], "(tied)"
        else:
            self.put_linear("lm_head", ["lm_head"], config.lm_head_bias)
        return self.state, self.origin


def brace(names) -> str:
    """["a.q_proj.w", "a.k_proj.w"] -> "a.{q,k}_proj.w": several stacked tensors named in one phrase."""
    if len(names) == 1:
        return names[0]
    prefix = os.path.commonprefix(list(names))
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    return f"{prefix}{{{','.join(n[len(prefix):len(n) - len(suffix)] for n in names)}}}{suffix}"


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """long [head_dim]: the order of one head's dims that puts rotating pairs at (i, i + head_dim/2).

    `minillm.model.transformer.RopeTable` rotates dims i and i + head_dim/2 together and leaves the
    dims it gives angle 0 alone. Checkpoints pair differently: transformers' rotate-half
    pairs (i, i + rotary_dim/2) within the first rotary_dim dims; GPT-J pairs neighbours
    (2i, 2i + 1). Reordering q's and k's rows alike leaves every score q·k unchanged.
    """
    half, still = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = torch.arange(0, rotary_dim, 2) if interleaved else torch.arange(half)
    second = first + 1 if interleaved else torch.arange(half, rotary_dim)
    passing = torch.arange(rotary_dim, head_dim)
    return torch.cat((first, passing[:still], second, passing[still:]))


def reorder_rotary(config: ModelConfig, interleaved: bool, heads: int | None = None):
    """A `change` for q/k rows ([heads * head_dim, ...]): each head's dims in `rotary_order`, or None if none is needed."""
    hd = config.head_size
    rd = config.rotary_dim or hd
    if rd == hd and not interleaved:
        return None
    order = rotary_order(hd, rd, interleaved)

    def change(t: torch.Tensor) -> torch.Tensor:
        n = heads or t.shape[0] // hd
        return t.reshape(n, hd, *t.shape[1:])[:, order].reshape(t.shape)

    return change


def reorder_fused_qkv(config: ModelConfig, interleaved: bool = False):
    """`reorder_rotary` for a fused qkv weight: the q and k heads are reordered, v's rows kept."""
    qk = reorder_rotary(config, interleaved)
    if qk is None:
        return None
    rows = (config.n_head + config.kv_heads) * config.head_size
    return lambda t: torch.cat((qk(t[:rows]), t[rows:]))


def llama_like_state(b: StateBuilder, config: ModelConfig) -> None:
    """Llama, Qwen2/3, Mistral, Gemma 2/3 (separate q/k/v and gate/up) and Phi-3 (fused)."""
    b.put("tok_emb.weight", "embed_tokens.weight")
    fused = "layers.0.self_attn.qkv_proj.weight" in b.w
    gemma = config.post_norms
    for i in range(config.n_layer):
        p, q = f"layers.{i}.", f"blocks.{i}."
        att = p + "self_attn."
        if fused:
            b.put_linear(q + "attn.qkv", [att + "qkv_proj"], config.qkv_bias, reorder_fused_qkv(config))
            b.put(q + "mlp.fc.weight", p + "mlp.gate_up_proj.weight")
        else:
            b.put_linear(q + "attn.qkv", [att + f"{x}_proj" for x in "qkv"], config.qkv_bias)
            b.put(q + "mlp.fc.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        b.put(q + "attn.proj.weight", att + "o_proj.weight")
        b.put(q + "mlp.proj.weight", p + "mlp.down_proj.weight")
        if config.qk_norm:
            b.put(q + "attn.q_norm.weight", att + "q_norm.weight")
            b.put(q + "attn.k_norm.weight", att + "k_norm.weight")
        b.put(q + "norm1.weight", p + "input_layernorm.weight")
        if gemma:
            b.put(q + "post_attn_norm.weight", p + "post_attention_layernorm.weight")
            b.put(q + "norm2.weight", p + "pre_feedforward_layernorm.weight")
            b.put(q + "post_mlp_norm.weight", p + "post_feedforward_layernorm.weight")
        else:
            b.put(q + "norm2.weight", p + "post_attention_layernorm.weight")
    b.put("norm_f.weight", "norm.weight")


def gpt2_state(b: StateBuilder, config: ModelConfig) -> None:
    t = lambda w: w.t()  # GPT-2's Conv1D stores [in, out]; nn.Linear wants [out, in]
    b.put("tok_emb.weight", "wte.weight")
    b.put("pos_emb.weight", "wpe.weight")
    for i in range(config.n_layer):
        p, q = f"h.{i}.", f"blocks.{i}."
        b.put_norm(q + "norm1", p + "ln_1", bias=True)
        b.put_norm(q + "norm2", p + "ln_2", bias=True)
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            b.put(q + ours + ".weight", p + theirs + ".weight", change=t)
            b.put(q + ours + ".bias", p + theirs + ".bias")
    b.put_norm("norm_f", "ln_f", bias=True)


def gptj_state(b: StateBuilder, config: ModelConfig) -> None:
    b.put("tok_emb.weight", "wte.weight")
    qk = reorder_rotary(config, interleaved=True, heads=config.n_head)
    for i in range(config.n_layer):
        p, q = f"h.{i}.", f"blocks.{i}."
        b.put_norm(q + "norm1", p + "ln_1", bias=True)
        qkv = [b.w[p + f"attn.{x}_proj.weight"] for x in "qkv"]
        b.state[q + "attn.qkv.weight"] = torch.cat((qk(qkv[0]), qk(qkv[1]), qkv[2]))
        b.origin[q + "attn.qkv.weight"] = brace([p + f"attn.{x}_proj.weight" for x in "qkv"])
        b.put(q + "attn.proj.weight", p + "attn.out_proj.weight")
        b.put_linear(q + "mlp.fc", [p + "mlp.fc_in"], bias=True)
        b.put_linear(q + "mlp.proj", [p + "mlp.fc_out"], bias=True)
    b.put_norm("norm_f", "ln_f", bias=True)


OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq legacy): row p + 2 is position p


def opt_state(b: StateBuilder, config: ModelConfig) -> None:
    b.put("tok_emb.weight", "embed_tokens.weight")
    b.put("pos_emb.weight", "embed_positions.weight", change=lambda t: t[OPT_POSITION_OFFSET:])
    if config.d_embed is not None:
        b.put("proj_in.weight", "project_in.weight")
        b.put("proj_out.weight", "project_out.weight")
    for i in range(config.n_layer):
        p, q = f"layers.{i}.", f"blocks.{i}."
        b.put_linear(q + "attn.qkv", [p + f"self_attn.{x}_proj" for x in "qkv"], config.qkv_bias)
        b.put_linear(q + "attn.proj", [p + "self_attn.out_proj"], config.bias)
        b.put_norm(q + "norm1", p + "self_attn_layer_norm", bias=True)
        b.put_norm(q + "norm2", p + "final_layer_norm", bias=True)
        b.put_linear(q + "mlp.fc", [p + "fc1"], config.bias)
        b.put_linear(q + "mlp.proj", [p + "fc2"], config.bias)
    if config.final_norm:
        b.put_norm("norm_f", "final_layer_norm", bias=True)


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


__all__ = ["FAMILIES", "Family", "UnsupportedModel", "family_for", "rotary_order"]
