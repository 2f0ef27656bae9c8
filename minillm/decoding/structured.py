"""Structured output: which tokens keep the text inside a language, as a mask over the vocabulary.

    index = token_index("json_schema", json.dumps(schema), tokenizer, vocab_size)   # compiled once, cached
    constraint = Constraint(index)           # one per sequence: where its text stands in the automaton
    allowed = constraint.mask()              # bool [V]: the tokens that keep a viable prefix (+ EOS if whole)
    logits = apply_token_mask(logits, allowed[None])    # one more logits processor, greedy and sampling alike
    constraint.advance(token)                # the chosen token's bytes walked through the automaton

The automaton is a DFA over bytes (`minillm.decoding.automaton`, from a regex or a JSON schema,
`minillm.decoding.json_schema`). A token is allowed in state s exactly when walking its bytes from
s never falls off the automaton: every state that exists can still reach an accepting one, so the
text stays a prefix of some string of the language. EOS is allowed only in accepting states.
Special tokens (chat markers, EOS itself) have no text: never allowed as text.

The cost. A state's mask walks every token's bytes: all tokens at once, one byte position at a
time (`TokenIndex.next_states`: a gather in the transition table per position, the longest tokens
last), so a new state costs a few vectorised passes over the vocabulary. Masks are cached per
state as they are met, so a schema's fixed parts (keys, punctuation) cost nothing the second
time; `precompute` fills every state ahead (outlines builds its whole index up front; xgrammar
precomputes the masks of tokens that do not depend on the stack and checks the rest at run time).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from .automaton import DFA, compile_dfa
from .json_schema import schema_dfa
from .limits import Budget
from .regex import parse_regex

CACHE_SIZE = 32  # compiled (schema or regex, vocabulary) pairs kept


class StructuredOutputError(ValueError):
    """A constraint the vocabulary cannot follow (or a schema / regex outside the supported subset)."""


def special_token_ids(tokenizer) -> set[int]:
    """Tokens that stand for no text (chat markers, EOS): those of a `tokenizers` or tiktoken vocabulary, or a
    tokenizer's own `special_token_ids`, plus its EOS."""
    ids = set(getattr(tokenizer, "special_token_ids", ()))
    inner = getattr(tokenizer, "tokenizer", None)
    if hasattr(inner, "get_added_tokens_decoder"):
        ids |= {i for i, token in inner.get_added_tokens_decoder().items() if token.special}
    encoding = getattr(tokenizer, "encoding", None)
    if encoding is not None and hasattr(encoding, "special_tokens_set"):
        ids |= {encoding.encode_single_token(text) for text in encoding.special_tokens_set}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Vocabulary:
    """Every token's bytes, laid out for walking them all at once.

    table uint8 [N, L]: the N usable tokens' bytes, longest first, zero-padded; `active[j]`: how many
    of them have a byte at position j (a prefix of the table, as it is sorted by length). Tokens with
    no bytes (special ones, ids past the tokenizer's vocabulary) are never allowed as text.
    """

    def __init__(self, token_bytes: list[bytes | None], eos_ids):
        self.size, self.token_bytes, self.eos_ids = len(token_bytes), token_bytes, frozenset(eos_ids)
        usable = sorted((i for i, data in enumerate(token_bytes) if data), key=lambda i: -len(token_bytes[i]))
        self.order = np.array(usable, dtype=np.int64)  # table row -> token id
        lengths = np.array([len(token_bytes[i]) for i in usable])
        width = int(lengths.max()) if usable else 0
        padded = b"".join(token_bytes[i].ljust(width, b"\0") for i in usable)
        self.table = np.frombuffer(padded, dtype=np.uint8).reshape(len(usable), width)
        self.active = [int((lengths > j).sum()) for j in range(width)]
        self.single_bytes = {data[0] for data in token_bytes if data and len(data) == 1}

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> "Vocabulary":
        """The model's vocabulary (vocab_size rows, which may outnumber the tokenizer's tokens)."""
        special = special_token_ids(tokenizer)
        known = getattr(tokenizer, "vocab_size", vocab_size)
        token_bytes = [None if i in special or i >= known else tokenizer.token_bytes(i) or None
                       for i in range(vocab_size)]
        eos = getattr(tokenizer, "eos_token_id", None)
        return cls(token_bytes, () if eos is None else (eos,))


class TokenIndex:
    """A DFA over a vocabulary: per state, the state each token leads to, and the mask of allowed tokens.

    Bytes versus tokens. Every DFA state can be completed by some bytes; it can be completed by
    tokens too when the vocabulary has a token for every single byte (byte-level BPE has; so has
    sentencepiece's byte fallback). Where it lacks one the automaton needs, a state may be a byte
    prefix no token sequence can finish: then the states tokens can finish are found once, over the
    whole automaton (`token_live`), and a token is allowed only where it leads to one of them.
    """

    def __init__(self, dfa: DFA, vocabulary: Vocabulary, budget: Budget | None = None):
        self.dfa, self.vocabulary = dfa, vocabulary
        dead = dfa.num_states  # one more state that every missing move leads to, and never leaves
        self.moves = np.vstack([np.where(dfa.transitions < 0, dead, dfa.transitions),
                                np.full((1, 256), dead)]).astype(np.int32)  # [S + 1, 256]
        self.masks: dict[int, torch.Tensor] = {}
        used = set(np.nonzero((dfa.transitions >= 0).any(axis=0))[0].tolist())
        self.live = None if used <= vocabulary.single_bytes else self.token_live(budget or Budget())  # or None: all

    def token_live(self, budget: Budget) -> np.ndarray:
        """bool [S]: the states some sequence of tokens leads to an accepting state from (a fixed point); a walk
        of the whole vocabulary per state, so it runs within the compile's budget."""
        after = []
        for state in range(self.dfa.num_states):
            if state % 64 == 0:
                budget.check("which states tokens can finish")
            after.append(self.byte_next_states(state))
        live = self.dfa.accepting.copy()
        while True:
            grown = live | np.array([bool(live[targets[targets >= 0]].any()) for targets in after])
            if (grown == live).all():
                return live
            live = grown

    def next_states(self, state: int) -> np.ndarray:
        """int32 [V]: the state after each token's bytes from `state`; -1 where the token is not allowed."""
        targets = self.byte_next_states(state)
        if self.live is not None:
            targets = np.where((targets >= 0) & self.live[targets.clip(min=0)], targets, -1)
        return targets

    def byte_next_states(self, state: int) -> np.ndarray:
        """int32 [V]: the state after each token's bytes from `state`; -1 where the bytes leave the automaton."""
        vocab, dead = self.vocabulary, self.dfa.num_states
        current = np.full(len(vocab.order), state, dtype=np.int32)  # one walker per token, longest first
        for position, n in enumerate(vocab.active):  # tokens with a byte at this position are a prefix
            current[:n] = self.moves[current[:n], vocab.table[:n, position]]
        out = np.full(vocab.size, -1, dtype=np.int32)
        out[vocab.order] = np.where(current == dead, -1, current)
        return out

    def mask(self, state: int) -> torch.Tensor:
        """bool [V]: the tokens allowed in `state` (EOS where the text is whole); cached per state."""
        if state not in self.masks:
            allowed = self.next_states(state) >= 0  # numpy throughout: a torch reduction here costs more than the walk
            if self.dfa.accepting[state]:
                allowed[list(self.vocabulary.eos_ids)] = True
            if not allowed.any():
                raise StructuredOutputError(f"no token of this vocabulary continues the constrained text from "
                                            f"state {state} (and EOS is not set)")
            self.masks[state] = torch.from_numpy(allowed)
        return self.masks[state]

    def precompute(self) -> None:
        """Every state's mask now (what a server might do before the first request)."""
        for state in range(self.dfa.num_states):
            self.mask(state)

    def next_state(self, state: int, token: int) -> int:
        data = self.vocabulary.token_bytes[token] if token < self.vocabulary.size else None
        target = self.dfa.walk(state, data) if data else -1
        return target if target < 0 or self.live is None or self.live[target] else -1


class Constraint:
    """One sequence's place in its automaton."""

    def __init__(self, index: TokenIndex):
        self.index, self.state = index, index.dfa.start

    def mask(self) -> torch.Tensor:
        return self.index.mask(self.state)

    def advance(self, token: int) -> None:
        if token in self.index.vocabulary.eos_ids:
            return
        state = self.index.next_state(self.state, token)
        if state < 0:
            raise StructuredOutputError(f"token {token} ({self.index.vocabulary.token_bytes[token]!r}) leaves the "
                                        f"constrained language: it was not allowed")
        self.state = state

    @property
    def complete(self) -> bool:
        """The text is whole and nothing may follow it: the sequence can stop."""
        return self.index.dfa.is_complete(self.state)


def apply_token_mask(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """The structured-output processor: tokens outside `allowed` (bool [B, V]) get -inf."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), -float("inf"))


# ------------------------------------------------------------------ compiling once per (constraint, vocabulary)


_lock = threading.Lock()
_vocabularies: dict[tuple[int, int], tuple[object, Vocabulary]] = {}
_indexes: OrderedDict = OrderedDict()


def vocabulary_for(tokenizer, vocab_size: int) -> Vocabulary:
    key = (id(tokenizer), vocab_size)
    with _lock:
        held = _vocabularies.get(key)
    if held is not None and held[0] is tokenizer:
        return held[1]
    vocabulary = Vocabulary.of(tokenizer, vocab_size)
    with _lock:
        _vocabularies[key] = (tokenizer, vocabulary)  # the tokenizer is held so its id stays its own
    return vocabulary


_dfas: OrderedDict = OrderedDict()


def cached(cache: OrderedDict, key, build):
    """cache[key], or build() kept there (least recently used out first): built outside the lock, since a compile
    can take seconds and other schemas' requests should not wait for it."""
    with _lock:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = build()
    with _lock:
        value = cache.setdefault(key, value)
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return value


def constraint_dfa(kind: str, source: str, cancelled: threading.Event | None = None) -> DFA:
    """kind "json_schema" (source: the schema as JSON text), "json_schema_or_text" (that, or text not beginning
    with "{": a tool call or a reply) or "regex", compiled within the automaton's limits
    (`Budget`; `cancelled` stops it early) and cached, as the command line checks a constraint before the model
    loads and `token_index` builds the same automaton after."""
    if kind not in ("json_schema", "json_schema_or_text", "regex"):
        raise StructuredOutputError(f"unknown constraint kind {kind!r}: use json_schema, json_schema_or_text or regex")
    budget = Budget(cancelled=cancelled)
    return cached(_dfas, (kind, source), lambda: compile_dfa(parse_regex(source), budget) if kind == "regex"
                  else schema_dfa(json.loads(source), budget, or_text=kind == "json_schema_or_text"))


def token_index(kind: str, source: str, tokenizer, vocab_size: int,
                cancelled: threading.Event | None = None) -> TokenIndex:
    """The compiled index of a schema or regex over a tokenizer's vocabulary, cached (least recently used);
    `cancelled` stops the compile early (`limits.Cancelled`)."""
    vocabulary = vocabulary_for(tokenizer, vocab_size)
    return cached(_indexes, (kind, source, id(vocabulary)), lambda: TokenIndex(
        constraint_dfa(kind, source, cancelled), vocabulary, Budget(cancelled=cancelled)))


def constraint_for(config, tokenizer, vocab_size: int) -> Constraint | None:
    """A sequence's constraint from its settings (`json_schema` or `regex`), or None when it has none."""
    if config.constraint is None:
        return None
    if tokenizer is None:
        raise StructuredOutputError("structured output (json_schema, regex) needs a tokenizer: pass tokenizer=...")
    return Constraint(token_index(*config.constraint, tokenizer, vocab_size))


__all__ = ["Constraint", "StructuredOutputError", "TokenIndex", "Vocabulary", "apply_token_mask", "constraint_dfa",
           "constraint_for", "special_token_ids", "token_index", "vocabulary_for"]
