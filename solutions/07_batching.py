"""Worked answers for lesson 07's exercises (lessons/07-batching/exercises.py)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from minillm.model.attention import causal_mask_lower_right
from minillm.runtime.session import DecodeSession


@torch.inference_mode()
def packed_prefill(model, rows: list[list[int]]) -> list[torch.Tensor]:
    """Exercise 1: Packed prefill"""
    lengths = [len(r) for r in rows]
    tokens = torch.tensor([[t for r in rows for t in r]], device=model.device)  # [1, N]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(model.device)  # restart per row
    segment = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)])  # [N]: which row a token is
    N = len(segment)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    mask = causal & (segment[:, None] == segment[None, :])  # block-diagonal: own row only
    logits = model(tokens, positions, mask=mask[None].to(model.device))[0]  # [N, V]
    return list(logits.split(lengths))  # each row's slice, no padding anywhere


def least_padding_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Exercise 2: Buckets with the least padding"""
    n = len(lengths)
    k = math.ceil(n / batch_size)
    order = sorted(range(n), key=lambda i: lengths[i])
    sorted_lengths = [lengths[i] for i in order]

    def padding(i, j):  # rows order[i:j] in one batch: all padded to the longest, the last one
        return sum(sorted_lengths[j - 1] - x for x in sorted_lengths[i:j])

    @lru_cache(maxsize=None)
    def best(i, batches):  # least padding for sorted rows i.. in exactly `batches` batches, and where to cut
        if i == n:
            return (0, ()) if batches == 0 else (math.inf, ())
        if batches == 0:
            return math.inf, ()
        options = []
        for j in range(i + 1, min(n, i + batch_size) + 1):
            cost, cuts = best(j, batches - 1)
            options.append((padding(i, j) + cost, (j, *cuts)))
        return min(options)

    _, cuts = best(0, k)
    starts = (0, *cuts[:-1])
    return [order[i:j] for i, j in zip(starts, cuts)]


@torch.inference_mode()
def greedy_per_row_eos(model, prompts, eos_ids, max_new_tokens):
    """Exercise 3: Per-row stops on the session"""
    session = DecodeSession(model, "static", max_len=max(map(len, prompts)) + max_new_tokens,
                            max_batch=len(prompts))
    outputs = [[] for _ in prompts]
    active = list(range(len(prompts)))  # the prompt index of each session row
    logits = session.prefill(prompts)  # [B, V]
    while True:
        next_tokens = logits.argmax(dim=-1)  # [B]
        for r, token in zip(active, next_tokens.tolist()):
            outputs[r].append(token)
        keep = [i for i, r in enumerate(active)
                if outputs[r][-1] != eos_ids[r] and len(outputs[r]) < max_new_tokens]
        if not keep:
            return outputs
        if len(keep) < len(active):  # finished rows leave: the cache drops their rows too
            session.select(keep)
            active, next_tokens = [active[i] for i in keep], next_tokens[keep]
        logits = session.extend(next_tokens[:, None])[:, -1]


def predicted_nan_rows() -> dict[str, list[bool]]:
    """Exercise 4: Break the diagonal"""
    # Without the s = t term a padding query sees no key: every key at or before it is padding too. Its softmax is
    # over nothing, 0/0 = NaN, and the padding position's output is NaN. Real queries never look at it, so in the
    # first layer nothing real is touched: its padding KEYS and VALUES came from embeddings and are finite. The NaN
    # output becomes the next layer's padding keys and values; a real query weights them by exactly 0, and
    # 0 * NaN = NaN: from layer 2 on every real token of a padded row is NaN. The longest row has no padding, so no
    # query of it is ever empty. SDPA returns zeros for a query that sees nothing, so nothing is NaN at all.
    return {
        "sdpa, 2 layers": [False, False, False, False],
        "softmax, 1 layer": [False, False, False, False],
        "softmax, 2 layers": [True, False, True, True],  # 3, 1 and 9 tokens are padded; 17 is not
    }


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step) -> torch.Tensor:
    """Exercise 4: Break the diagonal"""
    H, KV, T, S = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)  # [B, H, S, hd]
    mask = step.mask[:, None] if step.mask is not None else causal_mask_lower_right(T, S, q.device)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, S]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)  # a row of all -inf: 0/0 = NaN
    return weights @ v  # weight 0 times a NaN value is NaN: no weight can hide a NaN


def mask_without_own_column(key_valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Exercise 4: Break the diagonal"""
    S = key_valid.shape[1]
    causal = causal_mask_lower_right(num_queries, S, key_valid.device)  # [T, S]
    return causal & key_valid[:, None, :]  # real keys only: a padding query sees nothing at all
