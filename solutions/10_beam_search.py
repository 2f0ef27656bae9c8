"""Worked answers for lesson 10's exercises (lessons/10-beam-search/exercises.py)."""

from __future__ import annotations

import math

import torch

from minillm.runtime.session import DecodeSession


def predicted_winners() -> list[int]:
    """Exercise 1: Predict which length wins"""
    # sum / n ** lp for (-2.5, 10), (-1.0, 2), (-16.0, 40), (-2.0, 5), (-0.9, 3):
    #   lp = -1 (sum * n):  -25    -2     -640   -10    -2.7    -> 1: shortness is rewarded twice
    #   lp =  0 (the sum):  -2.5   -1.0   -16    -2.0   -0.9    -> 4: the most probable text, short
    #   lp = 0.5:           -0.79  -0.71  -2.53  -0.89  -0.52   -> 4
    #   lp =  1 (per token): -0.25 -0.5   -0.4   -0.4   -0.3    -> 0: the best average log-probability
    #   lp =  2:            -0.025 -0.25  -0.01  -0.08  -0.1    -> 2: the longest, though its tokens are worse
    # Hypothesis 3 never wins: at every penalty a shorter or a longer one beats it.
    return [1, 4, 4, 0, 2]


@torch.inference_mode()
def beam_search_fixed_length(model, prompt_ids, num_beams, max_new_tokens):
    """Exercise 2: Beam search on the session"""
    session = DecodeSession(model, "static", max_len=len(prompt_ids) + max_new_tokens, max_batch=num_beams)
    logits = session.prefill([prompt_ids])  # [1, V]: the prompt is forwarded once
    beams, scores = [[]], torch.zeros(1)  # one beam at first: all beams would be the same prompt
    for step in range(max_new_tokens):
        vocab = logits.shape[-1]
        totals = logits.float().log_softmax(dim=-1).cpu() + scores[:, None]  # [beams, V]
        top_scores, top_index = totals.view(-1).topk(num_beams)  # the best extensions of any beam
        source, token = top_index // vocab, top_index % vocab
        beams = [beams[b] + [t] for b, t in zip(source.tolist(), token.tolist())]
        scores = top_scores
        if step == max_new_tokens - 1:
            break
        session.select(source)  # the cache rows follow their beams (a beam picked twice is copied)
        logits = session.extend(token[:, None].to(model.device))[:, -1]
    return list(zip(beams, scores.tolist()))


def diverse_beam_search(tree, num_groups, diversity_penalty, length):
    """Exercise 3: Diverse beam search on a tree"""
    paths = [""] * num_groups
    for _ in range(length):
        chosen = []  # tokens the earlier groups took at this step
        for g in range(num_groups):
            options = tree[paths[g]]
            # max() keeps the first of equal scores: ties go to the token listed first.
            token = max(options, key=lambda v: math.log(options[v]) - diversity_penalty * chosen.count(v))
            chosen.append(token)
            paths[g] += token
    return paths


def reorder_copies(n_layer: int, kv_heads: int, head_dim: int, bytes_per_number: int, prompts: list[int],
                   num_beams: int, max_new_tokens: int, block_size: int) -> tuple[int, int]:
    """Exercise 4: What following the beams copies"""
    per_token = 2 * n_layer * kv_heads * head_dim * bytes_per_number  # one token's keys and values, every layer
    rows, longest = len(prompts) * num_beams, max(prompts)
    columns = longest + sum(longest + n - 1 for n in range(1, max_new_tokens))  # the first select, then steps
    contiguous = rows * columns * per_token
    blocks_bound = rows * (max_new_tokens - 1) * block_size * per_token  # a block per beam per feed
    return contiguous, blocks_bound
    # The contiguous count grows with the square of the search's length (each select copies everything so far);
    # the bound grows linearly, one block per beam per step. A contiguous select copies more than a block each
    # once the rows hold more than block_size tokens (after the 9th step with a 7-token prompt and 16-token
    # blocks), and its total passes the bound at 20 steps (whatever the model: per-token bytes and rows cancel).
    # What a block pool saves in memory too: beams that share a prefix hold it once, where a contiguous cache holds
    # num_beams copies of the prompt.
