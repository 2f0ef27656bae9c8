"""Lesson 10: beam search, checked against transformers' generate(num_beams=..., do_sample=False)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from minillm.model.tiny import tiny_pair
from minillm.runtime.batching import pad_left
from minillm.strategies.beam import BeamSearchError, beam_search, continuation_logprobs
from minillm.strategies.generate import generate

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]  # different lengths: left padding is exercised too


def hf_beam_search(hf_model, prompts, *, num_beams, length_penalty, early_stopping, num_return_sequences,
                   max_new_tokens, eos):
    """transformers' answer as (generated ids per returned row, sequences_scores)."""
    tokens, key_valid, _ = pad_left(prompts)
    eos_list = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    out = hf_model.generate(tokens, attention_mask=key_valid.long(), num_beams=num_beams, do_sample=False,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            num_return_sequences=num_return_sequences, max_new_tokens=max_new_tokens,
                            eos_token_id=eos, pad_token_id=eos_list[0] if eos_list else 0,
                            return_dict_in_generate=True, output_scores=True)
    rows = []
    for sequence in out.sequences[:, tokens.shape[1]:].tolist():
        ends = [i for i, t in enumerate(sequence) if t in eos_list]
        rows.append(sequence[:ends[0] + 1] if ends else sequence)  # after EOS comes padding
    return rows, out.sequences_scores.tolist()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny_with_eos(request):
    """A tiny pair and an EOS id the model actually produces (the 4th greedy token of the first prompt)."""
    hf_model, model = tiny_pair(request.param)
    greedy = generate(model, PROMPTS[0], max_new_tokens=8).rows[0].token_ids
    return hf_model, model, greedy[3]


# Every num_beams, length_penalty, early_stopping and num_return_sequences value, in pairs that differ.
CASES = [(2, 1.0, False, 1), (2, 2.0, "never", 2), (2, -1.0, True, 1), (3, 0.0, True, 3), (3, -1.0, False, 1),
         (3, 2.0, "never", 1), (5, 1.0, True, 5), (5, -1.0, "never", 5), (5, 2.0, False, 2), (4, 0.0, "never", 4)]


def test_same_sequences_and_scores_as_transformers_on_tiny_models(tiny_with_eos):
    hf_model, model, eos = tiny_with_eos
    finish_reasons = set()
    for num_beams, length_penalty, early_stopping, num_return_sequences in CASES:
        settings = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
                        num_return_sequences=num_return_sequences, max_new_tokens=14)
        want_rows, want_scores = hf_beam_search(hf_model, PROMPTS, eos=eos, **settings)
        out = beam_search(model, PROMPTS, eos_token_id=eos, **settings)
        assert out.token_ids == want_rows, settings
        assert out.sequences_scores == pytest.approx(want_scores, abs=1e-4), settings
        assert [r.prompt_ids for r in out.rows] == [p for p in PROMPTS for _ in range(num_return_sequences)]
        finish_reasons |= {r.finish_reason for r in out.rows}
    assert finish_reasons == {"eos", "length"}  # EOS handling was exercised, and so was running out of tokens


def test_several_eos_ids_and_no_eos(tiny_with_eos):
    hf_model, model, eos = tiny_with_eos
    second = generate(model, PROMPTS[1], max_new_tokens=8).rows[0].token_ids[2]
    for eos_ids in ((eos, second), None):
        settings = dict(num_beams=3, length_penalty=1.0, early_stopping=False, num_return_sequences=3,
                        max_new_tokens=12)
        want_rows, want_scores = hf_beam_search(hf_model, PROMPTS, eos=list(eos_ids) if eos_ids else None,
                                                **settings)
        out = beam_search(model, PROMPTS, eos_token_id=eos_ids, **settings)
        assert out.token_ids == want_rows
        assert out.sequences_scores == pytest.approx(want_scores, abs=1e-4)


def test_every_cache_kind_gives_the_same_beams(tiny_with_eos):
    _, model, eos = tiny_with_eos
    settings = dict(num_beams=4, num_return_sequences=4, max_new_tokens=14, eos_token_id=eos)
    static = beam_search(model, PROMPTS, cache="static", **settings)
    for kind in ("dynamic", "blocks", "none"):
        other = beam_search(model, PROMPTS, cache=kind, **settings)
        assert other.token_ids == static.token_ids
        assert other.sequences_scores == pytest.approx(static.sequences_scores, abs=1e-5)


def test_beams_on_shared_blocks_copy_at_most_a_block_per_beam_a_step(tiny_with_eos):
    """A contiguous reorder copies every beam's whole rows each step: 2 (keys, values) · layers · beams · KV heads ·
    length · head size floats. Beams in a block pool copy only the partial last block a beam writes into while it
    shares it: at most one block per beam per step, whatever the length."""
    _, model, _ = tiny_with_eos
    c, beams, steps = model.config, 4, 40  # long enough that the bound below is under the contiguous copies
    settings = dict(num_beams=beams, num_return_sequences=beams, max_new_tokens=steps, eos_token_id=())
    static = beam_search(model, PROMPTS, cache="static", **settings)
    blocks = beam_search(model, PROMPTS, cache="blocks", **settings)
    assert blocks.token_ids == static.token_ids
    floats = 2 * c.n_layer * c.kv_heads * c.head_size
    # Selects copy every row's stored tokens: the prompts (padded to the longest) to their beams, then at step n
    # (1 .. steps - 1, before the step's token is fed) the prompt and n - 1 tokens.
    prompt = max(map(len, PROMPTS))
    expected = len(PROMPTS) * beams * (prompt + sum(prompt + n - 1 for n in range(1, steps))) * floats * 4
    assert static.stats.extra["cache_copied_bytes"] == expected
    block_bytes = floats * 16 * 4  # the pool's blocks hold 16 tokens
    copied = blocks.stats.extra["cache_copied_bytes"]
    assert copied % block_bytes == 0 and 0 < copied <= len(PROMPTS) * beams * steps * block_bytes < expected
    # what the pool held at most: whole blocks, never more than every beam's rows in blocks of their own
    peak = blocks.stats.extra["cache_peak_bytes"]
    assert peak % block_bytes == 0 and 0 < peak <= len(PROMPTS) * beams * -(-(prompt + steps) // 16) * block_bytes
    assert "cache_peak_bytes" not in static.stats.extra


def test_scores_are_summed_logprobs_over_length_to_the_penalty(tiny_with_eos):
    """sequences_score = sum of the tokens' log-probabilities / (new tokens, EOS included) ** length_penalty."""
    _, model, eos = tiny_with_eos
    out = beam_search(model, PROMPTS, num_beams=3, num_return_sequences=3, length_penalty=0.7, max_new_tokens=10,
                      eos_token_id=eos)
    for row, score in zip(out.rows, out.sequences_scores):
        total = continuation_logprobs(model, row.prompt_ids, row.token_ids).sum().item()
        assert score == pytest.approx(total / len(row.token_ids) ** 0.7, abs=1e-4)
    scores_per_prompt = [out.sequences_scores[:3], out.sequences_scores[3:]]
    assert all(s == sorted(s, reverse=True) for s in scores_per_prompt)  # best first


def test_one_beam_is_greedy(tiny_with_eos):
    hf_model, model, eos = tiny_with_eos
    greedy = generate(model, PROMPTS, max_new_tokens=12, eos_token_id=eos)
    for early_stopping in (False, "never"):  # transformers ignores the beam options with one beam
        out = beam_search(model, PROMPTS, num_beams=1, length_penalty=2.0, early_stopping=early_stopping,
                          max_new_tokens=12, eos_token_id=eos)
        assert out.token_ids == greedy.token_ids
    tokens, key_valid, _ = pad_left(PROMPTS)
    hf = hf_model.generate(tokens, attention_mask=key_valid.long(), num_beams=1, do_sample=False, max_new_tokens=12,
                           eos_token_id=eos, pad_token_id=eos)
    assert [row[: len(mine)] for row, mine in zip(hf[:, tokens.shape[1]:].tolist(), out.token_ids)] == out.token_ids
    row = out.rows[0]
    total = continuation_logprobs(model, row.prompt_ids, row.token_ids).sum().item()
    assert out.sequences_scores[0] == pytest.approx(total / len(row.token_ids) ** 2.0)


def test_beam_search_finds_a_sequence_at_least_as_likely_as_greedy(tiny_with_eos):
    """Not guaranteed in general, but on a fixed-length search (no EOS, length_penalty 0) with
    enough beams it is what beam search is for; checked here on the tiny models."""
    _, model, _ = tiny_with_eos
    greedy = generate(model, PROMPTS[0], max_new_tokens=10, eos_token_id=())
    beams = beam_search(model, PROMPTS[0], num_beams=8, length_penalty=0.0, max_new_tokens=10, eos_token_id=())
    greedy_logprob = continuation_logprobs(model, PROMPTS[0], greedy.rows[0].token_ids).sum().item()
    assert beams.sequences_scores[0] >= greedy_logprob - 1e-5


BAD = [
    (dict(num_beams=0), "num_beams=0"),
    (dict(num_beams=2.5), "num_beams=2.5"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences=3"),
    (dict(num_beams=2, num_return_sequences=0), "num_return_sequences=0"),
    (dict(num_beams=2, early_stopping="sometimes"), "early_stopping='sometimes'"),
    (dict(num_beams=2, length_penalty=float("nan")), "length_penalty=nan"),
    (dict(num_beams=2, do_sample=True, temperature=0.7), "does not sample"),
    (dict(num_beams=2, repetition_penalty=1.3), "repetition_penalty=1.3"),
    (dict(num_beams=2, presence_penalty=0.5), "presence_penalty=0.5"),
    (dict(num_beams=2, frequency_penalty=0.5), "frequency_penalty=0.5"),
    (dict(num_beams=2, stop=("x",)), "stop=('x',)"),
    (dict(num_beams=2, max_new_tokens=0), "max_new_tokens=0"),
    (dict(num_beams=2, max_new_tokens=63), "context of 64"),
]


@pytest.mark.parametrize("options,message", BAD, ids=[m for _, m in BAD])
def test_bad_options_are_refused_in_one_line(options, message):
    _, model = tiny_pair("llama")
    with pytest.raises(BeamSearchError) as error:
        beam_search(model, PROMPTS, **options)
    assert message in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------- the real model


def chat(tokenizer, question):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping,num_return_sequences", [
    (3, 1.0, False, 2), (2, 0.5, True, 1), (4, 2.0, "never", 4)])
def test_same_as_transformers_on_the_real_model(default_model, reference_default_model, num_beams, length_penalty,
                                                early_stopping, num_return_sequences):
    model, tok = default_model
    prompts = [chat(tok, "What is the capital of France? One word."), chat(tok, "Name a color.")]
    settings = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
                    num_return_sequences=num_return_sequences, max_new_tokens=8)
    want_rows, want_scores = hf_beam_search(reference_default_model, prompts, eos=tok.eos_token_id, **settings)
    out = beam_search(model, prompts, tokenizer=tok, **settings)
    assert out.token_ids == want_rows
    assert out.sequences_scores == pytest.approx(want_scores, abs=1e-3)
    assert "Paris" in out.rows[0].text


# ---------------------------------------------------------------- the CLI


@pytest.mark.parametrize("flags,message", [
    (["--num-beams", "0"], "num_beams=0"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "num_return_sequences=3"),
    (["--num-beams", "2", "--temperature", "0.7"], "does not sample"),
    (["--num-beams", "2", "--repetition-penalty", "1.2"], "repetition_penalty=1.2"),
    (["--length-penalty", "2"], "--num-beams"),
    (["--num-beams", "2", "--early-stopping", "maybe"], "--early-stopping"),
])
def test_cli_refuses_bad_beam_options_in_one_line(capsys, flags, message):
    from minillm.infer import main

    assert main(["--prompt", "Hi", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_beam_search_matches_the_api(capsys, default_model):
    from minillm.infer import main

    model, tok = default_model
    assert main(["--prompt", "What is 2+2?", "--num-beams", "3", "--num-return-sequences", "2",
                 "--max-new-tokens", "6", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    api = beam_search(model, chat(tok, "What is 2+2?"), tokenizer=tok, num_beams=3, num_return_sequences=2,
                      max_new_tokens=6)
    assert [line["token_ids"] for line in lines] == api.token_ids
    assert [line["score"] for line in lines] == pytest.approx(api.sequences_scores, abs=1e-4)


def test_cli_beams_on_shared_blocks_give_the_same_beams_and_say_what_they_copied(capsys, default_model):
    """--cache blocks: the same beams as the static cache, and --stats says what each cache's reorders copied."""
    from minillm.infer import main

    copied = {}
    for cache in ("static", "blocks"):
        assert main(["--prompt", "What is 2+2?", "--num-beams", "3", "--max-new-tokens", "12", "--cache", cache,
                     "--json", "--stats"]) == 0
        captured = capsys.readouterr()
        copied[cache] = (json.loads(captured.out.splitlines()[0])["token_ids"],
                         float(re.search(rf"the {cache} cache's reorders copied ([\d.]+) MiB", captured.err)[1]))
    assert copied["blocks"][0] == copied["static"][0]
    assert 0 < copied["blocks"][1] < copied["static"][1]


def test_notebook_runs(run_notebook):
    run_notebook("10_beam_search.ipynb")


def test_continuation_logprobs_match_transformers(tiny_with_eos):
    hf_model, model, _ = tiny_with_eos
    prompt, continuation = [3, 1, 4, 1, 5], [9, 2, 6, 5]
    logits = hf_model(torch.tensor([prompt + continuation])).logits[0].log_softmax(-1)
    want = [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(continuation)]
    assert continuation_logprobs(model, prompt, continuation).tolist() == pytest.approx(want, abs=1e-5)
