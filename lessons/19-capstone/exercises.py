"""Lesson 19 exercises: extend the capstone engine; `pytest lessons/19-capstone` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/19_capstone.py (try first: `pytest lessons/19-capstone
--solutions` runs the checks on them).

Each answer plugs into `engine.py` (beside this file) without editing it:

    engine.add_request(prompt, params, processors=[lambda logits, tokens: penalize_repeats(logits, tokens, 1.3)])
    engine.add_request(prompt, params, stop=lambda text: stop_at(text, ["\\n\\n", "Question:"]))
    Engine(model, pool=prefix_caching_pool(num_blocks=64, block_size=16))
"""

from __future__ import annotations

import torch
from engine import BlockPool  # noqa: F401  (exercise 3 subclasses it)


def penalize_repeats(logits: torch.Tensor, tokens: list[int], penalty: float) -> torch.Tensor:
    """Exercise 1: A repetition penalty

    A logits processor for the engine's sampler (`Request.processors`: it runs before the argmax or
    the draw, greedy included). Every token that already occurs in `tokens` (the prompt and what was
    generated so far) gets its logit divided by `penalty` when positive and multiplied by it when
    negative, once however often it occurs (Keskar et al. 2019; transformers'
    RepetitionPenaltyLogitsProcessor). Tokens not seen keep their logit.

    logits: float32 [V]; tokens: ids; penalty > 0 (> 1 discourages repeats). Returns a new [V] tensor
    (do not write into `logits`: it comes out of the model's inference mode).
    Why does the engine turn prompt lookup off for a request that has a processor?
    """
    raise NotImplementedError


def stop_at(text: str, stops: list[str]) -> str | None:
    """Exercise 2: Stop strings

    The engine asks a request's `stop` callable after every token it appends, with the text generated so
    far (`tokenizer.decode(generated)`): return None to go on, or the final text to end the request with.
    Return the text cut just before the earliest place where any of `stops` begins (the stop string
    itself is not part of the answer), or None when the text contains none of them.

    Why must the engine check after every appended token, and not only once per step, when a
    verified draft can append several tokens in one step?
    """
    raise NotImplementedError


def prefix_caching_pool(num_blocks: int, block_size: int):
    """Exercise 3: Prefix caching

    Requests that begin alike (a shared system prompt) have the same keys in their first blocks: keep
    one copy. Return an instance of your own subclass of `engine.BlockPool` that overrides

      allocate() -> int          take a free block (super().allocate()); it has one holder
      free(block)                one holder fewer; only the last holder's free puts it back on the free
                                 list (super().free(block)) and forgets what it caches
      admit(tokens) -> (table, cached)
                                 a new request's first blocks: walk its full blocks that end before its
                                 last token (that token's logits are needed, so its keys are always
                                 computed); while a block's whole prefix, tokens[:end], is cached, share
                                 that block (one more holder) and count its tokens in `cached`; from the
                                 first miss on, allocate fresh blocks and remember each under its prefix
                                 (the request's prefill writes their keys in this very step, before any
                                 layer reads them, so requests admitted in the same step can share too).
                                 The engine feeds tokens[cached:] and allocates whatever else it needs.

    Why is a whole prefix the key of a block, and not the block's own tokens?
    """
    raise NotImplementedError
