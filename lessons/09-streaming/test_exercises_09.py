"""Checks for lesson 09's exercises: `pytest lessons/09-streaming` (yours) or `--solutions`.

References: hand-worked expected pieces, the package's own stream (`generate(..., stream=True)` with stop strings,
and `minillm.decoding.stopping.RowState`, which decides what generate shows), the final text of `generate`, and a fake clock.
"""

from __future__ import annotations

import pytest

from minillm.decoding.detokenize import IncrementalDecoder
from minillm.decoding.stopping import RowState
from minillm.model.tiny import tiny_pair
from minillm.model.tokenizer import gpt2_tokenizer
from minillm.strategies.generate import generate
from minillm.strategies.streaming import CallbackStreamer

HELLO = [39, 68, 75, 75, 78]  # "Hello", one byte per token


@pytest.fixture(scope="module")
def tiny_with_gpt2_tokens():
    """A tiny random Llama whose 96 token ids are GPT-2's first 96 tokens (printable ASCII, space included)."""
    return tiny_pair("llama")[1], gpt2_tokenizer()


def sampled(model, tok, n, seed, **kwargs):
    return generate(model, HELLO, tokenizer=tok, max_new_tokens=n, eos_token_id=(), do_sample=True, seed=seed,
                    **kwargs)


# ------------------------------------------------------------------ Exercise 1


def test_exercise_1_word_streamer_holds_back_partial_words(answers):
    got = []
    streamer = answers.word_streamer(got.append)
    for piece in ["Hel", "lo wo", "rld", " ", "fo", "o\nbar", "", "\t", "é世", "😀 x"]:
        streamer.put(0, piece)
    streamer.end()
    assert got == ["Hello ", "world ", "foo\n", "bar\t", "é世😀 ", "x"]
    got = []
    streamer = answers.word_streamer(got.append)
    for piece in ["no", "space", "s"]:
        streamer.put(0, piece)
    assert got == []  # no whitespace yet: nothing is a whole word
    streamer.end()
    assert got == ["nospaces"]


def test_exercise_1_word_streamer_with_generate(answers, tiny_with_gpt2_tokens):
    model, tok = tiny_with_gpt2_tokens
    for seed in range(3):
        got = []
        out = sampled(model, tok, 40, seed, streamer=answers.word_streamer(got.append))
        text = out.texts[0]
        assert "".join(got) == text and all(got)
        assert all(piece[-1].isspace() for piece in got[:-1])  # every piece but the last ends a word
        # Each piece ends at the next whitespace boundary the text had reached: no word is split over two pieces.
        boundaries = {i + 1 for i, c in enumerate(text) if c.isspace()} | {len(text)}
        ends = [sum(map(len, got[:k + 1])) for k in range(len(got))]
        assert set(ends) <= boundaries


# ------------------------------------------------------------------ Exercise 2


def row_state_pieces(tokenizer, token_ids, stop):
    """What minillm shows: RowState.new_text() after each token, until the row finishes."""
    state = RowState([], len(token_ids), stop=stop, tokenizer=tokenizer)
    pieces = []
    for token in token_ids:
        state.push(token)
        pieces.append(state.new_text())
        if state.finished:
            break
    return pieces


@pytest.mark.parametrize("text, stop", [
    ("Hello world. END more text", ("END",)),
    ("The EN is not the END", ("END",)),
    ("Café 😀 世界 then 。 and more", ("。",)),
    ("emoji 👩‍👩‍👧 family, then STOP", ("👧", "STOP")),
    ("nothing stops this one: ENDING", ("ENDX", "G!")),
    ("a b c d e f", ("c d", "d e")),
    ("ends in a half emoji 😀", ("zz",)),
])
def test_exercise_2_stop_aware_pieces_match_the_package(answers, text, stop):
    tok = gpt2_tokenizer()
    ids = tok.encode(text)
    if text.endswith("😀"):
        ids = ids[:-1]  # cut the emoji short: the last piece shows it as U+FFFD, as decode() does
    got = answers.stop_aware_pieces(tok, ids, stop)
    expected = row_state_pieces(tok, ids, stop)
    assert got == expected, (got, expected)
    for k in range(len(got)):  # never a shown prefix of a stop string that then completes
        shown = "".join(got[:k + 1])
        assert not any(s in shown for s in stop)


def test_exercise_2_stop_aware_pieces_match_generate(answers, tiny_with_gpt2_tokens):
    model, tok = tiny_with_gpt2_tokens
    checked = 0
    for seed in range(4):
        free = sampled(model, tok, 40, seed)
        text, ids = free.texts[0], free.rows[0].token_ids
        for start, length in ((8, 3), (20, 2), (5, 1)):
            stop = (text[start:start + length],)
            events = list(sampled(model, tok, 40, seed, stop=stop, stream=True))
            expected = [event.text for event in events]
            assert events[-1].finish_reason == "stop"
            got = answers.stop_aware_pieces(tok, ids, stop)
            assert got == expected, (stop, got, expected)
            checked += 1
    assert checked == 12


# ------------------------------------------------------------------ Exercise 3


def streamed_pieces(tok, ids):
    """The piece each decode step shows, one token per step (what generate hands a streamer)."""
    decoder = IncrementalDecoder(tok)
    return [decoder.push([token]) for token in ids]


@pytest.mark.parametrize("text,expected", [
    ("go 🚀!", [1, 2, 1]),  # 🚀 over three tokens; the middle one completes nothing and shows ''
    ("Hi 😀 there", [1, 1, 1]),  # 😀 over two tokens, but the first brings a whole " " with it: no empty step
    ("café 😀😀 ok", [1, 1, 1, 1, 2, 1]),  # the second 😀's first token shows ''
    ("plain ASCII text", [1, 1]),
])
def test_exercise_3_predict_which_gaps_are_two_steps(answers, text, expected):
    tok = gpt2_tokenizer()
    ids = tok.encode(text)
    shown = [i for i, piece in enumerate(streamed_pieces(tok, ids)) if piece]
    assert [b - a for a, b in zip(shown, shown[1:])] == expected  # the stream's own gaps, in steps
    assert answers.gap_steps(tok, ids) == expected


def test_exercise_3_a_step_that_shows_nothing_doubles_the_gap(answers):
    tok = gpt2_tokenizer()
    ids, step, now = tok.encode("go 🚀!"), 0.25, [0.0]
    streamer = answers.latency_streamer(clock=lambda: now[0])
    for piece in streamed_pieces(tok, ids):
        now[0] += step  # one decode step per token
        streamer.put(0, piece)
    streamer.end()
    assert streamer.pieces == ["go", " ", "🚀", "!"]
    assert streamer.time_to_first_text == pytest.approx(step)
    assert streamer.gaps == pytest.approx([step * n for n in answers.gap_steps(tok, ids)])
    assert streamer.gaps[1] == pytest.approx(2 * step)  # the token that showed '' is merged into 🚀's gap


def test_exercise_3_latency_streamer_with_a_fake_clock(answers):
    now = [100.0]
    streamer = answers.latency_streamer(clock=lambda: now[0])
    for t, piece in [(100.5, ""), (100.75, "Hel"), (101.0, ""), (101.25, "lo"), (102.0, " world"), (102.5, "")]:
        now[0] = t
        streamer.put(0, piece)
    streamer.end()
    assert streamer.pieces == ["Hel", "lo", " world"]
    assert streamer.time_to_first_text == pytest.approx(0.75)
    assert streamer.gaps == pytest.approx([0.5, 0.75])
    empty = answers.latency_streamer(clock=lambda: now[0])
    empty.end()
    assert empty.pieces == [] and empty.time_to_first_text is None and empty.gaps == []


def test_exercise_3_latency_streamer_with_generate(answers, tiny_with_gpt2_tokens):
    model, tok = tiny_with_gpt2_tokens
    calls = []
    ticks = iter(range(10_000))

    def clock():  # a clock that moves one second per reading, and counts the readings
        calls.append(1)
        return float(next(ticks))

    shown = []
    streamer = answers.latency_streamer(clock=clock)
    out = generate(model, HELLO, tokenizer=tok, max_new_tokens=20, eos_token_id=(), do_sample=True, seed=1,
                   streamer=_Both(streamer, CallbackStreamer(shown.append)))
    nonempty = [piece for piece in shown if piece]
    assert streamer.pieces == nonempty and "".join(streamer.pieces) == out.texts[0]
    assert len(streamer.gaps) == len(nonempty) - 1 and all(gap > 0 for gap in streamer.gaps)
    assert streamer.time_to_first_text > 0
    assert len(calls) == 1 + len(nonempty)  # one reading when created, one per non-empty piece: empty ones are free


class _Both:
    """Hand each piece to two streamers."""

    def __init__(self, *streamers):
        self.streamers = streamers

    def put(self, row, text):
        for s in self.streamers:
            s.put(row, text)

    def end(self):
        for s in self.streamers:
            s.end()
