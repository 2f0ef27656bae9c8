"""Byte-pair encoding by hand: the byte alphabet, training merges, encoding with ranks, decoding (lesson 00).

A byte-level BPE tokenizer is three small things:

    pieces = pre_tokenize(text)                    # a regex cuts text into words, spaces, punctuation
    parts  = bpe_merge(piece.encode(), rank_of)    # bytes, merged pair by pair, lowest rank first
    ids    = [vocab[part] for part in parts]       # each merged part is one token

Every string is UTF-8 bytes and every byte is a token, so nothing is ever unknown; the merges
learned from a corpus (`train_bpe`: count adjacent pairs, merge the most frequent, repeat)
make frequent byte runs single tokens. A merge's *rank* is when it was learned, and encoding
applies the lowest rank first: a later merge may build on an earlier one, never the other way.

`BytePairEncoding` is the whole tokenizer, from GPT-2's ranks (tiktoken's `gpt2` encoding:
`from_tiktoken`) or from a Hugging Face `tokenizer.json` (SmolLM2's: `from_tokenizer_json`), and
gives the same ids as tiktoken and `tokenizers` (tests/test_00_tokenization.py). It is plain
Python, written to be read: the package encodes with those libraries.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import regex

# GPT-2's pre-tokenization (tiktoken's `gpt2` pat_str; Hugging Face ByteLevel's regex): English
# contractions, an optional space then letters, or digits, or other symbols, then whitespace runs
# (all but their last space, which starts the next word, unless the run ends the text).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
DIGIT = regex.compile(r"(\p{N})")  # SmolLM2 (like StarCoder) isolates every digit before GPT-2's regex


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of each byte as one printable character (the vocabulary files store tokens so).

    Bytes that print as themselves (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) keep their character; the other
    68 (controls, space, DEL, NBSP, soft hyphen) take U+0100 and up, in byte order: space is `Ġ`
    (U+0120), newline `Ċ` (U+010A).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}  # `Ġ` -> 32


def spelled_bytes(token: str) -> bytes:
    """A token as a vocabulary file spells it ("Ġthe") -> its bytes (b" the")."""
    return bytes(BYTE_OF[char] for char in token)


# ---------------------------------------------------------------- training


def merge_pair(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    """Every occurrence of `pair` in `word` joined into one part, left to right."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def pair_counts(words: dict[tuple[bytes, ...], int]) -> Counter:
    """How often each adjacent pair of parts occurs, each word counted as often as it occurs."""
    counts = Counter()
    for word, n in words.items():
        for pair in zip(word, word[1:]):
            counts[pair] += n
    return counts


def train_bpe(text: str, n_merges: int, pattern: str = GPT2_PATTERN) -> tuple[dict[bytes, int], list[tuple]]:
    """Learn up to `n_merges` merges from `text`: count pairs, merge the most frequent, record its rank.

    Pairs never cross a pre-token (a word never merges with the space before the next word but
    one). Ties go to the pair seen first in the text. Returns the ranks (the 256 bytes as 0..255,
    then each merged token in the order it was learned; a token already made by another pair
    keeps its first rank) and the history [(pair, count), ...], one entry per merge.
    """
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(pattern, text))
    ranks = {bytes([b]): b for b in range(256)}
    history = []
    for _ in range(n_merges):
        counts = pair_counts(words)
        if not counts:
            break  # every word is one token
        pair, count = max(counts.items(), key=lambda item: item[1])  # first seen wins a tie
        words = Counter({merge_pair(word, pair): n for word, n in words.items()})
        ranks.setdefault(pair[0] + pair[1], len(ranks))
        history.append((pair, count))
    return ranks, history


# ---------------------------------------------------------------- encoding


def bpe_merge(piece: bytes, rank_of: Callable[[bytes, bytes], int | None]) -> list[bytes]:
    """Split `piece` into bytes, then merge the adjacent pair of lowest rank (leftmost on a tie) until none has one.

    rank_of(left, right): the pair's rank, or None where it may not merge. tiktoken ranks a pair
    by the token it makes (`ranks.get(left + right)`); Hugging Face by the merge list's line
    for exactly that pair.
    """
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        ranked = [(rank, i) for i in range(len(parts) - 1) if (rank := rank_of(parts[i], parts[i + 1])) is not None]
        if not ranked:
            break
        _, i = min(ranked)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


class BytePairEncoding:
    """A byte-level BPE tokenizer: special tokens, pre-tokenization, merges by rank, ids.

    vocab: token bytes -> id (a single byte it lacks is dropped from the text, as `tokenizers` does
    without an unknown token). merges: (left, right) -> rank, or
    None to rank a pair by the id of the token it makes (tiktoken's way, where ids are ranks).
    specials: text -> id, matched whole before anything else (longest first).
    isolate_digits: every digit is its own pre-token (SmolLM2).
    """

    def __init__(self, vocab: dict[bytes, int], pattern: str = GPT2_PATTERN, specials: dict[str, int] | None = None,
                 merges: dict[tuple[bytes, bytes], int] | None = None, isolate_digits: bool = False):
        self.vocab, self.merges, self.isolate_digits = vocab, merges, isolate_digits
        # A byte the vocabulary lacks cannot be spelled; tokenizers drops it (SmolLM2 lacks 21), tiktoken has all.
        self.missing_bytes = frozenset(b for b in range(256) if bytes([b]) not in vocab)
        self.pattern = regex.compile(pattern)
        self.specials = dict(specials or {})
        longest_first = sorted(self.specials, key=len, reverse=True)
        self.special_pattern = regex.compile("|".join(map(regex.escape, longest_first))) if longest_first else None
        self.bytes_of = {i: b for b, i in vocab.items()} | {i: s.encode() for s, i in self.specials.items()}

    def rank_of(self, left: bytes, right: bytes) -> int | None:
        if self.merges is None:
            return self.vocab.get(left + right)
        return self.merges.get((left, right))

    def pre_tokenize(self, text: str) -> list[str]:
        """Text without special tokens -> the pieces BPE merges within."""
        chunks = [c for c in DIGIT.split(text) if c] if self.isolate_digits else [text]
        return [piece for chunk in chunks for piece in self.pattern.findall(chunk)]

    def encode_piece(self, piece: bytes) -> list[int]:
        if self.missing_bytes:
            piece = bytes(b for b in piece if b not in self.missing_bytes)
        return [self.vocab[part] for part in bpe_merge(piece, self.rank_of)]

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text`, special tokens' text encoded as plain text."""
        return [i for piece in self.pre_tokenize(text) for i in self.encode_piece(piece.encode("utf-8"))]

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, each special token's text becoming its one id."""
        if self.special_pattern is None:
            return self.encode_ordinary(text)
        ids, start = [], 0
        for match in self.special_pattern.finditer(text):
            ids += self.encode_ordinary(text[start:match.start()]) + [self.specials[match.group()]]
            start = match.end()
        return ids + self.encode_ordinary(text[start:])

    def token_bytes(self, token_id: int) -> bytes:
        return self.bytes_of[token_id]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.bytes_of[i] for i in ids)

    def decode(self, ids: list[int]) -> str:
        """Bytes joined, then UTF-8; a character cut by the ends of `ids` shows as U+FFFD, as in tiktoken."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @classmethod
    def from_tiktoken(cls, encoding) -> BytePairEncoding:
        """The same tokenizer as a `tiktoken.Encoding` (its ranks are its ids; ranking a pair by the token
        it makes is tiktoken's rule)."""
        return cls(dict(encoding._mergeable_ranks), encoding._pat_str, dict(encoding._special_tokens))

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> BytePairEncoding:
        """The same tokenizer as a Hugging Face byte-level BPE `tokenizer.json` (GPT-2's pre-tokenizer, with
        or without SmolLM2's isolated digits; merges ranked by their line)."""
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        model, pre = spec["model"], spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre])
        kinds = [step.get("type") for step in steps]
        isolate_digits = kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
        if model.get("type") != "BPE" or not (kinds == ["ByteLevel"] or isolate_digits) \
                or not steps[-1].get("use_regex", True) or spec.get("normalizer"):
            raise ValueError(f"{path}: not a byte-level BPE with GPT-2's pre-tokenizer (model "
                             f"{model.get('type')}, pre-tokenizers {kinds}): read it with the tokenizers library")
        vocab = {spelled_bytes(token): i for token, i in model["vocab"].items()}
        lines = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
        merges = {}
        for rank, (left, right) in enumerate(lines):
            merges.setdefault((spelled_bytes(left), spelled_bytes(right)), rank)
        specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        return cls(vocab, GPT2_PATTERN, specials, merges, isolate_digits=bool(isolate_digits))
