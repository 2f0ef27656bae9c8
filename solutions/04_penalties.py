"""Worked answers for lesson 04 (checked by `pytest lessons/04-penalties --solutions`)."""

from __future__ import annotations

import math

import torch

from minillm.decoding.sampling import TokenHistory
from minillm.runtime.session import DecodeSession


def apply_no_repeat_ngram(logits: torch.Tensor, sequences: list[list[int]], n: int) -> torch.Tensor:
    """Exercise 1: No-repeat n-gram processor"""
    out = logits.clone()  # a processor never modifies its input
    for row, seq in enumerate(sequences):
        if len(seq) + 1 < n:  # not even one n-gram could be completed yet
            continue
        # Every (n-1)-token prefix seen so far -> the tokens that followed it. One pass over the row.
        followers: dict[tuple, set[int]] = {}
        for i in range(len(seq) - n + 1):
            followers.setdefault(tuple(seq[i:i + n - 1]), set()).add(seq[i + n - 1])
        # The next token completes the n-gram (last n-1 tokens, next): ban whatever followed them before.
        current = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
        banned = followers.get(current, set())
        if banned:
            out[row, list(banned)] = -math.inf
    return out


@torch.inference_mode()
def greedy_with_processor(model, prompt: list[int], max_new_tokens: int, processor) -> list[int]:
    """Exercise 2: A decode loop that takes any processor"""
    session = DecodeSession(model, cache="static", max_len=len(prompt) + max_new_tokens)
    logits = session.prefill([prompt])  # [1, V]: the next-token logits after the prompt
    sequence, generated = list(prompt), []
    for _ in range(max_new_tokens):
        # transformers' convention: the processor sees the whole sequence so far, prompt included.
        scores = processor(torch.tensor([sequence]), logits.float().clone())
        token = int(scores.argmax(dim=-1))  # greedy: first index on ties, like torch and transformers
        sequence.append(token)
        generated.append(token)
        if len(generated) < max_new_tokens:  # no forward for a token nobody will read
            logits = session.extend([[token]])[:, -1]  # [1, V]: one new token through the cache
    return generated


def penalise_rows(logits: torch.Tensor, history: TokenHistory, repetition: torch.Tensor,
                  presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Exercise 3: Per-row penalties in one pass"""
    # Each setting becomes a [B, 1] column that broadcasts over its row's vocabulary.
    r, p, f = (x.to(logits.dtype)[:, None] for x in (repetition, presence, frequency))
    # Repetition (seen tokens, prompt included): divide positive logits, multiply the others.
    penalised = torch.where(logits < 0, logits * r, logits / r)
    out = torch.where(history.seen, penalised, logits)
    # Presence/frequency (generated tokens only), in the package's order of operations so the floats agree:
    # z - f * count - p * [count > 0].
    counts = history.generated_counts.to(logits.dtype)
    return out - f * counts - p * (counts > 0).to(logits.dtype)


def picks_before_overtaken(lead: float, presence: float, frequency: float, max_uses: int = 1000) -> int | None:
    """Exercise 4: How long the leader keeps the argmax"""
    # After c generated uses the leader's logit is lead - frequency * c - presence * [c > 0] (the runner-up's is 0,
    # it is never generated while the leader wins). Greedy keeps the leader while that is >= 0 (ties go to the
    # lower token id, the leader's). The first c where it drops below 0 is the number of picks.
    if lead < 0:
        return 0
    if frequency <= 0:  # the fee never grows: either the one-off presence fee suffices or nothing ever does
        return 1 if lead - presence < 0 else None
    # lead - presence - frequency * c < 0  <=>  c > (lead - presence) / frequency
    picks = max(1, math.floor((lead - presence) / frequency) + 1)
    return picks if picks <= max_uses else None
