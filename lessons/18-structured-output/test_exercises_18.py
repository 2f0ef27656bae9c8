"""Checks for lesson 18's exercises: the package's token index, Python's re, and brute-force enumeration."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from minillm.decoding.automaton import compile_dfa
from minillm.decoding.json_schema import schema_node
from minillm.decoding.regex import regex_dfa
from minillm.decoding.structured import TokenIndex, Vocabulary

PIECES = [None, b"{", b"}", b'"', b":", b",", b" ", b'{"', b'":', b"yes", b"no", b"!", b"!!", b"ye", b"s", b"n",
          b"o", b"0", b"12", b"-", b"7", "é".encode(), b"\xc3", b"\xa9", b"a", b"ab", b"true", b"tr", b"ue", b"\n"]


@pytest.mark.parametrize("pattern", [r"(yes|no)!{0,2}", r"[a-c]+[0-9]?", r'"[^"]{0,3}"', r"-?[0-9]+|true"])
def test_exercise_1_walk_the_vocabulary(answers, pattern):
    dfa = regex_dfa(pattern)
    index = TokenIndex(dfa, Vocabulary(PIECES, (0,)))
    for state in range(dfa.num_states):
        expected = (index.byte_next_states(state) >= 0).tolist()
        expected[0] = bool(dfa.accepting[state])
        assert answers.token_mask(dfa.transitions, dfa.accepting, PIECES, state, 0) == expected, state


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "inner": {"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}}}}},
    {"type": "object", "properties": {"a.b": {"type": "string"}, "c+": {"type": "boolean"}}},
]


def instance(schema, rng):
    kind = schema["type"]
    if kind == "object":
        return {name: instance(sub, rng) for name, sub in schema["properties"].items()}
    if kind == "string":
        return "".join(rng.choice("ab xé日{}:,") for _ in range(rng.randint(0, 5)))
    return rng.choice([True, False]) if kind == "boolean" else rng.randint(-500, 500)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_exercise_2_a_schema_as_a_regex(answers, schema):
    pattern = answers.schema_to_regex(schema)
    package = compile_dfa(schema_node({**schema, "required": list(schema["properties"])}))
    rng = random.Random(0)
    for _ in range(50):
        text = json.dumps(instance(schema, rng), separators=(",", ":"), ensure_ascii=False)
        assert re.fullmatch(pattern, text), text
        assert package.accepts(text.encode())
        for broken in (text[:-1], text + " ", text.replace(":", ": ", 1).replace('"', "", 1), text.replace("{", "[")):
            assert not re.fullmatch(pattern, broken), broken
    # the package's automaton for the regex accepts exactly what the package's schema automaton accepts, compactly
    mine = regex_dfa(pattern)
    for _ in range(50):
        text = json.dumps(instance(schema, rng), separators=(",", ":"), ensure_ascii=False)
        assert mine.accepts(text.encode()) == package.accepts(text.encode())


def toy_model(table):
    """next_probs(text): the probabilities of each vocabulary entry after `text` (a default where unlisted)."""
    return lambda text: table.get(text, table["*"])


def finished_sequences(vocabulary, eos, depth):
    """Every token sequence of up to `depth` tokens that ends at its only EOS: the outputs a sampler can finish."""
    for n in range(1, depth + 1):
        for tokens in itertools.product(range(len(vocabulary)), repeat=n):
            if vocabulary[tokens[-1]] == eos and all(vocabulary[t] != eos for t in tokens[:-1]):
                yield tokens


def brute_force(next_probs, pattern, vocabulary, eos, depth=6):
    """Every token sequence up to `depth` tokens: masked sampling's probability of each output."""
    outputs = {}
    for tokens in finished_sequences(vocabulary, eos, depth):
        text, p = "", 1.0
        for t in tokens:
            probs = next_probs(text)
            allowed = [i for i, tok in enumerate(vocabulary) if
                       (tok == eos and re.fullmatch(pattern, text)) or
                       (tok != eos and any(re.fullmatch(pattern, text + tok + rest)
                                           for rest in ("", "a", "b", "c", "ab", "bc", "ca", "cc")))]
            if t not in allowed:
                p = 0.0
                break
            p *= probs[t] / sum(probs[i] for i in allowed)
            text += vocabulary[t]
        if p:
            outputs[text] = outputs.get(text, 0.0) + p
    return outputs


def conditioned(next_probs, pattern, vocabulary, eos, depth=6):
    """Every token sequence up to `depth` tokens, unmasked: the model's probability of each whole output in the
    language, renormalised over them (the model conditioned on the language)."""
    outputs = {}
    for tokens in finished_sequences(vocabulary, eos, depth):
        text, p = "", 1.0
        for t in tokens:
            p *= next_probs(text)[t]
            text += vocabulary[t]
        if p and re.fullmatch(pattern, text):
            outputs[text] = outputs.get(text, 0.0) + p
    total = sum(outputs.values())
    return {text: p / total for text, p in outputs.items()}


VOCABULARY, EOS = ["a", "b", "c", ""], ""
# The model loves "a" first, then wants "a" again (never allowed after it) and hates "c".
LOVES_A = {"": [0.9, 0.09, 0.01, 0.0], "a": [0.98, 0.0, 0.01, 0.01], "b": [0.0, 0.0, 0.0, 1.0],
           "*": [0.0, 0.0, 0.0, 1.0]}


def test_exercise_3_the_prediction(answers):
    predicted = answers.predicted_distortion()
    model = toy_model(LOVES_A)
    truth = {"masked": brute_force(model, r"ac|b", VOCABULARY, EOS),
             "conditioned": conditioned(model, r"ac|b", VOCABULARY, EOS)}
    assert set(predicted) == set(truth), f"predict exactly {sorted(truth)}"
    for how, outputs in truth.items():
        assert set(predicted[how]) == set(outputs), f"{how}: the outputs are {sorted(outputs)}"
        wrong = {text: (predicted[how][text], round(p, 4)) for text, p in outputs.items()
                 if abs(predicted[how][text] - p) > 0.01}
        assert not wrong, f"{how}: predicted vs enumerated {wrong}"


def test_exercise_3_masked_output_probabilities(answers):
    model, pattern = toy_model(LOVES_A), r"ac|b"
    mine = answers.masked_output_probabilities(model, pattern, VOCABULARY, EOS)
    expected = brute_force(model, pattern, VOCABULARY, EOS)
    assert mine.keys() == expected.keys() and all(abs(mine[k] - expected[k]) < 1e-9 for k in expected)
    other = toy_model({"": [0.2, 0.3, 0.5, 0.0], "c": [0.3, 0.3, 0.0, 0.4], "cc": [0.1, 0.1, 0.1, 0.7],
                       "*": [0.25, 0.25, 0.25, 0.25]})
    mine = answers.masked_output_probabilities(other, r"c{1,2}|cab?", VOCABULARY, EOS)
    expected = brute_force(other, r"c{1,2}|cab?", VOCABULARY, EOS)
    assert mine.keys() == expected.keys() and all(abs(mine[k] - expected[k]) < 1e-9 for k in expected)
