"""What compiling a pattern may spend (a `Budget` of states and seconds, a flag that stops it) and its errors.

A count copies its item once per count (`x{1000}`, a JSON string's `minLength`), and the subset
construction can need exponentially many states (`(a|b)*a(a|b){20}`), so a pattern can ask for more
than any request should get. Every compile (`automaton.compile_dfa`, and a token index's walk over the
vocabulary) runs under a `Budget`: at most `MAX_NFA_STATES` and `MAX_DFA_STATES` states and
`MAX_SECONDS` of work, and it stops at once when its `cancelled` event is set (the server sets it when
the request goes away or the server stops). Past a limit it raises `TooLarge`, which says which limit
and how to stay under it. (xgrammar keeps a pushdown automaton and counts on a stack instead of
unrolled copies; outlines builds its whole index up front, so its compile time grows with the same
counts.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

MAX_NFA_STATES = 200_000  # about 2 s of Thompson's construction on a 2-core CPU
MAX_DFA_STATES = 20_000  # about 2 s of the subset construction (a 2,000-character minLength needs 48,000)
MAX_SECONDS = 10.0  # for anything the two counts let through (a state of many NFA states costs more)


class PatternError(ValueError):
    """A pattern this module cannot turn into an automaton; the message names what and where."""


class TooLarge(PatternError):
    """A pattern whose automaton would pass one of its `Budget`'s limits; `limit` names which."""

    def __init__(self, limit: str, message: str):
        super().__init__(message)
        self.limit = limit


class Cancelled(Exception):
    """The compile was stopped from outside (its `Budget.cancelled` was set): nobody waits for it any more."""


@dataclass
class Budget:
    """What one compile may spend: states of either automaton, seconds, and a flag that stops it."""

    max_nfa_states: int = MAX_NFA_STATES
    max_dfa_states: int = MAX_DFA_STATES
    seconds: float = MAX_SECONDS
    cancelled: threading.Event | None = None
    started: float = field(default_factory=time.monotonic)

    def check(self, what: str) -> None:
        """Raise if the compile was cancelled or has run past its seconds (`what`: the work under way)."""
        if self.cancelled is not None and self.cancelled.is_set():
            raise Cancelled(what)
        if time.monotonic() - self.started > self.seconds:
            raise TooLarge("seconds", f"the automaton took more than {self.seconds:g} s to build ({what}): "
                                      "a simpler pattern, or smaller counts, builds in less")


__all__ = ["Budget", "Cancelled", "MAX_DFA_STATES", "MAX_NFA_STATES", "MAX_SECONDS", "PatternError", "TooLarge"]
