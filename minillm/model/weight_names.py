"""Each family's tensors under our parameter names: a transformers state dict renamed, fused and reordered.

Checkpoints name their tensors their own way (`model.layers.0.self_attn.q_proj.weight`)
and some lay them out differently (GPT-2's Conv1D stores [in, out]; GPT-J rotates
neighbouring dims; OPT's position table starts at row 2). One `*_state` function
per layout fills a `StateBuilder`; `minillm.model.families` says which family uses which.
Our q/k/v and gate/up are fused matrices, so separate checkpoint tensors are stacked
here once, at load time, and the forward does one matmul where the checkpoint has several.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import torch

from .config import ModelConfig
from .mxfp4 import mxfp4_to_float


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

    `minillm.model.rope.RopeTable` rotates dims i and i + head_dim/2 together and leaves the
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


def llama_like_state(b: StateBuilder, config: ModelConfig, attention=None, experts=None) -> None:
    """Llama, Qwen2/3, Mistral, Gemma 2/3 (separate q/k/v and gate/up), Phi-3 (fused) and the families built on the
    same block: `attention` and `experts` say how a family stores its attention and its experts (by default
    grouped-query attention, `grouped_attention_state`, and Qwen3-MoE's experts, `experts_state`)."""
    b.put("tok_emb.weight", "embed_tokens.weight")
    fused = "layers.0.self_attn.qkv_proj.weight" in b.w
    gemma = config.post_norms
    for i in range(config.n_layer):
        p, q = f"layers.{i}.", f"blocks.{i}."
        (attention or grouped_attention_state)(b, config, p + "self_attn.", q + "attn.", fused)
        if config.is_moe(i):
            (experts or experts_state)(b, config, p + "mlp.", q + "mlp.")
        elif fused:
            b.put(q + "mlp.fc.weight", p + "mlp.gate_up_proj.weight")
        else:
            b.put(q + "mlp.fc.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        if not config.is_moe(i):
            b.put(q + "mlp.proj.weight", p + "mlp.down_proj.weight")
        b.put(q + "norm1.weight", p + "input_layernorm.weight")
        if gemma:
            b.put(q + "post_attn_norm.weight", p + "post_attention_layernorm.weight")
            b.put(q + "norm2.weight", p + "pre_feedforward_layernorm.weight")
            b.put(q + "post_mlp_norm.weight", p + "post_feedforward_layernorm.weight")
        else:
            b.put(q + "norm2.weight", p + "post_attention_layernorm.weight")
    b.put("norm_f.weight", "norm.weight")


def grouped_attention_state(b: StateBuilder, config: ModelConfig, att: str, q: str, fused: bool) -> None:
    """One layer's grouped-query attention: q/k/v stacked (or Phi-3's fused, RoPE rows reordered), the output
    projection, gpt-oss's sinks, QK-norm's weights."""
    if fused:
        b.put_linear(q + "qkv", [att + "qkv_proj"], config.qkv_bias, reorder_fused_qkv(config))
    else:
        b.put_linear(q + "qkv", [att + f"{x}_proj" for x in "qkv"], config.qkv_bias)
    b.put_linear(q + "proj", [att + "o_proj"], config.bias if config.attn_out_bias is None else config.attn_out_bias)
    if config.attn_sinks:
        b.put(q + "sinks", att + "sinks")
    if config.qk_norm:
        b.put(q + "q_norm.weight", att + "q_norm.weight")
        b.put(q + "k_norm.weight", att + "k_norm.weight")


def experts_state(b: StateBuilder, config: ModelConfig, p: str, q: str) -> None:
    """A mixture of experts' router and experts: stored for all experts at once (transformers 5: `experts.gate_up_proj`
    [E, 2ff, d], `experts.down_proj` [E, d, ff]) or one expert at a time (the hub's files: `experts.{e}.gate_proj`,
    `up_proj`, `down_proj`), stacked here into the first layout."""
    b.put(q + "router.weight", p + "gate.weight")
    if p + "experts.gate_up_proj" in b.w:
        b.put(q + "gate_up", p + "experts.gate_up_proj")
        b.put(q + "down", p + "experts.down_proj")
        return
    experts = range(config.num_experts)
    b.state[q + "gate_up"] = torch.stack([torch.cat((b.w[f"{p}experts.{e}.gate_proj.weight"],
                                                     b.w[f"{p}experts.{e}.up_proj.weight"])) for e in experts])
    b.state[q + "down"] = torch.stack([b.w[f"{p}experts.{e}.down_proj.weight"] for e in experts])
    b.origin[q + "gate_up"] = f"{p}experts.{{0..{len(experts) - 1}}}.{{gate,up}}_proj.weight"
    b.origin[q + "down"] = f"{p}experts.{{0..{len(experts) - 1}}}.down_proj.weight"


def gpt_oss_experts_state(b: StateBuilder, config: ModelConfig, p: str, q: str) -> None:
    """gpt-oss's router and experts: biased, with each gate column followed by its up column; turned into
    `experts_state`'s layout, gates then ups. transformers' float layout is input-major (`gate_up_proj` [E, d, 2ff],
    `down_proj` [E, ff, d]); a released checkpoint's MXFP4 blocks are output-major (`minillm.model.mxfp4`)."""
    def gates_then_ups(t: torch.Tensor) -> torch.Tensor:  # [E, 2ff, ...]: rows 0, 2, 4, ... then 1, 3, 5, ...
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)

    def output_major(name: str) -> tuple[torch.Tensor, str]:  # [E, rows, K], as nn.Linear holds a matrix; its origin
        if p + name + "_blocks" in b.w:
            return mxfp4_to_float(b.w[p + name + "_blocks"], b.w[p + name + "_scales"]), p + name + "_{blocks,scales}"
        return b.w[p + name].transpose(1, 2), p + name

    b.put_linear(q + "router", [p + "router"], bias=True)
    gate_up, b.origin[q + "gate_up"] = output_major("experts.gate_up_proj")
    b.state[q + "gate_up"] = gates_then_ups(gate_up)
    b.state[q + "down"], b.origin[q + "down"] = output_major("experts.down_proj")
    b.put(q + "gate_up_bias", p + "experts.gate_up_proj_bias", change=gates_then_ups)
    b.put(q + "down_bias", p + "experts.down_proj_bias")


def gpt_oss_state(b: StateBuilder, config: ModelConfig) -> None:
    llama_like_state(b, config, experts=gpt_oss_experts_state)


def latent_attention_state(b: StateBuilder, config: ModelConfig, att: str, q: str, fused: bool) -> None:
    """One layer's latent attention (DeepSeek-V3, `minillm.model.latent_attention`). Its RoPE pairs neighbouring
    dims (`rope_interleaved`): their rows are reordered here so the rotate-half RoPE the course uses turns the same
    pairs (`rotary_order`)."""
    rope, nope, latent = config.head_size, config.qk_nope_dim, config.kv_lora_rank
    order = rotary_order(rope, rope, interleaved=True) if config.rope_interleaved else None

    def rope_rows_last(width: int):  # a change reordering the last `rope` rows of each `width`-row head
        if order is None:
            return None
        keep = torch.cat((torch.arange(width - rope), width - rope + order))
        return lambda t: t.reshape(-1, width, *t.shape[1:])[:, keep].reshape(t.shape)

    if config.q_lora_rank:
        b.put_linear(q + "q_down", [att + "q_a_proj"], config.qkv_bias)
        b.put(q + "q_norm.weight", att + "q_a_layernorm.weight")
    b.put(q + "q_up.weight", att + ("q_b_proj.weight" if config.q_lora_rank else "q_proj.weight"),
          change=rope_rows_last(nope + rope))
    b.put_linear(q + "kv_down", [att + "kv_a_proj_with_mqa"], config.qkv_bias, rope_rows_last(latent + rope))
    b.put(q + "kv_norm.weight", att + "kv_a_layernorm.weight")
    b.put(q + "kv_up.weight", att + "kv_b_proj.weight")
    b.put_linear(q + "proj", [att + "o_proj"], config.qkv_bias)


def deepseek_experts_state(b: StateBuilder, config: ModelConfig, p: str, q: str) -> None:
    """DeepSeek-V3's experts: stored as Qwen3-MoE's, with the router's choice-only bias and the shared experts."""
    experts_state(b, config, p, q)
    b.put(q + "score_bias", p + "gate.e_score_correction_bias")
    b.put(q + "shared_fc.weight", *[p + f"shared_experts.{x}_proj.weight" for x in ("gate", "up")])
    b.put(q + "shared_proj.weight", p + "shared_experts.down_proj.weight")


def deepseek_v3_state(b: StateBuilder, config: ModelConfig) -> None:
    """DeepSeek-V3: Llama's block with latent attention, a dense MLP in the first layers and experts after."""
    llama_like_state(b, config, attention=latent_attention_state, experts=deepseek_experts_state)


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


__all__ = ["StateBuilder", "deepseek_v3_state", "gpt2_state", "gpt_oss_state", "gptj_state", "llama_like_state",
           "opt_state", "rotary_order"]
