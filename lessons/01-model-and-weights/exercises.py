"""Lesson 01 exercises: write your answers here; `pytest lessons/01-model-and-weights` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/01_model_and_weights.py
(try first: `pytest lessons/01-model-and-weights --solutions` runs the checks on them).
"""

from __future__ import annotations

import math  # noqa: F401

import numpy as np  # noqa: F401
import torch  # noqa: F401

from minillm.model.config import ModelConfig


def gpt2_logits(state: dict[str, torch.Tensor], config: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Exercise 1: GPT-2 forward by hand

    The notebook builds a Llama block by hand; write the whole GPT-2 forward the same way, from the
    weight tensors alone (plain tensor ops: matmuls, softmax; no minillm or transformers modules).
    GPT-2 differs from Llama mainly in three places: a learned position embedding added to the token
    embedding (no RoPE), LayerNorm with a bias, (x - mean) / sqrt(var + eps) * weight + bias with
    the biased variance, and an MLP proj(gelu(fc(x))) with GELU's tanh approximation
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Every linear layer has a bias; heads are plain
    multi-head (n_kv_head = n_head); the causal mask and residuals are as in the notebook.

    state: minillm's parameter names (`Transformer.state_dict()`): tok_emb.weight [V, d],
      pos_emb.weight [context_length, d], blocks.{i}.norm1.weight/.bias, blocks.{i}.attn.qkv.weight
      [3d, d] (q, k, v rows in that order) and .bias, blocks.{i}.attn.proj.weight/.bias,
      blocks.{i}.norm2.weight/.bias, blocks.{i}.mlp.fc.weight/.bias, blocks.{i}.mlp.proj.weight/.bias,
      norm_f.weight/.bias, lm_head.weight [V, d]. A linear layer computes x @ weight.T + bias.
    config: the model's ModelConfig (n_layer, n_head, head_size, d_model, norm_eps).
    tokens: long [B, T], positions 0..T-1 on every row.
    Returns float32 logits [B, T, V], equal to transformers' GPT2LMHeadModel within 2e-5.
    """
    raise NotImplementedError


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Exercise 2: Parameters from the config

    Count a `Transformer(config)`'s parameters by formula, from the config's fields alone (do not
    build the model). Mind grouped-query attention (kv_heads), the fused projections (qkv; the
    SwiGLU MLP's fc holds gate and up), `bias` and `qkv_bias`, LayerNorm's bias, learned positions,
    and tied embeddings (a tied LM head adds nothing).

    Returns {"embeddings": tok_emb + pos_emb + an untied lm_head, "attention": qkv + proj over all
    layers, "mlp": fc + proj over all layers, "norms": norm1, norm2 of every layer and norm_f,
    "total": the sum}, each an int (weights and biases both counted).
    """
    raise NotImplementedError


def dequantize_q5_1(raw: np.ndarray) -> np.ndarray:
    """Exercise 3: Dequantize a Q5_1 tensor

    The notebook decodes one Q4_1 block; Q5_1, its 5-bit sibling, stores each weight's fifth bit
    apart from the other four. Decode a whole Q5_1 tensor, vectorised (no Python loop over blocks).
    Each 24-byte block holds 32 weights: a float16 scale d, a float16 minimum m, a 32-bit
    little-endian integer qh whose bit i is the fifth (highest) bit of weight i, then 16 bytes of
    nibbles laid out as in Q4_1 (byte j: the low 4 bits of weight j in its low nibble, of weight
    j + 16 in its high nibble). So q_i = (its 4 low bits) + 16 * (bit i of qh), in 0..31, and
    w_i = d * q_i + m.

    raw: uint8 [..., n_bytes] with n_bytes a multiple of 24
      (`gguf.quants.quantize(values, GGMLQuantizationType.Q5_1)`).
    Returns float32 [..., n_bytes / 24 * 32], equal to `gguf.quants.dequantize`.
    """
    raise NotImplementedError


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Exercise 4: Undo llama.cpp's RoPE permutation

    minillm (like transformers) rotates each head's (i, i + head_dim/2) pairs; llama.cpp rotates
    adjacent pairs (2i, 2i + 1). So its converter reorders the rows of W_q and W_k, within each
    head, from (0, 1, ..., head_dim - 1) to (0, head_dim/2, 1, head_dim/2 + 1, ...). Undo that.

    w: [n_heads * head_dim, ...] rows as stored in the GGUF; n_heads: query heads for W_q,
      key/value heads for W_k.
    Returns the rows in Hugging Face's order, same shape.
    """
    raise NotImplementedError
