"""Streaming: showing text while it is generated, without ever taking a character back.

Generation is a stream of events (`generate(..., stream=True)`); each event carries the
text that just became final (`minillm.decoding.detokenize.IncrementalDecoder` and
`minillm.decoding.stopping.RowState` decide what is final). The streamers here are thin
adapters over that stream:

    PrintStreamer()                   prints as it arrives (the CLI uses it)
    CallbackStreamer(fn)              calls fn(text) for each piece
    for piece in stream(model, prompt, tokenizer=tok): ...
                                      a plain loop over the pieces, no thread
    IteratorStreamer()                the same loop when generation runs in another thread

Why pieces are held back. Byte-level BPE tokens are bytes, not characters: "é" may be
split over two tokens and an emoji over four. Decoding each token on its own prints
U+FFFD (the replacement character) for every half character. Instead we decode the
growing window of recent ids and hold back the tail while it ends in an incomplete
UTF-8 character (which decodes to U+FFFD), emitting it once the character is complete.
"""

from __future__ import annotations

import queue
import sys
from typing import Callable, Protocol

from ..decoding.detokenize import REPLACEMENT, IncrementalDecoder

# ---------------------------------------------------------------- streamers


class Streamer(Protocol):
    """What `generate(..., streamer=...)` calls: `put` for each final piece of a row's text, `end` once."""

    def put(self, row: int, text: str) -> None: ...

    def end(self) -> None: ...


class CallbackStreamer:
    """Calls `on_text(text)` for each piece (`on_text(row, text)` with `with_row=True`, for batches)
    and `on_end()` when generation is over."""

    def __init__(self, on_text: Callable, *, with_row: bool = False, on_end: Callable[[], None] | None = None):
        self.on_text, self.with_row, self.on_end = on_text, with_row, on_end

    def put(self, row: int, text: str) -> None:
        self.on_text(row, text) if self.with_row else self.on_text(text)

    def end(self) -> None:
        if self.on_end is not None:
            self.on_end()


class PrintStreamer:
    """Prints one row's text the moment it is final (transformers' TextStreamer); `end` finishes the line."""

    def __init__(self, file=None, end: str = "\n"):
        self.file, self.final = file, end

    def put(self, row: int, text: str) -> None:
        out = self.file or sys.stdout
        out.write(text)
        out.flush()

    def end(self) -> None:
        out = self.file or sys.stdout
        out.write(self.final)
        out.flush()


class StreamClosed(Exception):
    """Raised inside the generating thread when the consumer has stopped listening."""


_END = object()


class IteratorStreamer:
    """Generation in one thread, a `for` loop over the text in another (transformers' TextIteratorStreamer).

        streamer = IteratorStreamer(timeout=30)
        threading.Thread(target=generate, args=(model, prompt), kwargs=dict(tokenizer=tok, streamer=streamer)).start()
        for piece in streamer:
            print(piece, end="")

    Only needed when generation must run in another thread: `stream()` gives the same
    loop in one thread, and on a CPU it is also the faster one (a second thread's OpenMP
    work runs at up to half speed once the main thread has used OpenMP: lesson 13).
    `timeout` bounds the wait for each piece (TimeoutError); leaving the loop early makes
    the generating thread stop at its next piece.
    """

    def __init__(self, timeout: float | None = None, *, with_row: bool = False):
        self.timeout, self.with_row = timeout, with_row
        self._queue: queue.Queue = queue.Queue()
        self._closed = False

    def put(self, row: int, text: str) -> None:
        if self._closed:
            raise StreamClosed("the consumer left the loop")
        self._queue.put((row, text))

    def end(self) -> None:
        self._queue.put(_END)

    def __iter__(self):
        try:
            while (item := self._next_item()) is not _END:
                row, text = item
                yield (row, text) if self.with_row else text
        finally:
            self._closed = True

    def _next_item(self):
        try:
            return self._queue.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"no text within timeout={self.timeout} s: the generation is slow or stuck; "
                               f"raise the timeout or pass timeout=None") from None


class TextStream:
    """A `for` loop over the text of a generation, run step by step in the caller's thread.

    Iterating drives the generation; `result` is its GenerationOutput once the loop has
    run to the end (None if it was left early: the rest is simply never computed).
    """

    def __init__(self, generation, with_row: bool = False):
        self.generation, self.with_row = generation, with_row

    @property
    def result(self):
        return self.generation.output

    def __iter__(self):
        for event in self.generation:
            if event.text:
                yield (event.row, event.text) if self.with_row else event.text


def stream(model, prompts, config=None, *, tokenizer, with_row: bool = False, **generate_kwargs) -> TextStream:
    """Loop over the text of `generate()` as it forms (pieces, or (row, piece) with `with_row`).

        s = stream(model, "Tell me a joke", tokenizer=tok, max_new_tokens=60)
        for piece in s:
            print(piece, end="", flush=True)
        s.result.rows[0].finish_reason, s.result.stats.time_to_first_token

    Settings are checked at the call, so a bad one raises before the loop starts.
    """
    from .generate import generate  # infer is a strategy; streamers are front ends above it

    return TextStream(generate(model, prompts, config, tokenizer=tokenizer, stream=True, **generate_kwargs), with_row)


__all__ = ["IncrementalDecoder", "REPLACEMENT", "Streamer", "CallbackStreamer", "PrintStreamer", "IteratorStreamer",
           "StreamClosed", "TextStream", "stream"]
