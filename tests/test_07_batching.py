"""Lesson 07: many prompts of different lengths in one batch, each row exactly as if alone.

References: the same prompt generated alone (the unbatched output), transformers'
batched `generate` with left padding, and brute-force masks.
"""

from __future__ import annotations

import json

import pytest
import torch

from minillm.infer import main
from minillm.model.tiny import tiny_pair
from minillm.runtime.batching import attention_mask, greedy_right_padded, length_sorted_chunks, pad_left, padding_share
from minillm.strategies.generate import generate, generate_in_batches

LENGTHS = [1, 7, 200, 33, 120, 2]  # very different prompt lengths, one batch


def random_prompts(lengths, vocab_size=96, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompts, **kwargs) -> list[list[int]]:
    """Each prompt generated on its own: the reference every batched row must equal."""
    return [generate(model, p, **kwargs).token_ids[0] for p in prompts]


@pytest.fixture(scope="module")
def tiny_models():
    """Tiny random GPT-2 and Llama with room for 200-token prompts (context_length 256)."""
    return {kind: tiny_pair(kind, context_length=256) for kind in ("gpt2", "llama")}


# ------------------------------------------------------------------ layout: padding, positions, mask


def test_pad_left_puts_every_row_at_the_right_edge():
    rows = [[5, 6, 7], [8], [9, 10]]
    tokens, key_valid, positions = pad_left(rows, pad_id=0)
    assert tokens.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert key_valid.tolist() == [[True] * 3, [False, False, True], [False, True, True]]
    # A row's first real token has position 0 however much padding precedes it.
    assert [p[k].item() for p, k in zip(positions, [0, 2, 1])] == [0, 0, 0]
    assert positions[:, -1].tolist() == [2, 0, 1]


def test_attention_mask_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    key_valid = torch.rand(4, 9, generator=g) > 0.4
    key_valid[:, -3:] = True  # the last columns are real tokens (the queries)
    for T in (1, 3, 9):
        mask = attention_mask(key_valid, T)
        S = key_valid.shape[1]
        for b in range(4):
            for t in range(T):
                col = S - T + t  # the query's own column
                for s in range(S):
                    expected = s == col or (s <= col and bool(key_valid[b, s]))
                    assert bool(mask[b, t, s]) == expected


def test_padding_share_and_length_sorted_chunks():
    assert padding_share([3, 1, 6]) == pytest.approx((3 + 5 + 0) / 18)
    assert padding_share([3, 1, 6], new_tokens=5) == pytest.approx(8 / (3 * (6 + 4)))
    assert padding_share([4, 4]) == 0
    assert length_sorted_chunks([5, 1, 9, 2, 7], 2) == [[1, 3], [0, 4], [2]]
    with pytest.raises(ValueError, match="batch_size=0"):
        length_sorted_chunks([1], 0)


# ------------------------------------------------------------------ exactness against the unbatched output


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_batched_greedy_equals_unbatched(tiny_models, kind, cache):
    model = tiny_models[kind][1]
    prompts = random_prompts(LENGTHS)
    batched = generate(model, prompts, max_new_tokens=12, cache=cache)
    assert batched.token_ids == alone(model, prompts, max_new_tokens=12, cache=cache)
    assert [r.finish_reason for r in batched.rows] == ["length"] * len(prompts)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_matches_transformers_batched_generate_with_left_padding(tiny_models, kind):
    hf_model, model = tiny_models[kind]
    prompts = random_prompts(LENGTHS, seed=2)
    tokens, key_valid, _ = pad_left(prompts)
    reference = hf_model.generate(tokens, attention_mask=key_valid.long(), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    assert generate(model, prompts, max_new_tokens=12).token_ids == reference[:, tokens.shape[1]:].tolist()


def test_right_padding_without_a_cache_gives_the_same_tokens(tiny_models):
    model = tiny_models["llama"][1]
    prompts = random_prompts([3, 17, 1, 9], seed=3)
    assert greedy_right_padded(model, prompts, 8) == generate(model, prompts, max_new_tokens=8).token_ids


@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_rows_sliding_past_the_context_window_stay_exact(cache):
    """Rows outgrow context_length at different steps; each slides its own window as it would alone."""
    _, model = tiny_pair("llama", context_length=64)
    prompts = random_prompts([60, 3, 50, 64], seed=4)
    batched = generate(model, prompts, max_new_tokens=20, cache=cache, window_slide=4)
    assert batched.token_ids == alone(model, prompts, max_new_tokens=20, cache=cache, window_slide=4)


def test_batch_of_one_equals_a_single_prompt(tiny_models):
    model = tiny_models["gpt2"][1]
    prompt = random_prompts([11], seed=5)[0]
    assert generate(model, [prompt], max_new_tokens=10).token_ids == generate(model, prompt, max_new_tokens=10).token_ids
    assert generate(model, [prompt], max_new_tokens=10).token_ids == generate(model, [prompt], max_new_tokens=10,
                                                                               cache="none").token_ids


# ------------------------------------------------------------------ per-row stopping and sampling


def test_row_hitting_eos_stops_and_the_others_are_unaffected(tiny_models):
    model = tiny_models["llama"][1]
    prompts = random_prompts([5, 40, 1, 90, 12, 26], seed=6)
    n = 12
    free = alone(model, prompts, max_new_tokens=n)
    # Find a token that one row emits early and no other row ever emits: that row's EOS.
    choice = next((row, step, tok) for row, out in enumerate(free) for step, tok in enumerate(out[: n - 3])
                  if tok not in out[:step] and all(tok not in other for r, other in enumerate(free) if r != row))
    row, step, eos = choice
    out = generate(model, prompts, max_new_tokens=n, eos_token_id=eos)
    assert out.rows[row].token_ids == free[row][: step + 1]  # the EOS token itself is kept in token_ids
    assert out.rows[row].finish_reason == "eos"
    for r, other in enumerate(out.rows):
        if r != row:
            assert other.token_ids == free[r] and other.finish_reason == "length"


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.3,
                frequency_penalty=0.5, presence_penalty=0.2, seed=1234, max_new_tokens=16)


def test_sampled_row_depends_only_on_its_prompt_config_and_seed(tiny_models):
    """Every row's generator is seeded with config.seed: neighbours, order and batch size don't matter."""
    model = tiny_models["llama"][1]
    a, b, c, d = random_prompts([4, 30, 1, 77], seed=7)
    reference = alone(model, [a, b, c, d], **SAMPLING)
    assert generate(model, [a, b, c, d], **SAMPLING).token_ids == reference
    assert generate(model, [d, c, a], **SAMPLING).token_ids == [reference[3], reference[2], reference[0]]
    # Identical prompts in one batch draw identical samples (same seed, same stream).
    assert generate(model, [b, b], **SAMPLING).token_ids == [reference[1], reference[1]]
    # ...and another seed gives another sample.
    assert generate(model, [b], **{**SAMPLING, "seed": 99}).token_ids[0] != reference[1]


# ------------------------------------------------------------------ empty prompts and chunking


def test_empty_prompt_is_refused_naming_its_row(tiny_models):
    model = tiny_models["gpt2"][1]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], [], [3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 3 is empty"):  # the input index, not the index within a chunk
        generate_in_batches(model, [[1, 2], [4], [3], []], 2, max_new_tokens=2)


def test_more_prompts_than_batch_size_come_back_in_input_order(tiny_models):
    model = tiny_models["llama"][1]
    prompts = random_prompts([9, 1, 50, 3, 22, 3, 120], seed=8)
    out = generate_in_batches(model, prompts, 3, max_new_tokens=6)
    assert out.token_ids == generate(model, prompts, max_new_tokens=6).token_ids
    assert [r.prompt_ids for r in out.rows] == prompts
    assert out.stats.prompt_tokens == sum(map(len, prompts))
    assert out.stats.forward_passes == 3 * 6  # three chunks of six forwards each (prefill + 5 steps)


# ------------------------------------------------------------------ the real default model


def default_prompts(tokenizer) -> list[list[int]]:
    """1 to 200 tokens; the chat question ends with EOS well before 16 tokens."""
    story = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps, listening to the "
             "sea, and writing in a small notebook what the weather had done that day. ") * 8
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? "
                                                                      "Answer in one sentence."}],
                                         add_generation_prompt=True)
    return [tokenizer.encode("Once")[:1], tokenizer.encode(story)[:200], tokenizer.encode(chat),
            tokenizer.encode("def fibonacci(n):")]


@pytest.fixture(scope="module")
def default_singles(default_model):
    """Each default prompt generated alone (static cache; lesson 06 checks every cache gives the same tokens)."""
    model, tokenizer = default_model
    return [generate(model, p, tokenizer=tokenizer, max_new_tokens=16).rows[0] for p in default_prompts(tokenizer)]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_default_model_batched_equals_unbatched(default_model, default_singles, cache):
    model, tokenizer = default_model
    prompts = default_prompts(tokenizer)
    assert [len(p) for p in prompts][:2] == [1, 200]
    batched = generate(model, prompts, tokenizer=tokenizer, max_new_tokens=16, cache=cache)
    singles = default_singles
    assert batched.token_ids == [r.token_ids for r in singles]
    assert batched.texts == [r.text for r in singles]
    assert [r.finish_reason for r in batched.rows] == ["length", "length", "eos", "length"]
    assert batched.rows[2].text == "The capital of France is Paris."


# ------------------------------------------------------------------ the command line


def test_cli_prompts_file_in_batches_prints_json_lines_in_input_order(default_model, tmp_path, capsys):
    model, tokenizer = default_model
    prompts = ["Once upon a time", "The", "Water boils at", "My favourite colour is", "def add(a, b):"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts) + "\n")
    assert main(["--prompts-file", str(path), "--batch-size", "2", "--no-chat", "--max-new-tokens", "4",
                 "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = generate(model, prompts, tokenizer=tokenizer, max_new_tokens=4)
    assert [line["prompt"] for line in lines] == prompts
    assert [line["token_ids"] for line in lines] == expected.token_ids


def test_cli_text_prompts_file_skips_blank_lines(default_model, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\n\nThe sky is\n")
    assert main(["--prompts-file", str(path), "--no-chat", "--max-new-tokens", "2", "--json"]) == 0
    assert [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines()] == ["Once upon a time",
                                                                                             "The sky is"]


@pytest.mark.parametrize("content, flags, message", [
    ('{"prompt": "Hi"}\n{"prompt": "  "}\n', [], "prompt 1 is empty"),
    ('{"prompt": "Hi"}\n{"text": "Hi"}\n', [], 'line 2 is not a JSON object with a "prompt" field'),
    ('{"prompt": "Hi"}\n', ["--batch-size", "0"], "--batch-size 0 is invalid"),
])
def test_cli_refuses_bad_batches_with_one_line(tmp_path, capsys, content, flags, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert main(["--prompts-file", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_notebook_runs(run_notebook):
    run_notebook("07_batching.ipynb")
