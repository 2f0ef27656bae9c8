"""Lesson 00 exercises: write your answers here; `pytest lessons/00-tokenization` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/00_tokenization.py
(try first: `pytest lessons/00-tokenization --solutions` runs the checks on them).
"""

from __future__ import annotations

from collections import Counter  # noqa: F401
from collections.abc import Collection


def merge_and_recount(words: dict[tuple[bytes, ...], int], counts: Counter,
                      pair: tuple[bytes, bytes]) -> tuple[dict[tuple[bytes, ...], int], Counter]:
    """Exercise 1: Merge one pair, recount only what changed

    The notebook's `train` recounts every pair of the corpus after every merge. Real trainers count
    once, then for each merge touch only the words that contain the merged pair: take away such a
    word's pairs (times its count), merge, add the new word's pairs. Written without minillm.model.bpe.

    words: each pre-token of the corpus as a tuple of its current parts -> how often it occurs, e.g.
      {(b"h", b"u", b"g"): 3, (b" ", b"p", b"u", b"g"): 2, ...}.
    counts: every adjacent pair of parts -> how often it occurs over `words` (each word's pairs
      counted as often as the word occurs); a Counter without zero entries.
    pair: the pair to merge. Merge every occurrence of it in every word, left to right without
      overlap: (a, a, a) with the pair (a, a) becomes (aa, a).
    Returns (the new words dict, in the same order; the new counts, without zero entries), the counts
    updated from the words that contained the pair only.
    """
    raise NotImplementedError


def predict_merges() -> dict:
    """Exercise 2: Predict the merges

    Work it out on paper first, then write the answer down as literals (running train_bpe is
    checking, not predicting). The corpus, cut by GPT-2's pre-tokenizer (a space starts a word):

        "hug hug hug pug pug pun pun pun bun hugs hugs"
        -> "hug" once, " hug" twice, " pug" twice, " pun" three times, " bun" once, " hugs" twice

    Training counts adjacent pairs within each piece, merges the most frequent (on a tie: the pair
    seen first, reading the pieces in order, each left to right), and repeats.
    Returns {"merges": the first five merged pairs as (left, right) strings, e.g. ("u", "g"),
    "counts": how often each of them occurred when it was picked,
    "tokens": {word: its tokens as strings, encoded with exactly those five merges,
               for the words " bug", " hugs", " puns", " gun"}}.
    """
    raise NotImplementedError


def longest_match(piece: bytes, vocab: Collection[bytes]) -> list[bytes]:
    """Exercise 3: Longest match instead of merges

    Break BPE on purpose: tokenize by taking, from the start of the piece, the longest prefix that is
    in the vocabulary, then the longest one after it, and so on (WordPiece-style greedy matching).
    Every single byte is in `vocab`, so this always succeeds and loses nothing.

    piece: one pre-token's bytes. vocab: the token bytes of a byte-level vocabulary (GPT-2's ranks).
    Returns the parts, left to right; b"".join(parts) == piece.
    Then compare with BPE: same vocabulary, same text, same bytes back. Which words split
    differently, and why would a model trained on BPE's splits care?
    """
    raise NotImplementedError
