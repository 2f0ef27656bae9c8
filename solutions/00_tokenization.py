"""Worked answers for lesson 00 (checked by `pytest lessons/00-tokenization --solutions`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection


def merge_step(words: dict[tuple[bytes, ...], int]) -> tuple[tuple[bytes, bytes], dict[tuple[bytes, ...], int]] | None:
    """Exercise 1: One merge step"""
    counts = Counter()  # insertion order = the order pairs are first seen
    for word, n in words.items():
        for pair in zip(word, word[1:]):
            counts[pair] += n
    if not counts:
        return None
    pair = max(counts, key=counts.get)  # max keeps the first of equal counts: the pair seen first
    merged = {}
    for word, n in words.items():
        parts, i = [], 0
        while i < len(word):
            if word[i:i + 2] == pair:  # a tuple slice: the two parts at i and i + 1
                parts.append(pair[0] + pair[1])
                i += 2  # skip both: (a, a, a) -> (aa, a), never (a, aa)
            else:
                parts.append(word[i])
                i += 1
        merged[tuple(parts)] = n
    return pair, merged


def predict_merges() -> dict:
    """Exercise 2: Predict the merges"""
    # Pieces: hug x1, " hug" x2, " pug" x2, " pun" x3, " bun" x1, " hugs" x2.
    # Step 1: u+g occurs in hug (1), " hug" (2), " pug" (2), " hugs" (2) = 7; the runners-up have 5
    #   (h+u, " "+p, p+u), so no tie to break yet.
    # Step 2: pieces are now h|ug, " "|h|ug, " "|p|ug, " "|p|u|n, " "|b|u|n, " "|h|ug|s.
    #   h+ug: 1 + 2 + 2 = 5; " "+p: 2 + 3 = 5; a tie, and h+ug is seen first (in "hug").
    # Step 3: " "+p: 5 beats " "+hug (4), u+n (4).
    # Step 4: " "+hug: 2 + 2 = 4 ties u+n: 3 + 1 = 4; " hug" comes before " pun" in the corpus.
    # Step 5: u+n: 4 (the " p"|u|n pieces and " "|b|u|n); " p"+ug is only 2, " hug"+s 2.
    merges = [("u", "g"), ("h", "ug"), (" ", "p"), (" ", "hug"), ("u", "n")]
    counts = [7, 5, 5, 4, 4]
    # Encoding applies the lowest-ranked pair first: " bug" -> " "|b|ug (no " "+b, no b+ug merge);
    # " hugs" -> " hug"|s; " puns" -> " p"|un|s (" p"+un would be merge 6); " gun" -> " "|g|un.
    tokens = {" bug": [" ", "b", "ug"], " hugs": [" hug", "s"], " puns": [" p", "un", "s"], " gun": [" ", "g", "un"]}
    return {"merges": merges, "counts": counts, "tokens": tokens}


def longest_match(piece: bytes, vocab: Collection[bytes]) -> list[bytes]:
    """Exercise 3: Longest match instead of merges"""
    vocab = vocab if isinstance(vocab, (set, frozenset, dict)) else set(vocab)
    longest = max(map(len, vocab))
    parts, start = [], 0
    while start < len(piece):
        end = min(len(piece), start + longest)
        while piece[start:end] not in vocab:  # every single byte is in the vocabulary: this stops
            end -= 1
        parts.append(piece[start:end])
        start = end
    # The splits are valid tokens and decode to the same bytes, but they are not the ones BPE
    # produces: " ids" becomes " id"|s where GPT-2's merges give " "|ids. A model only ever saw
    # BPE's splits during training, so the same text in other tokens is an input it never met:
    # the notebook measures how much its loss rises.
    return parts
