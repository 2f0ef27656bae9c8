"""Turning a growing list of token ids into text pieces that are safe to print.

Byte-level BPE tokens are bytes, not characters: "é" may be split over two tokens
and an emoji over four. Decoding each token on its own prints U+FFFD garbage; the
fix is to decode the growing sequence and hold back the tail while it ends in an
incomplete UTF-8 character (which decodes to U+FFFD), emitting it once complete.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Feed token ids, get back the newly completed text.

    The concatenation of every piece returned by `push` and `flush` equals
    `tokenizer.decode(all_ids)` exactly. Only the ids since the last point where the
    text was stable are decoded on each call (`prefix_offset`), so the cost per token
    stays constant rather than growing with the sequence.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this index produced text already emitted in full
        self.emitted_in_window = 0  # characters of decode(ids[prefix_offset:]) already emitted

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        stable = text.rstrip(REPLACEMENT) if text.endswith(REPLACEMENT) else text
        if len(stable) <= self.emitted_in_window:
            return ""
        piece = stable[self.emitted_in_window:]
        if stable is text:  # everything decoded cleanly: start the next window after these ids
            self.prefix_offset, self.emitted_in_window = len(self.ids), 0
        else:
            self.emitted_in_window = len(stable)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character stays as U+FFFD, as decode() shows it)."""
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        piece = text[self.emitted_in_window:]
        self.prefix_offset, self.emitted_in_window = len(self.ids), 0
        return piece
