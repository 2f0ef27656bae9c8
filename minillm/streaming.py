"""Streaming: showing text while it is generated, without ever taking a character back.

Two layers. `IncrementalDecoder` turns a growing list of token ids into text pieces
that are final. The streamers receive those pieces from `generate(..., streamer=...)`
(which calls `put(row, text)` for every new piece and `end()` once) and hand them on:

    PrintStreamer()                   prints as it arrives (the CLI uses it)
    CallbackStreamer(fn)              calls fn(text) for each piece
    for piece in stream(model, prompt, tokenizer=tok): ...
                                      generation runs in a background thread, the
                                      caller's loop receives the pieces

Why pieces are held back. Byte-level BPE tokens are bytes, not characters: "é" may be
split over two tokens and an emoji over four. Decoding each token on its own prints
U+FFFD (the replacement character) for every half character. Instead we decode the
growing window of recent ids and hold back the tail while it ends in an incomplete
UTF-8 character (which decodes to U+FFFD), emitting it once the character is complete.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Callable, Protocol

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

    `stream()` does the thread for you and also re-raises the thread's exceptions in
    the loop. `timeout` bounds the wait for each piece (TimeoutError); leaving the loop
    early makes the generating thread stop at its next piece.
    """

    def __init__(self, timeout: float | None = None, *, with_row: bool = False):
        self.timeout, self.with_row = timeout, with_row
        self.result = None  # the GenerationOutput, once `stream()`'s generation has returned
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, row: int, text: str) -> None:
        if self._closed:
            raise StreamClosed("the consumer left the loop")
        self._queue.put((row, text))

    def end(self) -> None:
        self._queue.put(_END)

    def fail(self, error: BaseException) -> None:
        """Hand an exception from the generating thread to the loop, which raises it."""
        self._queue.put(error)

    def __iter__(self):
        try:
            while True:
                item = self._next_item()
                if item is _END:
                    break
                row, text = item
                yield (row, text) if self.with_row else text
            if self._thread is not None:  # generate() returns right after end(): wait for its result
                self._thread.join()
                while not self._queue.empty():  # an error raised after end()
                    self._next_item()
        finally:
            self._closed = True

    def _next_item(self):
        try:
            item = self._queue.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"no text within timeout={self.timeout} s: the generation is slow or stuck; "
                               f"raise the timeout or pass timeout=None") from None
        if isinstance(item, BaseException):
            raise item
        return item


def stream(model, prompts, config=None, *, tokenizer, timeout: float | None = None, with_row: bool = False,
           **generate_kwargs) -> IteratorStreamer:
    """Start `generate()` in a background thread and return the streamer to loop over.

        s = stream(model, "Tell me a joke", tokenizer=tok, max_new_tokens=60)
        for piece in s:
            print(piece, end="", flush=True)
        s.result.rows[0].finish_reason, s.result.stats.time_to_first_token

    An exception in the generation (a bad setting, a too-long prompt) is raised by the loop.
    """
    from .infer import generate  # infer imports this module (through stopping)

    streamer = IteratorStreamer(timeout, with_row=with_row)

    def work():
        try:
            streamer.result = generate(model, prompts, config, tokenizer=tokenizer, streamer=streamer,
                                       **generate_kwargs)
        except StreamClosed:
            pass
        except BaseException as error:  # shown to the consumer, never lost in the thread
            streamer.fail(error)

    streamer._thread = threading.Thread(target=work, name="minillm-generate", daemon=True)
    streamer._thread.start()
    return streamer
