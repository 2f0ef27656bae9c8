"""Checks for lesson 00's exercises: minillm's BPE (itself checked against tiktoken) and GPT-2's ranks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import regex

from minillm.model.bpe import GPT2_PATTERN, BytePairEncoding, bpe_merge, spelled_bytes, train_bpe
from minillm.model.tokenizer import gpt2_tokenizer

CORPUS = """Tokenizers turn text into numbers. A byte-pair encoder starts from the 256 bytes and learns merges:
the pair of neighbouring tokens seen most often becomes one token, then the next, until the vocabulary is full.
aaabdaaabac, banana bandana, mississippi."""


def words_of(text: str) -> dict[tuple[bytes, ...], int]:
    counts = {}
    for piece in regex.findall(GPT2_PATTERN, text):
        word = tuple(bytes([b]) for b in piece.encode())
        counts[word] = counts.get(word, 0) + 1
    return counts


def full_count(words: dict[tuple[bytes, ...], int]) -> Counter:
    """Every adjacent pair over the corpus, recounted from scratch: what an update must equal."""
    counts = Counter()
    for word, n in words.items():
        for pair in zip(word, word[1:]):
            counts[pair] += n
    return counts


def test_exercise_1_merge_and_recount_by_hand(answers):
    words = {(b"a", b"a", b"a", b"b", b"d", b"a", b"a", b"a", b"b", b"a", b"c"): 1, (b"x", b"y"): 2}
    counts = full_count(words)
    merged, updated = answers.merge_and_recount(words, counts, (b"a", b"a"))
    assert list(merged) == [(b"aa", b"a", b"b", b"d", b"aa", b"a", b"b", b"a", b"c"), (b"x", b"y")]  # not (a, aa)
    assert dict(updated) == dict(full_count(merged)) and (b"a", b"a") not in updated  # no zero entries left
    assert counts == full_count(words)  # the caller's counts are not changed in place


def test_exercise_1_sixty_merges_keep_the_counts_exact(answers):
    """Following train_bpe's merges on a paragraph, the updated counts equal a full recount after every merge."""
    words = words_of(CORPUS)
    counts = full_count(words)
    _, history = train_bpe(CORPUS, 60)
    for pair, count in history:
        assert counts[pair] == count == max(counts.values())  # the counts say what train_bpe picked, and why
        words, counts = answers.merge_and_recount(words, counts, pair)
        assert dict(counts) == dict(full_count(words)), pair
    assert sum(words.values()) == len(regex.findall(GPT2_PATTERN, CORPUS))  # every word kept, with its count


def test_exercise_2_predicted_merges(answers):
    corpus = "hug hug hug pug pug pun pun pun bun hugs hugs"
    ranks, history = train_bpe(corpus, 5)
    predicted = answers.predict_merges()
    assert [(a.encode(), b.encode()) for a, b in predicted["merges"]] == [pair for pair, _ in history]
    assert list(predicted["counts"]) == [count for _, count in history]
    bpe = BytePairEncoding(ranks)
    assert set(predicted["tokens"]) == {" bug", " hugs", " puns", " gun"}
    for word, tokens in predicted["tokens"].items():
        assert [t.encode() for t in tokens] == [bpe.token_bytes(i) for i in bpe.encode(word)], word


@pytest.fixture(scope="module")
def gpt2_vocab():
    return set(gpt2_tokenizer().encoding._mergeable_ranks)


def reference_longest_match(piece: bytes, vocab) -> list[bytes]:
    for end in range(len(piece), 0, -1):  # the longest prefix in the vocabulary, then the rest
        if piece[:end] in vocab:
            return [piece[:end]] + reference_longest_match(piece[end:], vocab) if end < len(piece) else [piece]
    raise AssertionError("every byte is a token")


def test_exercise_3_longest_match(answers, gpt2_vocab):
    for word in [b" ids", b"GPT", b" unbelievable", b"llama", b"     ", "日本語".encode(), b"x"]:
        assert answers.longest_match(word, gpt2_vocab) == reference_longest_match(word, gpt2_vocab), word
    vocab = {bytes([b]) for b in range(256)} | {b"ab", b"abc", b"bcd"}
    assert answers.longest_match(b"abcd", vocab) == [b"abc", b"d"]  # not ab|cd, not a|bcd: greedy from the left


def test_exercise_3_longest_match_is_lossless(answers, gpt2_vocab):
    rng = random.Random(0)
    for _ in range(200):
        piece = rng.randbytes(rng.randint(1, 30))
        parts = answers.longest_match(piece, gpt2_vocab)
        assert b"".join(parts) == piece and all(part in gpt2_vocab for part in parts)


def test_exercise_3_longest_match_is_not_bpe(answers, gpt2_vocab):
    """Same vocabulary, same bytes back, yet other tokens: on English prose, a few words in a hundred."""
    ranks = gpt2_tokenizer().encoding._mergeable_ranks
    words = set(regex.findall(GPT2_PATTERN, CORPUS + " The embeddings of rare identifiers differ."))
    differ = [w for w in words if answers.longest_match(w.encode(), gpt2_vocab)
              != bpe_merge(w.encode(), lambda a, b: ranks.get(a + b))]
    assert differ and len(differ) < len(words) / 2
    assert answers.longest_match(spelled_bytes("Ġids"), gpt2_vocab) == [b" id", b"s"]  # BPE: " " + "ids"
