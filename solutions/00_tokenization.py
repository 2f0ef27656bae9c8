"""Worked answers for lesson 00 (checked by `pytest lessons/00-tokenization --solutions`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection


def merge_and_recount(words: dict[tuple[bytes, ...], int], counts: Counter,
                      pair: tuple[bytes, bytes]) -> tuple[dict[tuple[bytes, ...], int], Counter]:
    """Exercise 1: Merge one pair, recount only what changed"""
    counts = Counter(counts)  # a copy: the caller's counts stay as they were
    merged = {}
    for word, n in words.items():
        if pair in zip(word, word[1:]):  # only these words' pairs change
            for old in zip(word, word[1:]):
                counts[old] -= n
            parts, i = [], 0
            while i < len(word):
                if word[i:i + 2] == pair:  # a tuple slice: the two parts at i and i + 1
                    parts.append(pair[0] + pair[1])
                    i += 2  # skip both: (a, a, a) -> (aa, a), never (a, aa)
                else:
                    parts.append(word[i])
                    i += 1
            word = tuple(parts)
            for new in zip(word, word[1:]):
                counts[new] += n
        merged[word] = n  # two words never merge into one: different keys spell different bytes
    # A merge takes away as many pairs as it adds only where the pair was; the rest of the corpus was
    # never read again. On a real corpus most words hold none of the pair being merged, which is why
    # trainers (Hugging Face tokenizers, minbpe's fast version) keep counts this way and index which
    # words hold each pair, so that even finding them is not a scan.
    return merged, +counts  # unary plus drops the pairs whose count fell to zero


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
