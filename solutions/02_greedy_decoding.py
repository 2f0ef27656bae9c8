"""Worked answers for lesson 02 (checked by `pytest lessons/02-greedy-decoding --solutions`)."""

from __future__ import annotations

from minillm.strategies.generate import generate


def generate_until(model, prompt_ids: list[int], stop_sequences: list[list[int]], max_new_tokens: int) -> list[int]:
    """Exercise 1: Stop on a token sequence"""
    generated: list[int] = []
    for event in generate(model, [prompt_ids], max_new_tokens=max_new_tokens, stream=True):
        generated.extend(event.token_ids)
        # A stop sequence can only be completed by the newest token, so comparing each one with the
        # tail is enough (and costs O(len(stop)) per step, however long the output grows).
        if any(len(s) <= len(generated) and generated[-len(s):] == list(s) for s in stop_sequences if s):
            break  # leaving the loop closes the generator: no further forward pass is run
    return generated


def find_cycle(token_ids: list[int], context_length: int) -> tuple[int, int] | None:
    """Exercise 2: Predict where greedy loops"""
    w = context_length
    first_seen: dict[tuple[int, ...], int] = {}  # window -> the k where it first ended
    for k in range(w, len(token_ids) + 1):
        window = tuple(token_ids[k - w:k])
        if window in first_seen:
            j = first_seen[window]
            # Same window, same next token, hence same next window...: the sequence from j - w on
            # repeats with period k - j forever (greedy is a function of the window alone).
            return j - w, k - j
        first_seen[window] = k
    return None


def prefill_cost(prompt_len: int, max_new_tokens: int, context_length: int, window_slide: int) -> tuple[int, int]:
    """Exercise 3: Count the re-prefills"""
    prefills, tokens = 1, prompt_len  # the prompt is prefilled once, whatever happens next
    length, start = prompt_len, 0  # tokens held, and where the window begins
    for step in range(1, max_new_tokens + 1):
        length += 1  # the token chosen at this step is appended
        if step == max_new_tokens:
            break  # the row is finished: the loop ends before looking at the window
        if length - start > context_length:  # outgrown: move by window_slide, at least far enough to fit
            start = max(start + window_slide, length - context_length)
            prefills += 1
            tokens += length - start  # the whole new window goes through the model again
    return prefills, tokens
