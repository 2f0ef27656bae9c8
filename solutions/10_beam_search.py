"""Worked answers for lesson 10's exercises (lessons/10-beam-search/exercises.py)."""

from __future__ import annotations

import math

import torch

from minillm.runtime.session import DecodeSession


@torch.inference_mode()
def sequence_score(model, prompt_ids, token_ids, length_penalty):
    """Exercise 1: Score a hypothesis like transformers"""
    ids = list(prompt_ids) + list(token_ids)
    tokens = torch.tensor([ids], device=model.device)
    logits = model(tokens, torch.arange(len(ids), device=model.device)[None])[0]  # [P + N, V]
    # The logits at position i predict token i + 1: the new tokens are predicted from P - 1 .. P + N - 2.
    log_probs = logits[len(prompt_ids) - 1:-1].float().log_softmax(dim=-1)  # [N, V]
    total = log_probs.gather(-1, torch.tensor(token_ids, device=model.device)[:, None]).sum().item()
    return total / len(token_ids) ** length_penalty  # n counts the new tokens, EOS included


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
