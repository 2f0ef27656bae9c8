"""When a row stops, and which of its text may already be shown.

Every decoding loop in the course (plain, batched, speculative, beam) appends
tokens to rows and asks the same questions after each one: did the row just
emit EOS, complete a stop string, or reach `max_new_tokens`? And which part of its
text is final, so a streamer can print it? `RowState` answers both, so the loops
only move tensors around.

Text shown while streaming must never be taken back, so two things are held back:
an incomplete UTF-8 character at the end (see `minillm.decoding.detokenize`) and any tail
that could still grow into a stop string (the stop string itself is never shown).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenize import IncrementalDecoder
from .settings import GenerationConfig


@dataclass
class RowState:
    """One sequence being generated: its new tokens, its text, and why it ended."""

    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    tokenizer: object | None = None  # needed for text, stop strings and streaming
    token_ids: list[int] = field(default_factory=list)  # generated tokens, EOS / stop-completing token included
    finish_reason: str | None = None  # "eos", "stop" or "length" once finished
    text: str = ""  # generated text, EOS and stop string excluded (final once finished)
    shown: int = 0  # characters of `text` already handed to a streamer

    def __post_init__(self):
        self._decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._stable = ""  # text decoded so far, without a trailing incomplete character
        if self.max_new_tokens == 0:
            self.finish_reason = "length"

    @classmethod
    def for_config(cls, prompt_ids: list[int], config: GenerationConfig, tokenizer=None) -> "RowState":
        """A row stopping as `config` says; EOS defaults to the tokenizer's."""
        return cls(list(prompt_ids), config.max_new_tokens, eos_ids(config.eos_token_id, tokenizer), config.stop,
                   tokenizer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> None:
        """Append one generated token and update the finish reason."""
        if self.finished:
            raise RuntimeError("push() on a finished row")
        token = int(token)
        self.token_ids.append(token)
        if token in self.eos_token_ids:
            self._finish("eos")
            return
        if self._decoder is not None:
            searched = len(self._stable)
            self._stable += self._decoder.push([token])
            if self.stop and self._cut_at_stop(searched):
                return
        if len(self.token_ids) >= self.max_new_tokens:
            self._finish("length")

    def _cut_at_stop(self, searched: int) -> bool:
        """Cut the text at the first stop string; `searched` characters were already free of one.

        A new match ends in the text this token added, however long that is, but may
        begin up to (longest stop - 1) characters before it.
        """
        start = max(0, searched - (max(map(len, self.stop)) - 1))
        hits = [i for i in (self._stable.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self._stable = self._stable[: min(hits)]
        self.text = self._stable
        self.finish_reason = "stop"
        return True

    def end(self, reason: str) -> None:
        """Finish now for a reason the row's owner knows (structured output: the text is whole)."""
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        if self._decoder is not None:
            self._stable += self._decoder.flush()
        self.text = self._stable
        self.finish_reason = reason

    def new_text(self) -> str:
        """The text that became final since the last call (what a streamer prints next)."""
        final = self._stable if self.finished else self._stable[: len(self._stable) - self._stop_prefix_len()]
        piece = final[self.shown:]
        self.shown = len(final)
        return piece

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._stable)), longest, -1):
                if self._stable.endswith(s[:n]):
                    longest = n
                    break
        return longest


def eos_ids(config_eos, tokenizer) -> frozenset[int]:
    """The EOS ids to stop on: the config's if set, else the tokenizer's (if any)."""
    if config_eos is None:
        config_eos = getattr(tokenizer, "eos_token_id", None)
    if config_eos is None:
        return frozenset()
    if isinstance(config_eos, int):
        return frozenset({config_eos})
    return frozenset(int(i) for i in config_eos)
