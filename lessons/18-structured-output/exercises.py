"""Lesson 18 exercises: write your answers here; `pytest lessons/18-structured-output` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/18_structured_output.py
(try first: `pytest lessons/18-structured-output --solutions` runs the checks on them).
"""

from __future__ import annotations

import json  # noqa: F401
import re  # noqa: F401

import numpy as np


def token_mask(transitions: np.ndarray, accepting: np.ndarray, token_bytes: list[bytes | None], state: int,
               eos_id: int) -> list[bool]:
    """Exercise 1: Walk the vocabulary

    The mask of one state, by hand: token t is allowed when walking its bytes from `state` through
    the DFA never reaches a missing move (-1); EOS is allowed exactly where the state accepts; a
    token with no bytes (None or b"": a special token) is never allowed.

    transitions: int32 [S, 256], the next state per (state, byte), -1 where no string of the
      language continues; accepting: bool [S]; token_bytes: each token's bytes (index = token id);
      state: where the text stands; eos_id: the EOS token's id.
    Returns one bool per token, as `minillm.decoding.structured.TokenIndex` computes for text tokens.
    """
    raise NotImplementedError


def schema_to_regex(schema: dict) -> str:
    """Exercise 2: A schema as a regex

    outlines' route: write a JSON schema as one regular expression, then compile that. Handle
    {"type": "object", "properties": {...}} (every property required, in the schema's order,
    nested objects too) whose leaves are "string" (any characters but `"`, `\\` and control
    characters, no escapes), "integer" and "boolean". Compact JSON: no whitespace at all, as
    `json.dumps(value, separators=(",", ":"), ensure_ascii=False)` writes it. Mind property
    names that hold regex characters.

    Returns a pattern for `re.fullmatch` (and for `minillm.decoding.regex.regex_dfa`).
    """
    raise NotImplementedError


def predicted_distortion() -> dict[str, dict[str, float]]:
    """Exercise 3: Predict the distortion

    Predict first, by hand, and write the numbers down as literals (running code is checking, not
    predicting): a mask keeps every output inside the language, but does it keep the model's
    preferences among them? A toy model over the tokens "a", "b", "c" and EOS:

        first token:          a 0.9    b 0.09   c 0.01   EOS 0
        after "a":            a 0.98   b 0      c 0.01   EOS 0.01
        after "b" or "ac":    EOS 1

    The language is `ac|b`. Returns {"masked": {"ac": P, "b": P}, "conditioned": {"ac": P, "b": P}}:
    the probability of each whole output under masked sampling (renormalised over the allowed
    tokens at every step), and under the model conditioned on the language (the model's own
    probability of each whole output, EOS included, renormalised over the outputs in the language).
    Two decimals are enough. The check enumerates both and compares.
    """
    raise NotImplementedError


def masked_output_probabilities(next_probs, pattern: str, vocabulary: list[str], eos: str = "") -> dict[str, float]:
    """Exercise 3: Predict the distortion

    Token masking renormalises over the allowed tokens at every step. Compute the probability
    of every whole output under masked sampling: at each step the allowed tokens are those that
    keep the text a prefix of a full match of `pattern` (`regex.fullmatch(pattern, text,
    partial=True)`), plus `eos` where the text fully matches; each allowed token is drawn with
    probability p / (sum of the allowed tokens' p). An output ends when `eos` is drawn.

    next_probs(text) -> one probability per vocabulary entry after `text`; vocabulary: the tokens'
      texts, `eos` among them. Skip branches of probability 0 (the model never takes them).
    Returns {output text: probability}. Write it after `predicted_distortion`: it computes the
    "masked" half of that prediction for any model and language.
    """
    raise NotImplementedError
