"""Lesson 09 exercises: write your answers here; `pytest lessons/09-streaming` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/09_streaming.py (try first!).
"""

from __future__ import annotations

import time


def word_streamer(on_text):
    """Exercise 1: A whole-word streamer

    Return a streamer for `generate(..., streamer=...)` (an object with `put(row, text)` and `end()`; one row)
    that calls `on_text(piece)` with whole words only: after each `put`, pass on everything received so far up
    to and including its last whitespace character (`str.isspace`), and hold back the rest. `end()` passes on
    whatever is still held back. Never call `on_text` with an empty string.

    Example: puts "Hel", "lo wo", "rld", " ", "fo", "o\\nbar", then end() -> on_text receives
    "Hello ", "world ", "foo\\n", "bar".
    """
    raise NotImplementedError


def stop_aware_pieces(tokenizer, token_ids, stop):
    """Exercise 2: Never show a stop string

    Stream `token_ids` one at a time, as `generate(..., stop=stop)` does, and return the list of pieces shown:
    one piece (possibly empty) per token consumed.

    - Decode with `IncrementalDecoder(tokenizer)`: its pieces never end inside a character.
    - After each token, if the decoded text contains one of the strings in `stop` (a tuple), the generation
      ends there: the text is cut just before the earliest stop string, this token's piece is whatever of the
      cut text was not shown yet, and no further tokens are consumed.
    - Otherwise show the text except its longest tail that is the beginning of some stop string (it may still
      grow into one): e.g. with stop ("END",) the text "The E" shows "The " and holds "E".
    - If the ids run out with no stop string, the last token's piece also releases everything held back
      (the decoder's `flush()` included): the stream is over, so no stop string can complete.
    """
    raise NotImplementedError


def gap_steps(tokenizer, token_ids):
    """Exercise 3: Time to first token and the gaps between tokens

    Part 1, predict. A stream runs one decode step per token and shows that step's piece: the characters the
    token completes (a character still arriving is held back, so a step may show ''). A streamer that reads the
    clock at every non-empty piece sees one gap between each two consecutive non-empty pieces. Before running
    anything: which gaps are two decode steps long? Is every gap that ends at an emoji split over two tokens
    two steps long? (Try "Hi 😀 there" and "go 🚀!" with GPT-2's tokenizer.)

    Then return, for `token_ids` streamed one per step, the number of decode steps each such gap spans
    (len(non-empty pieces) - 1 values), worked out from each token's bytes (`tokenizer.token_bytes(id)`) and
    UTF-8's lead bytes, as the lesson's by-hand printer does: no clock, no generate.
    """
    raise NotImplementedError


def latency_streamer(clock=time.perf_counter):
    """Exercise 3: Time to first token and the gaps between tokens

    Part 2, measure. Return a streamer (`put(row, text)`, `end()`) that reads `clock()` (seconds) when it is
    created and at every `put` with non-empty text. It must expose, once generation has ended:

      .pieces: the non-empty pieces, in order;
      .time_to_first_text: seconds from the streamer's creation to the first non-empty piece (None if none);
      .gaps: the seconds between consecutive non-empty pieces (len(pieces) - 1 values).

    Create it just before calling `generate`, so its time to first text includes the prefill.
    """
    raise NotImplementedError
