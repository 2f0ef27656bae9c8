"""Lesson 02 exercises: write your answers here; `pytest lessons/02-greedy-decoding` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/02_greedy_decoding.py
(try first: `pytest lessons/02-greedy-decoding --solutions` runs the checks on them).
"""

from __future__ import annotations

from minillm.strategies.generate import generate  # noqa: F401  (exercise 1 drives it)


def generate_until(model, prompt_ids: list[int], stop_sequences: list[list[int]], max_new_tokens: int) -> list[int]:
    """Exercise 1: Stop on a token sequence

    Greedy-decode `prompt_ids` (batch of one) and stop as soon as the generated tokens end with
    one of `stop_sequences` (each a list of token ids); the completed stop sequence is the last
    thing returned. Only generated tokens count: a match may not reach back into the prompt.
    Without a match, stop after `max_new_tokens`.

    Drive `generate(model, [prompt_ids], max_new_tokens=..., stream=True)`: it yields one event
    per new token (`event.token_ids`), and leaving the `for` loop early stops the model work.
    The check counts forward passes: one per returned token, no more. Look only at the tail
    (the newest tokens) after each step, never rescan the whole output.

    Returns the generated token ids (a list of ints).
    """
    raise NotImplementedError


def find_cycle(token_ids: list[int], context_length: int) -> tuple[int, int] | None:
    """Exercise 2: Predict where greedy loops

    With a sliding window of `context_length` tokens (`window_slide=1`), greedy decoding picks token t
    from the `context_length` tokens before it and nothing else: token_ids[t] = f(token_ids[t-w:t]), w =
    context_length, for every generated t. Here the prompt is at most w tokens, so that holds for every t >= w,
    and once a full window repeats, everything after it repeats too.

    token_ids: the whole sequence (prompt + generated) of such a run.
    Find the first k (w <= k <= len(token_ids)) whose window token_ids[k-w:k] equals an earlier
    window token_ids[j-w:j] (w <= j < k). Return (start, period) = (j - w, k - j): from `start` on,
    token_ids[t + period] == token_ids[t] for every t, including tokens not generated yet.
    Return None if no full window repeats.
    """
    raise NotImplementedError


def prefill_cost(prompt_len: int, max_new_tokens: int, context_length: int, window_slide: int) -> tuple[int, int]:
    """Exercise 3: Count the re-prefills

    Without running a model, predict what `generate(model, [prompt], max_new_tokens=...,
    window_slide=window_slide)` (static cache, no EOS, batch of one) will prefill: the first prefill
    of the prompt, plus one re-prefill of the whole window each time the window moves (the rule
    is `minillm.strategies.generate.sliding_window_start`; the loop checks it after appending each new token,
    except after the last one, when the row is already finished).

    Returns (number of prefills, total tokens forwarded by those prefills).
    """
    raise NotImplementedError
