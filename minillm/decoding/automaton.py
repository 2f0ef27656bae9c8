"""Regular languages as automata over bytes: a pattern -> a syntax tree -> an NFA -> a DFA.

Constrained decoding (lesson 18) needs one question answered fast: after this text, which bytes
may come next so that the text can still end up in the language? A deterministic finite
automaton (DFA) answers it with one table lookup per byte: `transitions[state, byte]` is the next
state, or -1 where no string of the language continues that way.

    node = parse_regex(r"(yes|no)!{1,3}")     # regex.py; or json_schema.schema_node(schema): the same tree
    dfa = compile_dfa(node)                   # int32 [states, 256] transitions, bool [states] accepting
    dfa.walk(dfa.start, b"ye")                # a state (>= 0): still a prefix of "yes!" ...; -1: dead

Why bytes, not characters. A tokenizer's tokens are byte strings, and byte-level BPE has tokens
that hold half a character (the first byte of "é"). Each character class is turned into the
UTF-8 byte sequences of its code points (`utf8_sequences`), so an automaton over bytes accepts
exactly the UTF-8 encodings of the strings the pattern matches, and a token that stops in the
middle of a character simply lands in a state "inside" that character.

How. Thompson's construction builds a small NFA per syntax node (with empty moves), and the
subset construction turns it into a DFA whose states are sets of NFA states, discovered from the
start state only. A last pass drops every state from which no accepting state can be reached, so
a state that exists is always a viable prefix: that is what makes a token mask exact.

Bounded work. A count copies its item once per count (`x{1000}`, a JSON string's `minLength`), and
the subset construction can need exponentially many states (`(a|b)*a(a|b){20}`), so every compile
runs under a `Budget` of states and seconds (`limits.py` says what the limits are and why).

The regex syntax itself is parsed into these trees in `regex.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .limits import Budget, PatternError, TooLarge

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 cannot encode them
ALL_BYTES = (1 << 256) - 1  # a set of bytes is a 256-bit integer: bit b set = byte b belongs


# ------------------------------------------------------------------ character sets as UTF-8 byte ranges


def normalized(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, merged, disjoint (lo, hi) code point ranges."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def negated(ranges) -> tuple[tuple[int, int], ...]:
    """Every code point not in `ranges`."""
    out, next_free = [], 0
    for lo, hi in normalized(ranges):
        if lo > next_free:
            out.append((next_free, lo - 1))
        next_free = hi + 1
    if next_free <= MAX_CODE_POINT:
        out.append((next_free, MAX_CODE_POINT))
    return tuple(out)


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of code points lo..hi (surrogates skipped) as sequences of byte ranges.

    [(0xC3, 0xC3), (0xA0, 0xBF)] means "byte C3, then a byte in A0..BF". A code point is in lo..hi
    exactly when its encoding matches one of the sequences (RE2's and Rust regex's construction).
    """
    out: list[list[tuple[int, int]]] = []
    pieces = [(lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)]
    for a, b in pieces:
        for start, end in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE_POINT)):
            if max(a, start) <= min(b, end):  # split where the encoded length changes
                _same_length(max(a, start), min(b, end), out)
    return out


def _same_length(lo: int, hi: int, out: list) -> None:
    """lo..hi encode to the same number of bytes: split until every byte position is one range."""
    for i in range(1, len(chr(lo).encode())):
        low_bits = (1 << (6 * i)) - 1  # the bits the last i continuation bytes hold
        if lo & ~low_bits != hi & ~low_bits:
            if lo & low_bits:
                _same_length(lo, lo | low_bits, out)
                _same_length((lo | low_bits) + 1, hi, out)
                return
            if hi & low_bits != low_bits:
                _same_length(lo, (hi & ~low_bits) - 1, out)
                _same_length(hi & ~low_bits, hi, out)
                return
    out.append(list(zip(chr(lo).encode(), chr(hi).encode())))


def byte_set(lo: int, hi: int) -> int:
    """Bytes lo..hi as a 256-bit set."""
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


# ------------------------------------------------------------------ the syntax tree and Thompson's NFA


class NFA:
    """States 0, 1, ...; `edges[s]`: (byte set, target) moves on one byte; `empty[s]`: moves on no byte."""

    def __init__(self, budget: Budget | None = None):
        self.edges: list[list[tuple[int, int]]] = []
        self.empty: list[list[int]] = []
        self.budget = budget or Budget()

    def new_state(self) -> int:
        if len(self.edges) % 4096 == 0:
            if len(self.edges) >= self.budget.max_nfa_states:
                raise TooLarge("nfa_states", f"the pattern needs more than {self.budget.max_nfa_states:,} automaton "
                                             "states: a count (x{n}, minLength, maxItems ...) copies its item once per "
                                             "count; use smaller counts")
            self.budget.check("Thompson's construction")
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1


class Node:
    """A piece of a pattern. `build` adds its NFA to `nfa` and returns (entry state, exit state)."""

    def build(self, nfa: NFA) -> tuple[int, int]:
        raise NotImplementedError


@dataclass(frozen=True)
class Chars(Node):
    """One character out of a set of code point ranges."""

    ranges: tuple[tuple[int, int], ...]

    def build(self, nfa):
        start, end = nfa.new_state(), nfa.new_state()
        for lo, hi in self.ranges:
            for sequence in utf8_sequences(lo, hi):
                state = start
                for k, (a, b) in enumerate(sequence):
                    target = end if k == len(sequence) - 1 else nfa.new_state()
                    nfa.edges[state].append((byte_set(a, b), target))
                    state = target
        return start, end


@dataclass(frozen=True)
class Group(Node):
    items: tuple[Node, ...]


class Seq(Group):
    """The items one after another: each one's exit moves, on no byte, into the next one's entry."""

    def build(self, nfa):
        start = state = nfa.new_state()
        for item in self.items:
            entry, state_after = item.build(nfa)
            nfa.empty[state].append(entry)
            state = state_after
        return start, state


class Alt(Group):
    """One of the items: a fork into every item's entry, every exit joined into one."""

    def build(self, nfa):
        built = [item.build(nfa) for item in self.items]  # (entry, exit) of each
        start, end = nfa.new_state(), nfa.new_state()
        nfa.empty[start] += [entry for entry, _ in built]
        for _, exit_ in built:
            nfa.empty[exit_].append(end)
        return start, end


@dataclass(frozen=True)
class Repeat(Node):
    """item{least, most}; most None: unbounded."""

    item: Node
    least: int = 0
    most: int | None = None

    def build(self, nfa):
        start = state = nfa.new_state()
        for _ in range(self.least):  # the copies that must be there
            entry, exit_ = self.item.build(nfa)
            nfa.empty[state].append(entry)
            state = exit_
        end = nfa.new_state()
        nfa.empty[state].append(end)
        if self.most is None:  # a loop: one more copy that may run again and again
            entry, exit_ = self.item.build(nfa)
            nfa.empty[state].append(entry)
            nfa.empty[exit_] += [entry, end]
        else:
            for _ in range(self.most - self.least):  # optional copies, each may end the repetition
                entry, exit_ = self.item.build(nfa)
                nfa.empty[state].append(entry)
                nfa.empty[exit_].append(end)
                state = exit_
        return start, end


@dataclass(frozen=True)
class Separated(Node):
    """least..most items with a separator between them (a JSON array's elements, an object's members).

    Unbounded, one copy of the item serves every element (its exit loops back through the
    separator), which keeps nested structures linear in size where a regex would copy them.
    """

    item: Node
    separator: Node
    least: int = 0
    most: int | None = None

    def build(self, nfa):
        if self.most is not None or self.least > 1:  # bounded: the copies a count needs
            if self.most == 0:
                return Seq(()).build(nfa)
            rest = Repeat(Seq((self.separator, self.item)), max(self.least - 1, 0),
                          None if self.most is None else self.most - 1)
            some = Seq((self.item, rest))
            return (Alt((Seq(()), some)) if self.least == 0 else some).build(nfa)
        start, end = nfa.new_state(), nfa.new_state()
        entry, exit_ = self.item.build(nfa)
        sep_entry, sep_exit = self.separator.build(nfa)
        nfa.empty[start].append(entry)
        if self.least == 0:
            nfa.empty[start].append(end)
        nfa.empty[exit_] += [end, sep_entry]
        nfa.empty[sep_exit].append(entry)
        return start, end


def literal(text: str) -> Node:
    return Seq(tuple(Chars(((ord(c), ord(c)),)) for c in text))


# ------------------------------------------------------------------ the DFA


@dataclass
class DFA:
    """transitions int32 [S, 256] (-1: no string of the language continues so), accepting bool [S]; start 0.

    Every state can still reach an accepting one: a state is a viable prefix.
    """

    transitions: np.ndarray
    accepting: np.ndarray
    start: int = 0

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data` from `state`, or -1 once no string of the language can follow."""
        for byte in data:
            if state < 0:
                return -1
            state = int(self.transitions[state, byte])
        return state

    def accepts(self, data: bytes) -> bool:
        state = self.walk(self.start, data)
        return state >= 0 and bool(self.accepting[state])

    def is_complete(self, state: int) -> bool:
        """Accepting with no way to continue: the text is whole and nothing may follow."""
        return bool(self.accepting[state]) and bool((self.transitions[state] < 0).all())


def compile_dfa(node: Node, budget: Budget | None = None) -> DFA:
    """Thompson's NFA of `node`, then the subset construction, then only states that can still accept; within
    `budget` (the default limits when None)."""
    budget = budget or Budget()
    nfa = NFA(budget)
    entry, accept = node.build(nfa)
    closures: dict[int, frozenset[int]] = {}

    def closure_of(state: int) -> frozenset[int]:
        if state not in closures:
            seen, stack = {state}, [state]
            while stack:
                for target in nfa.empty[stack.pop()]:
                    if target not in seen:
                        seen.add(target)
                        stack.append(target)
            closures[state] = frozenset(seen)
        return closures[state]

    def dfa_state(states) -> frozenset[int]:
        """The set of NFA states after empty moves, kept to those that matter (a byte move or the accept)."""
        reached = frozenset().union(*(closure_of(s) for s in states))
        return frozenset(s for s in reached if nfa.edges[s] or s == accept)

    first = dfa_state([entry])
    ids, order, rows = {first: 0}, [first], []
    while len(rows) < len(order):
        if len(order) > budget.max_dfa_states:
            raise TooLarge("dfa_states", f"the automaton passed {budget.max_dfa_states:,} states: a count (x{{n}}, "
                                         "minLength, maxItems ...) copies its item once per count, and an "
                                         "alternative followed by a count can double the states per step; use "
                                         "smaller counts or a simpler pattern")
        if len(rows) % 64 == 0:
            budget.check("the subset construction")
        moves: dict[int, set[int]] = {}  # byte set -> targets
        for state in order[len(rows)]:
            for bytes_, target in nfa.edges[state]:
                moves.setdefault(bytes_, set()).add(target)
        classes = [ALL_BYTES]  # split the 256 bytes into classes that every move treats alike
        for bytes_ in moves:
            classes = [part for c in classes for part in (c & bytes_, c & ~bytes_ & ALL_BYTES) if part]
        row = np.full(256, -1, dtype=np.int32)
        for byte_class in classes:
            targets = set().union(*(t for bytes_, t in moves.items() if bytes_ & byte_class))
            if not targets:
                continue
            target = dfa_state(targets)
            if target not in ids:
                ids[target] = len(order)
                order.append(target)
            row[members(byte_class)] = ids[target]
        rows.append(row)
    transitions = np.stack(rows)
    accepting = np.array([accept in s for s in order])
    return pruned(transitions, accepting)


def members(byte_class: int) -> np.ndarray:
    """bool [256]: the bytes of a byte set (bit b set = byte b)."""
    return np.unpackbits(np.frombuffer(byte_class.to_bytes(32, "little"), dtype=np.uint8), bitorder="little") == 1


def can_accept(transitions: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """bool [S]: the states from which some string reaches an accepting state. A search backwards from the
    accepting states over the distinct (state, next state) moves: linear in the moves, where growing the set one
    step at a time would take as many passes over the table as the longest path has steps."""
    states = len(accepting)
    source, byte = np.nonzero(transitions >= 0)
    moves = np.unique(source.astype(np.int64) * states + transitions[source, byte])
    source, target = moves // states, moves % states
    by_target = np.argsort(target, kind="stable")
    sources, starts = source[by_target], np.searchsorted(target[by_target], np.arange(states + 1))
    live = accepting.copy()
    stack = np.nonzero(accepting)[0].tolist()
    while stack:
        state = stack.pop()
        for before in sources[starts[state]:starts[state + 1]].tolist():
            if not live[before]:
                live[before] = True
                stack.append(before)
    return live


def pruned(transitions: np.ndarray, accepting: np.ndarray) -> DFA:
    """Drop the states from which no accepting state can be reached (renumbered, the start kept at 0)."""
    live = can_accept(transitions, accepting)
    if not live[0]:
        raise PatternError("the pattern matches no string: there is nothing to generate")
    new_id = np.cumsum(live) - 1  # old state -> new state, for live ones
    kept = transitions[live]
    kept = np.where((kept >= 0) & live[kept.clip(min=0)], new_id[kept.clip(min=0)], -1).astype(np.int32)
    return DFA(kept, accepting[live])


__all__ = ["Alt", "Chars", "DFA", "NFA", "Node", "PatternError", "Repeat", "Separated", "Seq", "compile_dfa", "literal",
           "negated", "normalized", "utf8_sequences"]
