"""One decoder-only transformer that covers GPT-2 and the Llama family.

GPT-2 comes first: learned positions, LayerNorm, GELU MLP, biases everywhere.
A handful of `ModelConfig` switches turn the same class into Llama/SmolLM2/Qwen2:
RMSNorm, rotary positions (RoPE), a SwiGLU MLP, grouped-query attention and an
optional bias on the q/k/v projection. Architecture differences are config fields,
not subclasses.

The one forward every lesson uses:

    logits = model(tokens, positions, cache=None, mask=None)
    # tokens, positions: LongTensor [B, T]  ->  logits: float32 [B, T, vocab]

The caller owns positions and the mask (so batches of rows with different
lengths, speculative and tree verification and sliding windows all use the same
call; `minillm.session` is the caller every strategy shares); the cache owns the
keys and values stored so far (`minillm.kv_cache`); the attention kernel is a
swappable backend (`minillm.attention`, SDPA by default).

Everything here is plain PyTorch: `nn.Linear`, `nn.Embedding`, SDPA. Hardware
fast paths are module swaps applied after loading (`minillm.onednn`), each with an
off switch and each checked equal to this plain model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionStep, SDPABackend


@dataclass(frozen=True)
class ModelConfig:
    """Everything that shapes the network. Defaults are GPT-2 small."""

    vocab_size: int = 50257
    block_size: int = 1024  # context length: the most positions the model was trained on
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # grouped-query attention; None means n_head (plain multi-head)
    d_model: int = 768
    d_ff: int | None = None  # MLP hidden size; None means 4 * d_model
    head_dim: int | None = None  # None means d_model // n_head
    norm: str = "layernorm"  # "layernorm" (GPT-2) or "rmsnorm" (Llama)
    norm_eps: float = 1e-5
    positions: str = "learned"  # "learned" (GPT-2) or "rope" (Llama)
    rope_theta: float = 10000.0
    mlp: str = "gelu"  # "gelu" (GPT-2, tanh approximation) or "swiglu" (Llama)
    bias: bool = True  # bias on the output/MLP projections and norms (GPT-2)
    qkv_bias: bool = True  # bias on the q/k/v projection (GPT-2, Qwen2)
    tie_embeddings: bool = True  # LM head shares the token embedding matrix

    def __post_init__(self):
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm={self.norm!r}: use 'layernorm' or 'rmsnorm'")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"positions={self.positions!r}: use 'learned' or 'rope'")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp={self.mlp!r}: use 'gelu' or 'swiglu'")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def ff_size(self) -> int:
        return self.d_ff or 4 * self.d_model

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like Llama (it matters in fp16/bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose statistics are taken in float32 whatever the weights' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float()
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for rotary embeddings at the given positions.

    positions [...] -> cos, sin [..., head_dim], in the "rotate half" layout that
    Hugging Face checkpoints use (the first half of each head pairs with the second
    half). Angles are computed in float32 (bf16 positions lose whole tokens) and
    cast at the end, as transformers does.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    angles = positions[..., None].float() * inv_freq  # [..., head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RopeTable:
    """cos and sin for positions 0..n-1, computed once per dtype and device.

    Decoding one token would otherwise recompute ~10 small tensors per step; a
    lookup is one gather. `sin` has the rotate-half sign folded in (its first half
    negated), so rotating needs no negation: x * cos + swap_halves(x) * sin.

    The table starts at `block_size` positions and grows on demand (doubling) when a
    larger position is asked for: RoPE itself has no last position, and keeping a
    cache while sliding past the context (lesson 06) numbers tokens beyond
    block_size. Each position's angles are computed independently, so growing
    changes no entry that was already there.
    """

    def __init__(self, config: ModelConfig):
        self.block_size, self.head_dim, self.theta = config.block_size, config.head_size, config.rope_theta
        self.tables: dict = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, T, 1, head_dim] (broadcast over heads)."""
        key = (dtype, positions.device)
        table = self.tables.get(key)
        size = len(table[0]) if table is not None else 0
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if table is None or needed > size:
            size = max(self.block_size, needed, 2 * size)
            cos, sin = rope_cos_sin(torch.arange(size, device=positions.device), self.head_dim, self.theta, dtype)
            half = self.head_dim // 2
            self.tables[key] = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        cos, sin = self.tables[key]
        return cos[positions][:, :, None], sin[positions][:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of x [..., head_dim] by its position's angle.

    Same numbers as transformers' x * cos + rotate_half(x) * sin: negating is exact,
    so folding the sign of rotate_half into `signed_sin` changes no bit.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    """Grouped-query self-attention; q, k and v come from one fused matmul.

    The score/softmax/value product itself is delegated to `self.backend`
    (`minillm.attention`): SDPA by default, swappable without touching this class.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_size
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.qkv = nn.Linear(config.d_model, qkv_out, bias=config.qkv_bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=config.bias)
        self.backend = SDPABackend()

    def forward(self, x, rope, layer, cache, step: AttentionStep):
        B, T, _ = x.shape
        H, KV, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x).view(B, T, H + 2 * KV, hd)
        if rope is not None:
            qk = apply_rope(qkv[:, :, : H + KV], *rope)  # rotate q and k heads together: one op instead of two
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            q, k = qkv[:, :, :H], qkv[:, :, H : H + KV]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, H + KV :].transpose(1, 2)  # [B, heads, T, hd]
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, KV, S, hd]: everything stored so far
        y = self.backend(q, k, v, step)  # [B, H, T, hd]
        return self.proj(y.transpose(1, 2).reshape(B, T, H * hd))  # [B, T, d_model]


class MLP(nn.Module):
    """GPT-2: proj(gelu(fc(x))). Llama: proj(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        hidden = config.ff_size
        self.fc = nn.Linear(config.d_model, 2 * hidden if self.swiglu else hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x):
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.proj(h)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1, self.attn = make_norm(config), Attention(config)
        self.norm2, self.mlp = make_norm(config), MLP(config)

    def forward(self, x, rope, layer, cache, step):
        x = x + self.attn(self.norm1(x), rope, layer, cache, step)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model) if config.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.rope = RopeTable(config) if config.positions == "rope" else None
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
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

        `packed` (a `minillm.paged.PackedSequences`) says that the one row holds several
        sequences back to back, whose keys live in a paged cache: continuous batching's step.

        The LM head is a 49152-wide matmul per position, so prefill asks for fewer rows:
        `last_only` computes logits at the final position alone ([B, 1, V]), and
        `logits_at` (long [B]) at one chosen position per row ([B, 1, V]; rows of
        different lengths padded on the right), or (long [B, K]) at K positions per row
        ([B, K, V]; a packed row's sequence ends). Logits are float32 whatever the model's dtype.
        """
        x = self.tok_emb(tokens)  # [B, T, d_model]
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        else:
            rope = self.rope(positions, x.dtype)
        step = AttentionStep(positions, mask, packed)
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, layer, cache, step)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            rows = torch.arange(len(x), device=x.device)
            x = x[rows, logits_at][:, None] if logits_at.dim() == 1 else x[rows[:, None], logits_at]  # [B, K, d_model]
        return self.lm_head(self.norm_f(x)).float()  # [B, T, vocab]

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


def describe(config: ModelConfig) -> str:
    """One line naming the architecture and its size."""
    n_params = (
        config.vocab_size * config.d_model
        + config.n_layer
        * (
            config.d_model * (config.n_head + 2 * config.kv_heads) * config.head_size
            + config.n_head * config.head_size * config.d_model
            + config.d_model * config.ff_size * (3 if config.mlp == "swiglu" else 2)
        )
    )
    return (
        f"{config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads "
        f"({config.kv_heads} KV), {config.positions} positions, {config.norm}, {config.mlp}, "
        f"~{n_params / 1e6:.0f}M parameters, context {config.block_size}"
    )


__all__ = ["ModelConfig", "Transformer", "causal_positions", "init_weights", "describe"]
