"""Worked answers for lesson 07's exercises (lessons/07-batching/exercises.py)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from minillm.cache.kv_cache import DynamicCache
from minillm.runtime.batching import attention_mask, pad_left
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


@torch.inference_mode()
def greedy_left_padded(model, prompts, max_new_tokens):
    """Exercise 4: A left-padded cached loop"""
    tokens, valid, positions = pad_left(prompts, device=model.device)  # every row ends at column L - 1
    cache = DynamicCache(model.config.n_layer)  # one length for the batch
    logits = model(tokens, positions, cache=cache, mask=attention_mask(valid, tokens.shape[1]))
    next_tokens = logits[:, -1].argmax(dim=-1)  # [B]: the last column is real in every row
    out, last_position = [next_tokens], positions[:, -1]
    for _ in range(max_new_tokens - 1):
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)  # the new column is real everywhere
        last_position = last_position + 1  # each row continues its own numbering
        logits = model(next_tokens[:, None], last_position[:, None], cache=cache, mask=attention_mask(valid, 1))
        next_tokens = logits[:, -1].argmax(dim=-1)
        out.append(next_tokens)
    return torch.stack(out, dim=1).tolist()
