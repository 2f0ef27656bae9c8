"""Lesson 10 exercises: write your answers here; `pytest lessons/10-beam-search` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/10_beam_search.py
(try first: `pytest lessons/10-beam-search --solutions` runs the checks on them).
"""

from __future__ import annotations

import math  # noqa: F401

import torch  # noqa: F401

from minillm.runtime.session import DecodeSession  # noqa: F401  (exercise 2)


def predicted_winners() -> list[int]:
    """Exercise 1: Predict which length wins

    Every extra token adds a negative log-probability, so an unnormalised sum favours short answers;
    `length_penalty` is the knob that decides how much length is forgiven. Predict where it tips.
    Write your prediction as literals, working by hand (running code is checking, not predicting).
    Five finished hypotheses of one prompt, as (summed log-probability of the new tokens, n = how many
    new tokens, EOS included):

        0: (-2.5, 10)    1: (-1.0, 2)    2: (-16.0, 40)    3: (-2.0, 5)    4: (-0.9, 3)

    transformers ranks finished hypotheses by sum / n ** length_penalty (its `sequences_scores`; the
    highest is returned first). Returns, for each length_penalty in [-1.0, 0.0, 0.5, 1.0, 2.0], the
    index of the hypothesis returned first. The check computes the scores and compares.
    """
    raise NotImplementedError


def beam_search_fixed_length(model, prompt_ids: list[int], num_beams: int,
                             max_new_tokens: int) -> list[tuple[list[int], float]]:
    """Exercise 2: Beam search on the session

    Beam search without EOS and without length normalisation: every hypothesis has exactly
    `max_new_tokens` new tokens and is scored by its summed log-probability. Use a
    `minillm.runtime.session.DecodeSession`: `prefill([prompt_ids])` once, `select` to copy the prompt to
    the beams, and per step: log_softmax, add each beam's score, keep the best `num_beams` of the
    num_beams * vocab extensions (at the first step all beams are the same prompt: expand one),
    `select` the surviving beams' rows, `extend` with their new tokens.

    Returns num_beams (new token ids, summed log-prob) pairs, best first. The check compares with
    `minillm.strategies.beam.beam_search(..., eos_token_id=(), length_penalty=0)` and transformers.
    """
    raise NotImplementedError


def diverse_beam_search(tree: dict[str, dict[str, float]], num_groups: int, diversity_penalty: float,
                        length: int) -> list[str]:
    """Exercise 3: Diverse beam search on a tree

    tree: prefix (a string of one-letter tokens) -> {next token: probability}, like the notebook's
    TREE. `num_groups` groups of one beam each extend their own path for `length` steps. At each
    step the groups choose in order 0, 1, ...: group g gives token v the score
        log p(v | group g's path) - diversity_penalty * (how many groups before g chose v at this step)
    and appends the best one (ties: the token listed first in the distribution).

    Returns each group's path (a string of `length` tokens), group 0 first. With penalty 0 every
    group is greedy; with a large one the groups take different tokens at every step.
    """
    raise NotImplementedError


def reorder_copies(n_layer: int, kv_heads: int, head_dim: int, bytes_per_number: int, prompts: list[int],
                   num_beams: int, max_new_tokens: int, block_size: int) -> tuple[int, int]:
    """Exercise 4: What following the beams copies

    Beam search with EOS off runs every step: prefill each prompt once (prompts: their lengths), copy it to its
    num_beams beams, then at each of the steps before the last, pick the beams and make the cache follow them
    before feeding their tokens. Return (contiguous, blocks_bound), in bytes over the whole search:

      contiguous     what a contiguous cache's reorders copy (`StaticCache.reorder`): every select copies each of
                     the rows it keeps, keys and values of every layer and KV head, over the columns in use (all
                     rows padded to the longest prompt, since the prompts were prefilled together). The first
                     select comes after the prefill; the one at step n (1 .. max_new_tokens − 1) before step n's
                     token is fed.
      blocks_bound   the most `cache="blocks"` can copy: a select only forks (shares blocks); copy-on-write copies
                     a shared partial block when a beam writes into it, so at most one block (block_size tokens,
                     every layer, keys and values) per beam each time the beams' tokens are fed
                     (max_new_tokens − 1 times).

    Predict first: at what search length does the contiguous count overtake the bound, and how does each grow?
    The check runs the package's beam search with both caches and reads `stats.extra["cache_copied_bytes"]`.
    """
    raise NotImplementedError
