"""Worked answers for lesson 18 (checked by `pytest lessons/18-structured-output --solutions`)."""

from __future__ import annotations

import json
import re

import numpy as np


def token_mask(transitions: np.ndarray, accepting: np.ndarray, token_bytes: list[bytes | None], state: int,
               eos_id: int) -> list[bool]:
    """Exercise 1: Walk the vocabulary"""
    allowed = []
    for token, data in enumerate(token_bytes):
        if token == eos_id:  # EOS ends the text: only where the text is a whole string of the language
            allowed.append(bool(accepting[state]))
            continue
        if not data:  # special tokens stand for no text: never allowed as text
            allowed.append(False)
            continue
        current = state
        for byte in data:  # one table lookup per byte; -1 means no string of the language continues so
            current = int(transitions[current, byte])
            if current < 0:
                break
        allowed.append(current >= 0)
    return allowed


SCALARS = {
    "string": r'"[^"\\\x00-\x1f]*"',  # no escapes: a subset of JSON strings, every one valid
    "integer": r"-?(0|[1-9][0-9]*)",
    "boolean": r"(true|false)",
}


def schema_to_regex(schema: dict) -> str:
    """Exercise 2: A schema as a regex"""
    if schema.get("type") != "object":
        return SCALARS[schema["type"]]
    members = [re.escape(json.dumps(name)) + ":" + schema_to_regex(sub)  # "name":value, compact
               for name, sub in schema["properties"].items()]
    return r"\{" + ",".join(members) + r"\}"  # every property required, in the schema's order


def predicted_distortion() -> dict[str, dict[str, float]]:
    """Exercise 3: Predict the distortion"""
    # Masked: the first step allows "a" and "b" ("c" starts no word of ac|b), renormalised: a 0.9 / 0.99, b 0.09 / 0.99.
    # After "a" only "c" is allowed, so its 0.01 becomes 1: "ac" keeps all of the first step's 10/11.
    # Conditioned: the model's own probabilities of the two outputs, EOS included: "ac" 0.9 * 0.01 * 1 = 0.009,
    # "b" 0.09 * 1 = 0.09; renormalised over the two, 1/11 and 10/11. The mask exactly reverses the model's preference:
    # it commits to "a" before it learns that "a" leads only to a token the model almost never writes.
    return {"masked": {"ac": 10 / 11, "b": 1 / 11}, "conditioned": {"ac": 1 / 11, "b": 10 / 11}}


def masked_output_probabilities(next_probs, pattern: str, vocabulary: list[str], eos: str = "") -> dict[str, float]:
    """Exercise 3: Predict the distortion"""
    # Token-level masking renormalises at every step over the tokens that keep a viable prefix: the probability of
    # an output is the product of those per-step shares. Walk the tree of texts, keeping each branch's probability.
    import regex

    def viable(text: str) -> bool:
        return regex.fullmatch(pattern, text, partial=True) is not None

    outputs: dict[str, float] = {}
    frontier = [("", 1.0)]
    while frontier:
        text, probability = frontier.pop()
        probs = next_probs(text)
        allowed = {t: p for t, p in zip(vocabulary, probs)
                   if (t == eos and re.fullmatch(pattern, text)) or (t != eos and viable(text + t))}
        total = sum(allowed.values())
        for token, p in allowed.items():
            if p == 0:  # a branch the model never takes
                continue
            share = probability * p / total
            if token == eos:
                outputs[text] = outputs.get(text, 0.0) + share
            else:
                frontier.append((text + token, share))
    return outputs
