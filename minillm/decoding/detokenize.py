"""Incremental detokenization: text that is final as soon as it is shown.

Byte-level BPE tokens are bytes, not characters: "é" may be split over two tokens and
an emoji over four. Decoding each token on its own prints U+FFFD (the replacement
character) for every half character. Instead we decode the growing window of recent
ids and hold back the tail while it ends in an incomplete UTF-8 character (which
decodes to U+FFFD), emitting it once the character is complete.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Feed token ids, get back the newly completed text.

    The concatenation of every piece returned by `push` and the final `flush` equals
    `tokenizer.decode(all_ids)` exactly, and a piece holds U+FFFD only where the full
    decode does (an invalid byte sequence, never a character that is still arriving).

    Each call decodes a window of recent ids, not the whole sequence, so the cost per
    token stays flat. The window restarts at the last id once the text ends cleanly,
    and only when that id decodes cleanly on its own: the id stays in the window as
    context, because some decoders treat the first token of a sequence specially
    (SentencePiece drops its leading space; byte-fallback decodes a run of byte tokens
    as a whole), and the characters it produced are counted as already emitted.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.window_start = 0  # ids before this are never decoded again
        self.emitted = 0  # characters of decode(ids[window_start:]) already returned

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        text = self.tokenizer.decode(self.ids[self.window_start:])
        stable = text.rstrip(REPLACEMENT)  # a character still arriving decodes to U+FFFD: hold it back
        piece = stable[self.emitted:]
        if len(stable) < len(text):
            self.emitted = max(self.emitted, len(stable))
            return piece
        last = self.tokenizer.decode(self.ids[-1:])
        if REPLACEMENT in last:  # the last id is part of a character or a byte run: not a safe restart
            self.emitted = len(text)
        else:
            self.window_start, self.emitted = len(self.ids) - 1, len(last)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character stays U+FFFD, as decode() shows it).
        Call it once, when the sequence is complete."""
        text = self.tokenizer.decode(self.ids[self.window_start:])
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece


__all__ = ["IncrementalDecoder", "REPLACEMENT"]
