"""Lesson 17 exercises: write your answers here; `pytest lessons/17-model-families` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/17_model_families.py (try first!).
"""

from __future__ import annotations

import torch  # noqa: F401


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exercise 1: Gemma's norm by hand

    Gemma's RMSNorm over the last dim of x [..., d]: x / sqrt(mean(x²) + eps) · (1 + weight), with the
    statistics AND the scaling done in float32, and the result cast back to x's dtype at the very end.
    (Llama casts the normalised x back first and then multiplies by weight: in bf16 the two differ.)

    The check compares with `minillm.model.norms.GemmaRMSNorm` and transformers' `Gemma3RMSNorm`, bit for bit, in
    float32 and bfloat16, with a random weight (a zero weight, Gemma's initialisation, would hide a missing 1).
    """
    raise NotImplementedError


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Exercise 2: The sliding-window mask

    The keys live in a rolling (ring-buffer) cache of S slots: position p is written to column p % S, over
    position p - S, so a column's index is not its position. query_positions: long [B, T], each query's
    position. key_positions: long [B, S], the position held by each column, -1 for a slot not written yet.
    Return bool [B, T, S]: True where query (b, t) may attend to column j: the slot holds a key, the key is not
    in the query's future, and it lies less than `window` positions back (transformers' rule: each query sees
    at most `window` keys, itself included). Assume nothing about the order of the columns.

    The check compares with a brute-force loop, and decodes a tiny Mistral through a ring cache with your mask:
    its logits must equal transformers' MistralForCausalLM on a prompt three windows long.
    """
    raise NotImplementedError


def rolling_cache_slots(window: int, chunk: int) -> int:
    """Exercise 2: The sliding-window mask

    Predict the fewest slots a rolling cache needs so that a step of `chunk` new tokens can be written into it
    (each to slot position % slots) and then attend, with no query of the step missing a key its window covers,
    at any point of an arbitrarily long sequence (a decode step is chunk = 1). Return it as a formula in window
    and chunk. Hint: which key does the step's first query need, and which position does its last token write?

    The check finds the fewest slots by simulating the ring, and the tiny Mistral above runs on your count.
    """
    raise NotImplementedError


def predicted_orders() -> dict[tuple[int, int], list[int]]:
    """Exercise 3: From neighbours to halves

    Write your prediction as literals, before you run anything (notebook 17 prints the order for head_dim 16,
    rotary_dim 8; work these two out by hand): the order `rotary_order(head_dim, rotary_dim, interleaved=True)`
    gives for a GPT-J head of 12 dims rotating 4, and for one of 8 dims rotating all 8.

    Returns {(12, 4): [12 ints], (8, 8): [8 ints]}. The check compares with `minillm.model.weight_names.rotary_order`.
    """
    raise NotImplementedError


def interleaved_to_halves(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Exercise 3: From neighbours to halves

    GPT-J rotates neighbouring dims (0, 1), (2, 3), ... of the first `rotary_dim` dims of each head and leaves
    the rest alone. minillm's RoPE (`RopeTable` with `rotary_dim`) rotates dims (i, i + head_dim/2) and gives the
    rest angle 0. Return the order, long [head_dim], such that head[..., order] is a head laid out for minillm's
    RoPE: each GPT-J pair rotated at the speed it had, the unrotated dims where the table gives angle 0, in their
    own order.

    The check compares with `minillm.model.weight_names.rotary_order` and rotates random q and k both ways: the scores
    q·k must agree.
    """
    raise NotImplementedError


def predicted_breaks() -> dict[str, dict[str, bool]]:
    """Exercise 3: From neighbours to halves

    Predict, as literals: the loader applies the order to the rows of W_q and W_k (so to q's and k's dims). What if
    it reordered other rows? One attention head of a GPT-J layer (head_dim 12, rotary_dim 4, causal), its reference
    run with GPT-J's own rotation: scores = rot(q)·rot(k), output = softmax(scores / √12) @ v @ W_oᵀ. Each case
    below runs minillm's RoPE instead, on:

        "q and k":         q[..., order] and k[..., order] (the loader's way), v and W_o as they are
        "q only":          q[..., order], k, v and W_o as they are
        "q, k and v":      q, k and v each [..., order], W_o as it is
        "q, k, v and W_o": as above, and W_o's columns [:, order] too

    Returns {case: {"same scores": bool, "same output": bool}}: does the case give the reference's scores, and its
    output? The check runs the four cases on random weights. Say why v's rows are left where they are.
    """
    raise NotImplementedError


def config_from_transformers(hf: dict):
    """Exercise 4: A family's config from transformers' config

    `hf` is a checkpoint's config.json as a dict (transformers' `config.to_dict()`), of model_type "llama" or
    "qwen2". Return the `minillm.model.config.ModelConfig` that makes minillm's one Transformer compute the same
    network: read the sizes (vocab, context, layers, query and key/value heads, hidden size, MLP size, head_dim
    when given), the RMSNorm epsilon, the RoPE base (transformers 5 keeps it in hf["rope_parameters"]["rope_theta"],
    older configs in hf["rope_theta"]; 10000 when absent), whether the LM head is tied to the embedding, and the
    family's own switches: what is Llama-shaped about both (norm, positions, MLP, biases), and what Qwen2 adds.

    Raise ValueError for anything else: another model_type, a RoPE scaling other than "default", a sliding
    window in use (Qwen2's use_sliding_window), an MLP activation other than silu, Llama's attention_bias.

    The check compares with the package's own mapping (`minillm.model.checkpoint.config_from_hf`), then builds a
    minillm Transformer from your config, loads transformers' tiny random models' weights into it and compares
    the logits with transformers' (plain and grouped heads, tied and untied heads, several RoPE bases).
    """
    raise NotImplementedError


def cache_bytes_per_token(hf: dict, bytes_per_number: int) -> tuple[int, int]:
    """Exercise 5: What latent attention saves

    `hf` is a DeepSeek-V3-style config.json as a dict: num_hidden_layers, num_attention_heads, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim. Return (latent, per_head): the bytes one token occupies in the
    KV cache over all layers, at `bytes_per_number` bytes a number,

      latent    with multi-head latent attention as `minillm.model.latent_attention` caches it: per layer, the
                latent (kv_lora_rank) and the one RoPE key all heads share (qk_rope_head_dim), and no values;
      per_head  if the same heads each cached their own key (qk_nope_head_dim + qk_rope_head_dim) and value
                (v_head_dim), as plain multi-head attention does.

    Predict first, for DeepSeek-V3 itself (61 layers, 128 heads, kv_lora_rank 512, 128 + 64 key dims, 128 value
    dims) in bfloat16: how many kilobytes per token each way, and how many tokens of context fit in 80 GB of
    cache? The check allocates the tiny model's caches and compares.
    """
    raise NotImplementedError
