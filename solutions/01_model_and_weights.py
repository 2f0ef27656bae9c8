"""Worked answers for lesson 01 (checked by `pytest lessons/01-model-and-weights --solutions`)."""

from __future__ import annotations

import math

import numpy as np
import torch

from minillm.model.config import ModelConfig


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis; var is the biased (1/d) variance."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, the tanh approximation: `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gpt2_logits(state: dict[str, torch.Tensor], config: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Exercise 1: GPT-2 forward by hand"""
    B, T = tokens.shape
    H, hd, d = config.n_head, config.head_size, config.d_model
    # GPT-2 adds a learned vector per position to the token's embedding; no rotation anywhere.
    x = state["tok_emb.weight"][tokens] + state["pos_emb.weight"][torch.arange(T)]  # [B, T, d]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(config.n_layer):
        p = lambda name: state[f"blocks.{i}.{name}"]  # noqa: E731  (this layer's tensors)
        h = layer_norm(x, p("norm1.weight"), p("norm1.bias"), config.norm_eps)
        qkv = h @ p("attn.qkv.weight").T + p("attn.qkv.bias")  # [B, T, 3d]: q, k, v fused, in that order
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in qkv.split(d, dim=-1))  # [B, H, T, hd] each
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # [B, H, T, T]
        weights = scores.masked_fill(~causal, -math.inf).softmax(-1)  # row t: keys 0..t only
        y = (weights @ v).transpose(1, 2).reshape(B, T, d)  # heads side by side again
        x = x + y @ p("attn.proj.weight").T + p("attn.proj.bias")  # residual 1
        h = layer_norm(x, p("norm2.weight"), p("norm2.bias"), config.norm_eps)
        h = gelu_tanh(h @ p("mlp.fc.weight").T + p("mlp.fc.bias"))  # [B, T, 4d]
        x = x + h @ p("mlp.proj.weight").T + p("mlp.proj.bias")  # residual 2
    x = layer_norm(x, state["norm_f.weight"], state["norm_f.bias"], config.norm_eps)
    return x @ state["lm_head.weight"].T  # [B, T, V]; tied: lm_head.weight is tok_emb.weight


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Exercise 2: Parameters from the config"""
    d, H, KV, hd, ff = config.d_model, config.n_head, config.kv_heads, config.head_size, config.ff_size
    # Embeddings: one row per token; GPT-2 adds one row per position; an untied LM head is another V x d.
    embeddings = config.vocab_size * d
    if config.positions == "learned":
        embeddings += config.context_length * d
    if not config.tie_embeddings:
        embeddings += config.vocab_size * d
    # Attention: the fused q/k/v projection has H query heads and KV key/value heads of hd each;
    # GQA shrinks only the k and v parts. The output projection maps H * hd back to d.
    qkv_out = (H + 2 * KV) * hd
    attention = d * qkv_out + H * hd * d
    if config.qkv_bias:
        attention += qkv_out
    if config.bias:
        attention += d
    # MLP: GELU has fc (d -> ff) and proj (ff -> d); SwiGLU has a gate and an up projection (fc fuses them).
    fc_out = 2 * ff if config.mlp == "swiglu" else ff
    mlp = d * fc_out + ff * d
    if config.bias:
        mlp += fc_out + d
    # Norms: a scale per channel (LayerNorm with bias also a shift); two per block plus the final one.
    per_norm = 2 * d if (config.norm == "layernorm" and config.bias) else d
    norms = (2 * config.n_layer + 1) * per_norm
    counts = {"embeddings": embeddings, "attention": config.n_layer * attention, "mlp": config.n_layer * mlp,
              "norms": norms}
    return counts | {"total": sum(counts.values())}


def dequantize_q5_1(raw: np.ndarray) -> np.ndarray:
    """Exercise 3: Dequantize a Q5_1 tensor"""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 24)  # one row per 24-byte block
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1] scale
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1] minimum
    qh = blocks[:, 4:8].copy().view("<u4")  # [n, 1]: bit i is weight i's fifth bit (little-endian, whatever the CPU)
    fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32], 0 or 1
    packed = blocks[:, 8:]  # [n, 16]: byte j holds weight j's low 4 bits (low nibble) and weight j + 16's (high)
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=1)  # [n, 32], 0..15
    q = (low | (fifth << 4)).astype(np.float32)  # [n, 32], 0..31
    weights = d * q + m
    return weights.reshape(*raw.shape[:-1], raw.shape[-1] // 24 * 32)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Exercise 4: Undo llama.cpp's RoPE permutation"""
    # Within each head, llama.cpp's converter wrote the rows as (0, d/2, 1, d/2 + 1, ...): the rows that
    # Hugging Face's rotate-half pairs (i, i + d/2) become neighbours (2i, 2i + 1), as llama.cpp's
    # adjacent-pair RoPE wants. Reading the interleaved rows as [head, i, pair member] and swapping the
    # last two axes lists every first member, then every second member: the halves again.
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
