"""Checks for lesson 10's exercises: each compares your answer with a reference computed here."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from minillm.model.tiny import tiny_pair
from minillm.runtime.batching import pad_left
from minillm.strategies.beam import beam_search, continuation_logprobs
from minillm.strategies.generate import generate

PROMPT = [1, 2, 3, 4, 5]
TREE = {  # the notebook's hand-made tree
    "": {"a": .50, "b": .30, "c": .20},
    "a": {"a": .40, "b": .35, "c": .25}, "b": {"a": .90, "b": .06, "c": .04}, "c": {"a": .05, "b": .15, "c": .80},
    "aa": {"a": .45, "b": .30, "c": .25}, "ab": {"a": .50, "b": .30, "c": .20}, "ac": {"a": .34, "b": .33, "c": .33},
    "ba": {"a": .40, "b": .32, "c": .28}, "bb": {"a": .50, "b": .30, "c": .20}, "bc": {"a": .50, "b": .30, "c": .20},
    "ca": {"a": .50, "b": .30, "c": .20}, "cb": {"a": .60, "b": .30, "c": .10}, "cc": {"a": .03, "b": .02, "c": .95},
}


def hf_beams(hf_model, prompt, *, num_beams, length_penalty, max_new_tokens, eos):
    tokens, valid, _ = pad_left([prompt])
    out = hf_model.generate(tokens, attention_mask=valid.long(), num_beams=num_beams, do_sample=False,
                            length_penalty=length_penalty, num_return_sequences=num_beams,
                            max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0 if eos is None else eos,
                            return_dict_in_generate=True, output_scores=True)
    rows = []
    for sequence in out.sequences[:, tokens.shape[1]:].tolist():
        rows.append(sequence[:sequence.index(eos) + 1] if eos is not None and eos in sequence else sequence)
    return rows, out.sequences_scores.tolist()


HYPOTHESES = [(-2.5, 10), (-1.0, 2), (-16.0, 40), (-2.0, 5), (-0.9, 3)]  # (summed log-probability, new tokens)
LENGTH_PENALTIES = [-1.0, 0.0, 0.5, 1.0, 2.0]


def sequences_score(total: float, n: int, length_penalty: float) -> float:
    """transformers' score of a finished hypothesis (generation/utils.py, `_update_finished_beams`: the summed
    log-probabilities over (new tokens, EOS included) ** length_penalty); the check recomputes real beams with it."""
    return total / n ** length_penalty


def test_exercise_1_predict_which_length_wins(answers):
    predicted = answers.predicted_winners()
    # The truth is transformers' own rule: first recompute its beams' sequences_scores with it, from one forward
    # each, over hypotheses of different lengths (ended by EOS and by length) at every penalty of the exercise.
    hf_model, model = tiny_pair("gpt2")
    eos = generate(model, PROMPT, max_new_tokens=8).token_ids[0][3]  # a token the model really produces
    lengths = set()
    for length_penalty in LENGTH_PENALTIES:
        rows, scores = hf_beams(hf_model, PROMPT, num_beams=4, length_penalty=length_penalty, max_new_tokens=10,
                                eos=eos)
        for row, want in zip(rows, scores):
            total = continuation_logprobs(model, PROMPT, row).sum().item()
            assert sequences_score(total, len(row), length_penalty) == pytest.approx(want, abs=1e-4), row
            lengths.add(len(row))
    assert len(lengths) > 1
    # Then the prediction against it.
    truth = [max(range(len(HYPOTHESES)), key=lambda i: sequences_score(*HYPOTHESES[i], lp)) for lp in LENGTH_PENALTIES]
    assert len(predicted) == len(LENGTH_PENALTIES), f"one index per length_penalty in {LENGTH_PENALTIES}"
    wrong = {lp: (p, t) for lp, p, t in zip(LENGTH_PENALTIES, predicted, truth) if p != t}
    assert not wrong, "length_penalty: predicted vs true winner: " + ", ".join(
        f"{lp:g}: {p} vs {t} (scores {[round(sequences_score(*h, lp), 4) for h in HYPOTHESES]})"
        for lp, (p, t) in wrong.items())


@pytest.mark.parametrize("kind,num_beams,new_tokens", [("llama", 3, 6), ("gpt2", 5, 5), ("llama", 2, 1)])
def test_exercise_2_beam_search_on_the_session(answers, kind, num_beams, new_tokens):
    hf_model, model = tiny_pair(kind)
    got = answers.beam_search_fixed_length(model, PROMPT, num_beams, new_tokens)
    package = beam_search(model, PROMPT, num_beams=num_beams, num_return_sequences=num_beams,
                          max_new_tokens=new_tokens, eos_token_id=(), length_penalty=0.0)
    assert [list(ids) for ids, _ in got] == package.token_ids
    assert [score for _, score in got] == pytest.approx(package.sequences_scores, abs=1e-4)
    if num_beams > 1 or new_tokens > 1:
        rows, scores = hf_beams(hf_model, PROMPT, num_beams=num_beams, length_penalty=0.0,
                                max_new_tokens=new_tokens, eos=None)
        assert [list(ids) for ids, _ in got] == rows
        assert [score for _, score in got] == pytest.approx(scores, abs=1e-4)


def reference_diverse(tree, num_groups, penalty, length):
    """Hamming-diversity group search with one beam per group, written as a table of scores."""
    paths = [""] * num_groups
    for _ in range(length):
        counts = {}
        for g in range(num_groups):
            options = list(tree[paths[g]].items())
            scores = [math.log(p) - penalty * counts.get(v, 0) for v, p in options]
            best = scores.index(max(scores))  # the first of equal scores
            token = options[best][0]
            counts[token] = counts.get(token, 0) + 1
            paths[g] += token
    return paths


def random_tree(rng, vocab="abcd", depth=3):
    tree = {}
    for d in range(depth):
        for prefix in itertools.product(vocab, repeat=d):
            weights = [rng.random() + 0.05 for _ in vocab]
            tree["".join(prefix)] = {v: w / sum(weights) for v, w in zip(vocab, weights)}
    return tree


def test_exercise_3_diverse_beam_search_on_a_tree(answers):
    greedy = "aaa"
    assert answers.diverse_beam_search(TREE, 3, 0.0, 3) == [greedy] * 3  # no penalty: every group is greedy
    for penalty in (0.3, 1.0, 5.0):
        assert answers.diverse_beam_search(TREE, 3, penalty, 3) == reference_diverse(TREE, 3, penalty, 3)
    rng = random.Random(0)
    for _ in range(20):
        tree = random_tree(rng)
        groups, penalty = rng.choice([2, 3, 4]), rng.choice([0.0, 0.2, 0.7, 2.0])
        assert answers.diverse_beam_search(tree, groups, penalty, 3) == reference_diverse(tree, groups, penalty, 3)


def test_exercise_3_large_penalty_takes_different_tokens(answers):
    paths = answers.diverse_beam_search(TREE, 3, 100.0, 3)
    for step in range(3):  # all three tokens taken at every step
        assert sorted(p[step] for p in paths) == ["a", "b", "c"]
    # Group 0 is greedy; group 1 takes, step by step, the most probable token that group 0 did not take.
    assert paths[0] == "aaa"
    second = ""
    for step in range(3):
        options = {v: p for v, p in TREE[second].items() if v != paths[0][step]}
        second += max(options, key=options.get)
    assert paths[1] == second


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_exercise_4_what_following_the_beams_copies(answers, kind):
    _, model = tiny_pair(kind)
    c = model.config
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    for beams, steps in ((2, 5), (4, 20), (3, 40)):
        settings = dict(num_beams=beams, num_return_sequences=1, max_new_tokens=steps, eos_token_id=())
        static = beam_search(model, prompts, cache="static", **settings).stats.extra["cache_copied_bytes"]
        blocks = beam_search(model, prompts, cache="blocks", **settings).stats.extra["cache_copied_bytes"]
        contiguous, bound = answers.reorder_copies(c.n_layer, c.kv_heads, c.head_size, 4, [len(p) for p in prompts],
                                                   beams, steps, 16)
        assert contiguous == static, (beams, steps)
        assert blocks <= bound, (beams, steps, blocks, bound)
