"""Worked solutions for lesson 09 (streaming). Check them: `pytest lessons/09-streaming --solutions`."""

from __future__ import annotations

import time

from minillm.decoding.detokenize import IncrementalDecoder


class WordStreamer:
    def __init__(self, on_text):
        self.on_text, self.held = on_text, ""

    def put(self, row, text):
        self.held += text
        # The last whitespace ends the last complete word; everything after it may still grow.
        cut = max((i + 1 for i, c in enumerate(self.held) if c.isspace()), default=0)
        if cut:
            self.on_text(self.held[:cut])
            self.held = self.held[cut:]

    def end(self):
        if self.held:  # the stream is over: the last word is as complete as it will get
            self.on_text(self.held)
            self.held = ""


def word_streamer(on_text):
    """Exercise 1: A whole-word streamer"""
    return WordStreamer(on_text)


def longest_stop_prefix(text, stop):
    """Length of the longest tail of `text` that is the start of some stop string (a proper prefix)."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def stop_aware_pieces(tokenizer, token_ids, stop):
    """Exercise 2: Never show a stop string"""
    decoder = IncrementalDecoder(tokenizer)
    text, shown, pieces = "", 0, []  # text: complete characters decoded so far; shown: characters already shown
    for k, token in enumerate(token_ids):
        text += decoder.push([token])
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:  # a stop string completed: cut before it, show what is left of the text, and stop
            text = text[:min(hits)]
            pieces.append(text[shown:])
            return pieces
        if k == len(token_ids) - 1:  # the last token: nothing can complete any more, release everything
            text += decoder.flush()
            final = text
        else:
            final = text[:len(text) - longest_stop_prefix(text, stop)]
        pieces.append(final[shown:])
        shown = len(final)
    return pieces


def held_back(data: bytes) -> int:
    """How many bytes at the end of `data` belong to a character still arriving (0 if it ends cleanly)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0b1100_0000 != 0b1000_0000:  # not a continuation byte: the last character starts here
            length = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back if back < length else 0
    return 0


def gap_steps(tokenizer, token_ids):
    """Exercise 3: Time to first token and the gaps between tokens"""
    # A step shows text when its token completes at least one character. A token whose bytes all belong to a
    # character still arriving shows '', and its step is added to the next gap: two steps when one such token
    # sits between two pieces. A token that ends inside an emoji but starts with a complete character (" " plus
    # the emoji's first bytes, as GPT-2 splits " 😀") still shows that character, so its gap stays one step.
    steps, pending, since = [], b"", None  # since: steps since the last non-empty piece (None before the first)
    for token in token_ids:
        pending += tokenizer.token_bytes(token)
        complete = len(pending) - held_back(pending)  # bytes of whole characters this step can show
        since = None if since is None else since + 1
        if complete:
            if since is not None:
                steps.append(since)
            since, pending = 0, pending[complete:]
    return steps


class LatencyStreamer:
    def __init__(self, clock):
        self.clock = clock
        self.start = clock()  # created just before generate(): the prefill counts
        self.pieces, self.times = [], []

    def put(self, row, text):
        if text:  # an empty piece shows nothing: the reader is still waiting
            self.times.append(self.clock())
            self.pieces.append(text)

    def end(self):
        pass

    @property
    def time_to_first_text(self):
        return self.times[0] - self.start if self.times else None

    @property
    def gaps(self):
        return [b - a for a, b in zip(self.times, self.times[1:])]


def latency_streamer(clock=time.perf_counter):
    """Exercise 3: Time to first token and the gaps between tokens"""
    return LatencyStreamer(clock)
