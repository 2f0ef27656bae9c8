"""Worked answers to lesson 17's exercises (`pytest lessons/17-model-families --solutions` checks them)."""

from __future__ import annotations

import torch

from minillm.model.config import ModelConfig


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exercise 1: Gemma's norm by hand"""
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normalized * (1.0 + weight.float())).to(x.dtype)  # scale in float32, cast last


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Exercise 2: The sliding-window mask"""
    keys = key_positions[:, None, :]  # [B, 1, S]: the position each column holds, whatever the column's index
    delta = query_positions[:, :, None] - keys  # [B, T, S]: how far back each key lies
    return (keys >= 0) & (delta >= 0) & (delta < window)  # a written slot, not the future, inside the window
    # Without `keys >= 0` an empty slot (-1) looks like a key one position before 0, inside the window of every
    # query at position < window - 1. The column index says nothing once the ring has wrapped: column 0 holds
    # position 0, then S, then 2S, ...


def rolling_cache_slots(window: int, chunk: int) -> int:
    """Exercise 2: The sliding-window mask"""
    return window - 1 + chunk
    # The chunk's first query, at p, needs positions p - window + 1 .. p; its last token, p + chunk - 1, is written
    # before anyone attends. The ring must hold p - window + 1 .. p + chunk - 1 at once: window - 1 + chunk slots.
    # A decode step (chunk 1) needs exactly `window`: W - 1 past keys and its own. That is transformers'
    # DynamicSlidingWindowLayer: it keeps the last W - 1 keys between steps and hands attention W - 1 + T (its
    # StaticSlidingWindowLayer keeps W and rolls for a decode step). Under `<=` (W + 1 keys, itself included) every
    # count grows by one. Mixing the two rules hides well: a `<=` mask over a ring of W slots decodes one token at a
    # time exactly like `<` (the extra key's slot already holds the new token), and differs only for steps of
    # several tokens, and only once the prompt is longer than the window: the check runs both, three windows long.


def predicted_orders() -> dict[tuple[int, int], list[int]]:
    """Exercise 3: From neighbours to halves"""
    # GPT-J's pair i is (2i, 2i + 1); minillm's is (i, i + head_dim/2). So the evens of the rotary dims fill the
    # first places of the first half and the odds the first places of the second half; the unrotated dims fill
    # what is left of each half, first half first, in their own order.
    # (12, 4): pairs (0, 1), (2, 3) go to places (0, 6), (1, 7); dims 4..11 fill places 2..5 and 8..11.
    # (8, 8): nothing unrotated: the evens, then the odds.
    return {(12, 4): [0, 2, 4, 5, 6, 7, 1, 3, 8, 9, 10, 11],
            (8, 8): [0, 2, 4, 6, 1, 3, 5, 7]}


def interleaved_to_halves(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Exercise 3: From neighbours to halves"""
    still = (head_dim - rotary_dim) // 2
    evens, odds = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    passing = torch.arange(rotary_dim, head_dim)
    return torch.cat((evens, passing[:still], odds, passing[still:]))


def predicted_breaks() -> dict[str, dict[str, bool]]:
    """Exercise 3: From neighbours to halves"""
    # A score is a dot product, a sum over dims: it does not care in which order the dims come, as long as q's and
    # k's come in the same order, and RoPE turns each pair by an angle that depends on the pair, not on its place.
    # q only: q's dim j now meets k's dim order[j] (and each is rotated as the wrong pair's half): every score
    # changes, so every output does. v never enters a score, so moving its rows changes none, but the output is
    # sum_j (weights @ v)_j * W_o[:, j]: with v's dims permuted and W_o's columns not, each dim is read by another
    # column of W_o and the output changes. Moving W_o's columns the same way undoes it: also exact, and pointless,
    # since RoPE never touches v. That is why the loader reorders only W_q's and W_k's rows.
    return {
        "q and k": {"same scores": True, "same output": True},
        "q only": {"same scores": False, "same output": False},
        "q, k and v": {"same scores": True, "same output": False},
        "q, k, v and W_o": {"same scores": True, "same output": True},
    }


def config_from_transformers(hf: dict) -> ModelConfig:
    """Exercise 4: A family's config from transformers' config"""
    kind = hf.get("model_type")
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"model_type {kind!r}: this mapping reads llama and qwen2 configs")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}  # old style, then new
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r}: only plain RoPE is mapped here")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: a Llama-shaped MLP gates with silu")
    if kind == "qwen2" and hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True: map Qwen2's sliding layers too (the package does, see qwen_config)")
    if kind == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ValueError("a Llama with biases: not the plain Llama shape")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_kv_head=hf.get("num_key_value_heads"), d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], head_dim=hf.get("head_dim"),
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], positions="rope", mlp="swiglu",
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        bias=False,  # no bias on the output and MLP projections, nor in the norms
        qkv_bias=kind == "qwen2",  # Qwen2's one difference from Llama: q, k and v have a bias
        tie_embeddings=hf.get("tie_word_embeddings", False),  # transformers' default is untied; SmolLM2 ties
    )
    # Every switch that is not named keeps GPT-2's default in ModelConfig, so the mapping must name all that
    # differ: rmsnorm, rope, swiglu, no biases. A forgotten one fails loudly or quietly: qkv_bias=False for Qwen2
    # leaves its q/k/v biases out of the state dict (a strict load refuses), while a forgotten rope_theta (Qwen2
    # uses 1 000 000, not 10 000) loads fine and only the logits show it, worse at long distances. That is why
    # the check compares logits, not only fields. head_dim may be absent (d_model / n_head) or wider (Gemma,
    # Qwen3); n_kv_head may be absent (plain multi-head attention).


def cache_bytes_per_token(hf: dict, bytes_per_number: int) -> tuple[int, int]:
    """Exercise 5: What latent attention saves"""
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    latent = layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * bytes_per_number
    per_head = layers * heads * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"]) * bytes_per_number
    return latent, per_head
    # DeepSeek-V3 in bfloat16: 61 · 576 · 2 = 70,272 bytes (69 KiB) a token with the latent, against
    # 61 · 128 · 320 · 2 = 4,997,120 bytes (4.8 MiB) a token with keys and values per head: 71 times less, so 80 GB
    # of cache holds about 1.1 million tokens of context instead of about 16,000. Grouped-query attention with 8 KV
    # heads of 128 dims (Llama 3 70B's choice) would cache 8 · 256 = 2,048 numbers per layer, still 3.6 times the
    # latent's 576. What latent attention pays instead: absorbing W_uk into each query makes attention a
    # multi-query attention over 576-wide keys, more arithmetic per key than 128-wide heads, which decoding (bound
    # by bytes) can afford.
