"""One decoder-only transformer that covers GPT-2, the Llama family and the other families.

GPT-2 comes first: learned positions, LayerNorm, GELU MLP, biases everywhere.
A handful of `ModelConfig` switches turn the same class into Llama/SmolLM2/Qwen2:
RMSNorm, rotary positions (RoPE), a SwiGLU MLP, grouped-query attention and an
optional bias on the q/k/v projection. A few more make Gemma 2/3, Qwen3, Mistral,
Phi-3, OPT and GPT-J (lesson 17; `minillm.model.families` maps a checkpoint onto them):
Gemma's x̂·(1 + w) norms, four per block, its scaled embedding and attention scalar;
QK-norm; sliding-window layers with their own RoPE base; partial and long-context
RoPE; post-norm and parallel blocks; logit soft-capping. Architecture differences
are config fields, not subclasses.

The one forward every lesson uses:

    logits = model(tokens, positions, cache=None, mask=None)
    # tokens, positions: LongTensor [B, T]  ->  logits: float32 [B, T, vocab]

The caller owns positions and the mask (so batches of rows with different
lengths, speculative and tree verification and sliding windows all use the same
call; `minillm.runtime.runner` is the caller every strategy shares); the cache owns the
keys and values stored so far (`minillm.cache.kv_cache`); the attention kernel is a
swappable backend (`minillm.model.attention`, SDPA by default).

The norms and the rotary position tables it is built from live beside it
(`minillm.model.norms`, `minillm.model.rope`).

Everything here is plain PyTorch: `nn.Linear`, `nn.Embedding`, SDPA. Hardware
fast paths are module swaps applied after loading (`minillm.speed.onednn`), each with an
off switch and each checked equal to this plain model.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionStep, SDPABackend, causal_mask_lower_right, within_window
from .config import ModelConfig
from .experts import MoE
from .latent_attention import LatentAttention
from .norms import make_norm
from .rope import RopeTable, apply_rope


class SlidingWindow:
    """The attention step of a sliding-window layer: the step's own mask, and keys near the query only.

    In the session's layout row b's token at position p sits at cache column p, so
    query (b, t) may see column j only if positions[b, t] - j < window. A windowed
    layer hands its backend an ordinary mask, so every backend works unchanged. The
    windowed step is built once per forward (`AttentionStep.once`) and shared by all
    sliding layers. Among the nodes of a token tree (lesson 11) columns run ahead of
    positions; the window only has to be longer than the tree is deep.
    """

    def __init__(self, window: int):
        self.window = window

    def __call__(self, step: AttentionStep, num_keys: int) -> AttentionStep:
        if step.packed is not None:  # the engine's step: its masks narrowed (`PackedSequences.windowed`)
            return step.once(("sliding window", self.window),
                             lambda: AttentionStep(step.positions, None, step.packed.windowed(self.window)))
        if num_keys <= self.window:  # a query's position is below num_keys: every key is near enough
            return step
        return step.once(("sliding window", self.window, num_keys), lambda: self._windowed(step, num_keys))

    def _windowed(self, step: AttentionStep, num_keys: int) -> AttentionStep:
        positions = step.positions  # [B, T]
        near = within_window(positions, num_keys, self.window)  # [B, T, S]
        mask = step.mask if step.mask is not None else causal_mask_lower_right(positions.shape[1], num_keys,
                                                                               positions.device)
        return AttentionStep(positions, mask & near)


class Attention(nn.Module):
    """Grouped-query self-attention; q, k and v come from one fused matmul.

    The score/softmax/value product itself is delegated to `self.backend`
    (`minillm.model.attention`): SDPA by default, swappable without touching this class.
    A backend scales scores by 1/sqrt(head_dim); a model with another scale
    (Gemma's query_pre_attn_scalar) pre-scales q to get it.
    """

    def __init__(self, config: ModelConfig, window: SlidingWindow | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_size
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.qkv = nn.Linear(config.d_model, qkv_out, bias=config.qkv_bias)
        out_bias = config.bias if config.attn_out_bias is None else config.attn_out_bias
        self.proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=out_bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        scalar = config.query_pre_attn_scalar
        self.q_scale = math.sqrt(self.head_dim / scalar) if scalar not in (None, self.head_dim) else None
        self.window = window
        self.sinks = nn.Parameter(torch.empty(self.n_head)) if config.attn_sinks else None
        self.backend = SDPABackend()

    def forward(self, x, rope, layer, cache, step: AttentionStep):
        B, T, _ = x.shape
        H, KV, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x).view(B, T, H + 2 * KV, hd)
        qk = qkv[:, :, : H + KV]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])), dim=2)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # rotate q and k heads together: one op instead of two
        q, k = qk[:, :, :H], qk[:, :, H:]
        if self.q_scale is not None:
            q = q * self.q_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, H + KV :].transpose(1, 2)  # [B, heads, T, hd]
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, KV, S, hd]: everything stored so far
        if self.window is not None:
            step = self.window(step, k.shape[2])
        if self.sinks is not None:
            if not getattr(self.backend, "handles_sinks", False):
                raise ValueError(f"attention sinks (gpt-oss) join the softmax, which the {self.backend.name!r} "
                                 f"attention backend does not expose: run this model with the default backend")
            step = replace(step, sinks=self.sinks)
        y = self.backend(q, k, v, step)  # [B, H, T, hd]
        return self.proj(y.transpose(1, 2).reshape(B, T, H * hd))  # [B, T, d_model]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu": gelu_tanh, "relu": F.relu, "swiglu": F.silu, "geglu": gelu_tanh}


class MLP(nn.Module):
    """GPT-2: proj(gelu(fc(x))). Llama: proj(silu(gate(x)) * up(x)), gate and up fused in one matmul.

    Gemma's GeGLU is Llama's gated form with GELU for SiLU; OPT uses plain ReLU.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gated = config.mlp in ("swiglu", "geglu")
        self.activation = ACTIVATIONS[config.mlp]
        hidden = config.ff_size
        self.fc = nn.Linear(config.d_model, 2 * hidden if self.gated else hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x):
        h = self.fc(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        return self.proj(h)


class Block(nn.Module):
    """A residual block; `config.block` places the norms.

    pre (GPT-2, Llama, Gemma):  x + attn(norm1(x)), then x + mlp(norm2(x));
                                Gemma also normalises each output (post_norms: four norms);
    post (OPT-350m):            norm1(x + attn(x)), then norm2(x + mlp(x));
    parallel (GPT-J):           x + attn(norm1(x)) + mlp(norm1(x)): one norm, both branches read it.
    """

    def __init__(self, config: ModelConfig, window: SlidingWindow | None = None, moe: bool = False):
        super().__init__()
        self.kind = config.block
        self.norm1 = make_norm(config)
        self.attn = LatentAttention(config) if config.kv_lora_rank else Attention(config, window)
        self.norm2 = make_norm(config) if config.block != "parallel" else None
        self.mlp = MoE(config) if moe else MLP(config)
        self.post_attn_norm = make_norm(config) if config.post_norms else None
        self.post_mlp_norm = make_norm(config) if config.post_norms else None
        self.local_rope = window is not None and config.rope_local_theta is not None

    def forward(self, x, rope, layer, cache, step):
        if self.kind == "pre":
            h = self.attn(self.norm1(x), rope, layer, cache, step)
            if self.post_attn_norm is not None:
                h = self.post_attn_norm(h)
            x = x + h
            h = self.mlp(self.norm2(x))
            if self.post_mlp_norm is not None:
                h = self.post_mlp_norm(h)
            return x + h
        if self.kind == "parallel":
            h = self.norm1(x)
            return self.attn(h, rope, layer, cache, step) + self.mlp(h) + x
        x = self.norm1(x + self.attn(x, rope, layer, cache, step))
        return self.norm2(x + self.mlp(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d, d_embed = config.d_model, config.embed_size
        self.tok_emb = nn.Embedding(config.vocab_size, d_embed)
        self.proj_in = nn.Linear(d_embed, d, bias=False) if d_embed != d else None
        self.pos_emb = nn.Embedding(config.context_length, d) if config.positions == "learned" else None
        window = SlidingWindow(config.sliding_window) if config.sliding_window is not None else None
        self.blocks = nn.ModuleList(Block(config, window if config.is_sliding(i) else None, config.is_moe(i))
                                    for i in range(config.n_layer))
        self.norm_f = make_norm(config) if config.final_norm else None
        self.proj_out = nn.Linear(d, d_embed, bias=False) if d_embed != d else None
        rope = config.positions == "rope"
        self.rope = RopeTable(config) if rope else None
        self.rope_local = RopeTable(config, config.rope_local_theta) if rope and config.rope_local_theta else None
        self.lm_head = nn.Linear(d_embed, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def forward(self, tokens, positions, cache=None, mask=None, last_only: bool = False, logits_at=None,
                packed=None):
        """tokens, positions [B, T]; mask: bool [B, T, S] (True = may attend) or None for causal.

        `packed` (a `minillm.cache.paged.PackedSequences`) says that the one row holds several
        sequences back to back, whose keys live in a paged cache: continuous batching's step.

        The LM head is a 49152-wide matmul per position, so prefill asks for fewer rows:
        `last_only` computes logits at the final position alone ([B, 1, V]), and
        `logits_at` (long [B]) at one chosen position per row ([B, 1, V]; rows of
        different lengths padded on the right), or (long [B, K]) at K positions per row
        ([B, K, V]; a packed row's sequence ends). Logits are float32 whatever the model's dtype.
        """
        x = self.tok_emb(tokens)  # [B, T, d_model]
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype)  # the scale itself rounded, as Gemma does
        if self.proj_in is not None:
            x = self.proj_in(x)
        rope = local_rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        else:
            rope = self.rope(positions, x.dtype)
            local_rope = self.rope_local(positions, x.dtype) if self.rope_local is not None else rope
        step = AttentionStep(positions, mask, packed)
        for layer, block in enumerate(self.blocks):
            x = block(x, local_rope if block.local_rope else rope, layer, cache, step)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            rows = torch.arange(len(x), device=x.device)
            x = x[rows, logits_at][:, None] if logits_at.dim() == 1 else x[rows[:, None], logits_at]  # [B, K, d_model]
        if self.norm_f is not None:
            x = self.norm_f(x)
        if self.proj_out is not None:
            x = self.proj_out(x)
        logits = self.lm_head(x).float()  # [B, T, vocab]
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def num_weight_bytes(self) -> int:
        """Bytes of parameters read per decoded token (each shared matrix counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def causal_positions(batch: int, length: int, device=None) -> torch.Tensor:
    """positions [batch, length] = 0..length-1 on every row: the unpadded, uncached case."""
    return torch.arange(length, device=device).expand(batch, length)


def init_weights(model: Transformer, std: float = 0.02, seed: int | None = None) -> Transformer:
    """GPT-2-style random initialisation (tiny test models)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.zero_()
    return model


__all__ = ["Transformer", "causal_positions", "init_weights"]
