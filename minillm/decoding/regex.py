"""A regex parser: Python's `re` syntax turned into the byte automaton's syntax tree (automaton.py).

The regex dialect is Python's `re` with `re.ASCII` meanings for \\d \\w \\s (the tests check it
against `re.fullmatch`): literals, escapes, `.`, classes with ranges and negation, groups,
alternation, `* + ? {m} {m,} {m,n}` (lazy forms match the same language), ^ and $ at the ends.
Lookaround, backreferences and word boundaries are not regular (or not here): refused by name.
"""

from __future__ import annotations

from .automaton import DFA, Alt, Chars, Node, PatternError, Repeat, Seq, compile_dfa, literal, negated, normalized

DIGIT = ((ord("0"), ord("9")),)
WORD = normalized([(ord("a"), ord("z")), (ord("A"), ord("Z")), *DIGIT, (ord("_"), ord("_"))])
SPACE = normalized([(ord(c), ord(c)) for c in " \t\n\r\f\v"])
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": negated(DIGIT), "W": negated(WORD), "S": negated(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
ANY_BUT_NEWLINE = negated([(10, 10)])


def parse_regex(pattern: str) -> Node:
    """A Python regex (see the module docstring for the dialect) as a syntax tree; fullmatch semantics."""
    return RegexParser(pattern).parse()


class RegexParser:
    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def fail(self, what: str):
        raise PatternError(f"regex {self.pattern!r} at position {self.pos}: {what}")

    def peek(self, text: str = "") -> bool:
        return self.pattern.startswith(text, self.pos) if text else self.pos < len(self.pattern)

    def take(self) -> str:
        if self.pos >= len(self.pattern):
            self.fail("unexpected end of the pattern")
        self.pos += 1
        return self.pattern[self.pos - 1]

    def parse(self) -> Node:
        node = self.alternation()
        if self.peek():
            self.fail(f"unbalanced {self.pattern[self.pos]!r}")
        return node

    def alternation(self) -> Node:
        items = [self.sequence()]
        while self.peek("|"):
            self.pos += 1
            items.append(self.sequence())
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def sequence(self) -> Node:
        items = []
        while self.peek() and not self.peek("|") and not self.peek(")"):
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantified(self) -> Node:
        node = self.atom()
        while self.peek():
            char = self.pattern[self.pos]
            if char in "*+?":
                self.pos += 1
                node = Repeat(node, 1 if char == "+" else 0, 1 if char == "?" else None)
            elif char == "{" and (counts := self.counts()) is not None:
                node = Repeat(node, *counts)
            else:
                break
            if self.peek("?"):  # lazy: another order of search, the same language
                self.pos += 1
            elif self.peek("+"):
                self.fail("possessive quantifiers are not supported")
        return node

    def counts(self) -> tuple[int, int | None] | None:
        """{m}, {m,}, {m,n} at the position (consumed), or None where "{" is a literal brace."""
        end = self.pattern.find("}", self.pos)
        body = self.pattern[self.pos + 1:end] if end > 0 else ""
        least, comma, most = body.partition(",")
        if not least.isdigit() or (most and not most.isdigit()):
            return None
        self.pos = end + 1
        counts = (int(least), int(most) if most else (None if comma else int(least)))
        if counts[1] is not None and counts[1] < counts[0]:
            self.fail(f"{{{body}}}: the maximum is below the minimum")
        return counts

    def atom(self) -> Node:
        start = self.pos
        char = self.take()
        if char == "(":
            if self.peek("?:"):
                self.pos += 2
            elif self.peek("?P<"):
                self.pos = self.pattern.index(">", self.pos) + 1
            elif self.peek("?"):
                self.fail("lookaround, flags and other (?...) groups are not supported")
            node = self.alternation()
            if not self.peek(")"):
                self.fail("missing )")
            self.pos += 1
            return node
        if char == "[":
            return Chars(self.char_class())
        if char == ".":
            return Chars(ANY_BUT_NEWLINE)
        if char == "^" and start == 0 or char == "$" and self.pos == len(self.pattern):
            return Seq(())  # anchors at the ends: the match is whole anyway
        if char in "^$":
            self.fail(f"{char!r} inside a pattern is not supported (only at its ends)")
        if char in "*+?)":
            self.fail(f"nothing to repeat or close at {char!r}")
        if char == "\\":
            escaped = self.escape()
            return Chars(escaped) if isinstance(escaped, tuple) else literal(escaped)
        return literal(char)

    def escape(self) -> tuple | str:
        """After a backslash: a class (tuple of ranges) or one character (str)."""
        char = self.take()
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char in CHAR_ESCAPES:
            return CHAR_ESCAPES[char]
        if char in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[char]
            digits = self.pattern[self.pos:self.pos + width]
            if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                self.fail(f"\\{char} needs {width} hex digits")
            self.pos += width
            return chr(int(digits, 16))
        if char.isalnum():
            self.fail(f"\\{char} (backreferences, word boundaries, ...) is not supported")
        return char

    def char_class(self) -> tuple[tuple[int, int], ...]:
        negate = self.peek("^")
        self.pos += negate
        ranges, first = [], True
        while first or not self.peek("]"):
            first = False
            if not self.peek():
                self.fail("missing ]")
            low = self.class_item()
            if isinstance(low, tuple):
                ranges += low
                continue
            if self.peek("-") and not self.peek("-]"):
                self.pos += 1
                high = self.class_item()
                if isinstance(high, tuple) or ord(high) < ord(low):
                    self.fail(f"bad range {low!r}-{high!r}")
                ranges.append((ord(low), ord(high)))
            else:
                ranges.append((ord(low), ord(low)))
        self.pos += 1
        return negated(ranges) if negate else normalized(ranges)

    def class_item(self) -> tuple | str:
        char = self.take()
        if char == "\\" and self.peek("b"):  # inside a class, \b is the backspace character
            self.pos += 1
            return "\b"
        return self.escape() if char == "\\" else char


def regex_dfa(pattern: str) -> DFA:
    return compile_dfa(parse_regex(pattern))


__all__ = ["parse_regex", "regex_dfa"]
