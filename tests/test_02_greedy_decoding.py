"""Lesson 02: greedy decoding, stopping, the sliding window, and the CLI.

References: transformers' `generate(do_sample=False)` on the same weights, and a
brute-force loop written here (re-run the whole window for every token).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from minillm.decoding.sampling import SamplingConfig
from minillm.model.tokenizer import gpt2_tokenizer
from minillm.strategies.generate import generate, sliding_window_start


def brute_force_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The definition: feed the last context_length tokens, take the argmax, append, repeat."""
    ids = list(prompt)
    for _ in range(new_tokens):
        window = ids[-model.config.context_length:]
        with torch.no_grad():
            logits = model(torch.tensor([window]), torch.arange(len(window))[None])
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_matches_transformers_generate(tiny):
    hf_model, model = tiny
    prompt = [3, 14, 15, 92, 65, 35]
    ours = generate(model, [prompt], max_new_tokens=30).rows[0]
    theirs = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == theirs[0, len(prompt):].tolist()
    assert ours.finish_reason == "length" and len(ours.token_ids) == 30


@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_sliding_window_past_the_context(tiny, cache):
    """context_length is 64: 50 prompt tokens + 60 new ones cross it; every step must match brute force."""
    _, model = tiny
    prompt = torch.randint(0, model.config.vocab_size, (50,)).tolist()
    out = generate(model, [prompt], max_new_tokens=60, cache=cache).rows[0]
    assert out.token_ids == brute_force_greedy(model, prompt, 60)


def test_sliding_window_in_chunks_keeps_at_least_half_the_window():
    block = 64
    assert sliding_window_start(64, 0, block, 16) == 0  # still fits
    assert sliding_window_start(65, 0, block, 16) == 16  # outgrown: jump a chunk
    assert sliding_window_start(70, 16, block, 16) == 16  # fits again after the jump
    assert sliding_window_start(200, 0, block, 16) == 200 - block  # never keeps more than block


def test_sliding_window_chunked_is_the_same_for_every_cache(tiny):
    _, model = tiny
    prompt = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    outs = [generate(model, [prompt], max_new_tokens=70, cache=c, window_slide=16).token_ids for c in
            ("static", "dynamic", "none")]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("slide", [0, 65, 200])
def test_a_slide_outside_one_to_the_context_length_is_refused(tiny, slide):
    """A slide longer than the window would move it past the row's end (an empty window): refused up front."""
    _, model = tiny
    with pytest.raises(ValueError, match=f"window_slide={slide} is invalid: must be between 1 and the model's "
                                         r"context length \(64\)"):
        generate(model, [[1, 2, 3]], max_new_tokens=80, window_slide=slide)
    assert len(generate(model, [[1, 2, 3]], max_new_tokens=80, window_slide=64).token_ids[0]) == 80


def test_stops_at_eos_per_row(tiny):
    _, model = tiny
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    free = generate(model, prompts, max_new_tokens=20).token_ids
    eos = free[0][4]  # a token row 0 emits at step 5: make it the EOS
    stopped = generate(model, prompts, max_new_tokens=20, eos_token_id=eos).rows
    assert stopped[0].finish_reason == "eos"
    first = free[0].index(eos)
    assert stopped[0].token_ids == free[0][: first + 1]  # EOS included, nothing after it
    for row, full in zip(stopped[1:], free[1:]):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert row.token_ids == expected
        assert row.finish_reason == ("eos" if eos in full else "length")


def test_max_new_tokens_zero_and_exact_length(tiny):
    _, model = tiny
    assert generate(model, [[1, 2]], max_new_tokens=0).rows[0].token_ids == []
    assert generate(model, [[1, 2]], max_new_tokens=0).rows[0].finish_reason == "length"
    assert len(generate(model, [[1, 2]], max_new_tokens=7).rows[0].token_ids) == 7


def test_bad_prompts_are_refused(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []])
    with pytest.raises(ValueError, match="context is 64"):
        generate(model, [list(range(65))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[model.config.vocab_size]])
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ["text needs a tokenizer"])


# ------------------------------------------------------------------ the real model: text, stop strings, stats


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_real_model_answers_and_stops_at_eos(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template(CHAT)
    out = generate(model, prompt, tokenizer=tokenizer, max_new_tokens=40)
    row = out.rows[0]
    assert row.text == "The capital of France is Paris."
    assert row.finish_reason == "eos" and row.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(row.token_ids[:-1]) == row.text
    s = out.stats
    assert s.prompt_tokens == len(tokenizer.encode(prompt)) and s.prefill_seconds > 0
    assert s.decode_tokens == len(row.token_ids) - 1 and s.decode_tokens_per_second > 0


def test_real_model_stop_string(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template(CHAT)
    row = generate(model, prompt, tokenizer=tokenizer, max_new_tokens=40, stop=("Paris",)).rows[0]
    assert row.finish_reason == "stop" and row.text == "The capital of France is "
    assert "Paris" in tokenizer.decode(row.token_ids)  # the stop-completing token is the last one
    assert "Paris" not in tokenizer.decode(row.token_ids[:-1])


class Collect:
    def __init__(self):
        self.pieces = []
        self.ended = False

    def put(self, row, text):
        self.pieces.append((row, text))

    def end(self):
        self.ended = True


def test_streamed_text_equals_final_text_and_hides_stop_strings(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List three French cities with emoji."}])
    streamer = Collect()
    row = generate(model, prompt, tokenizer=tokenizer, max_new_tokens=48, streamer=streamer, stop=("Lyon",)).rows[0]
    streamed = "".join(t for _, t in streamer.pieces)
    assert streamer.ended and streamed == row.text
    # A half-finished emoji shows as U+FFFD only if the row ended inside it (as decode() shows it too).
    assert "\ufffd" not in streamed or "\ufffd" in tokenizer.decode(row.token_ids)


def test_stop_string_split_across_tokens_with_gpt2_tokenizer(tiny_kind):
    """A stop string that several tokens complete together is still found and hidden."""
    from minillm.decoding.stopping import RowState

    tok = gpt2_tokenizer()
    ids = tok.encode("Hello there, General Kenobi! More text.")
    state = RowState(prompt_ids=[0], max_new_tokens=100, stop=("General Ken",), tokenizer=tok)
    shown = ""
    for token in ids:
        state.push(token)
        shown += state.new_text()
        if state.finished:
            break
    assert state.finish_reason == "stop" and state.text == "Hello there, " and shown == "Hello there, "


# ------------------------------------------------------------------ the CLI end to end


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minillm.infer", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_json_and_streaming_agree():
    json_run = run_cli("--prompt", "What is the capital of France? Answer in one sentence.", "--json",
                       "--max-new-tokens", "24")
    assert json_run.returncode == 0, json_run.stderr
    record = json.loads(json_run.stdout)
    assert record["text"] == "The capital of France is Paris." and record["finish_reason"] == "eos"
    assert record["token_ids"][-1] == 2 and record["stats"]["prefill_seconds"] > 0
    assert record["stats"]["decode_tokens_per_second"] > 0
    streamed = run_cli("--prompt", "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "24")
    assert streamed.returncode == 0 and streamed.stdout == record["text"] + "\n"


def test_cli_error_is_one_line_without_traceback():
    bad = run_cli("--prompt", "hi", "--model", "/no/such/folder.gguf")
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr and "/no/such/folder.gguf" in bad.stderr


def test_a_prompt_that_is_not_utf8_is_named_as_such():
    """Bytes on the command line that are not UTF-8 (a Latin-1 terminal's é) reach Python as lone surrogates; the
    run names the flag and the byte before any model loads, instead of the tokenizer's complaint about types."""
    bad = subprocess.run([sys.executable, "-m", "minillm.infer", "--prompt", b"caf\xe9 au lait"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert "--prompt is not valid UTF-8 text (character 3 is the byte 0xE9)" in bad.stderr
    system = subprocess.run([sys.executable, "-m", "minillm.infer", "--prompt", "hi", "--system", b"\xff"],
                            capture_output=True, text=True, timeout=600)
    assert system.returncode == 2 and "--system is not valid UTF-8 text (character 0 is the byte 0xFF)" in system.stderr


def test_cli_help_explains_every_flag():
    from minillm.infer import build_parser

    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_sampling_config_defaults_are_greedy():
    assert SamplingConfig().greedy and SamplingConfig(do_sample=True, temperature=0).greedy


def test_notebook_runs(run_notebook):
    run_notebook("02_greedy_decoding.ipynb")
