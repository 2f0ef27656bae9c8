"""Lesson 03: sampling (multinomial, temperature, top-k, top-p, min-p).

References: transformers' logits warpers on the same logits (exact tensors), a
chi-square test of the sampler against the processed distribution, hypothesis
properties, and seeded reproducibility on the real default model.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minillm.decoding.sampling import (
    SamplingConfig,
    SamplingError,
    TokenHistory,
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    choose_next,
    process_logits,
    row_generators,
)
from minillm.infer import build_parser, main, sampling_config
from minillm.strategies.generate import generate

NO_IDS = torch.zeros(1, 0, dtype=torch.long)  # the warpers ignore input_ids


def random_logits(batch=4, vocab=50, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def with_edge_rows(logits: torch.Tensor) -> torch.Tensor:
    """Append rows that trip up filters: -inf entries, many ties, a single finite token, all equal."""
    vocab = logits.shape[-1]
    partly_inf = logits[0].clone()
    partly_inf[::3] = -math.inf
    ties = torch.randint(-2, 3, (vocab,), generator=torch.Generator().manual_seed(1)).float()  # integer logits: ties
    one_finite = torch.full((vocab,), -math.inf)
    one_finite[vocab // 2] = 0.5
    flat = torch.zeros(vocab)
    return torch.cat([logits, torch.stack([partly_inf, ties, one_finite, flat])])


LOGITS = with_edge_rows(random_logits())


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), (ours - theirs).abs().nan_to_num(0).max()


# ------------------------------------------------------------------ each warper == transformers'


def test_logit_bias_matches_transformers_sequence_bias_and_comes_first():
    """OpenAI's logit_bias is transformers' sequence bias over one-token sequences; minillm adds it before every
    other processor (llama.cpp's order), so a +100 token survives a top-k of 1 and a -100 one never does."""
    bias = {3: 100.0, 7: -100.0, 11: 2.5}
    theirs = SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()})(NO_IDS, LOGITS.clone())
    assert_same(process_logits(LOGITS, SamplingConfig(logit_bias=bias), None), theirs)
    kept = process_logits(LOGITS[:4], SamplingConfig(do_sample=True, top_k=1, logit_bias=bias), None)
    assert (kept.argmax(-1) == 3).all() and (kept[:, 7] == -math.inf).all()
    assert SamplingConfig(logit_bias={5: 1.0}).logit_bias == ((5, 1.0),)  # a tuple: rows group by their settings
    for bad in ({-1: 1.0}, {5: 101.0}, {5: float("nan")}, {"5": 1.0}):
        with pytest.raises(SamplingError):
            SamplingConfig(logit_bias=bad)


def test_logit_bias_steers_generation_and_a_token_outside_the_vocabulary_is_named():
    from minillm.model.tiny import tiny_pair

    model = tiny_pair("llama")[1]
    prompt = [[1, 2, 3]]
    plain = generate(model, prompt, max_new_tokens=6)
    first = plain.token_ids[0][0]
    banned = generate(model, prompt, SamplingConfig(max_new_tokens=6, logit_bias={first: -100}))
    assert banned.token_ids[0][0] != first
    forced = generate(model, prompt, SamplingConfig(max_new_tokens=6, logit_bias={9: 100}))
    assert forced.token_ids[0] == [9] * 6
    with pytest.raises(SamplingError, match="token ids below 96 .* 100000 is not"):
        generate(model, prompt, SamplingConfig(max_new_tokens=2, logit_bias={100000: 1}))
    args = build_parser().parse_args(["--prompt", "x", "--logit-bias", "9=100", "--logit-bias", "4=-2.5"])
    assert sampling_config(args).logit_bias == ((4, -2.5), (9, 100.0))
    with pytest.raises(ValueError, match="--logit-bias 'nine=1' is invalid: write ID=VALUE"):
        sampling_config(build_parser().parse_args(["--prompt", "x", "--logit-bias", "nine=1"]))


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 1.3, 10.0])
def test_temperature_matches_transformers(temperature):
    assert_same(apply_temperature(LOGITS, temperature), TemperatureLogitsWarper(temperature)(NO_IDS, LOGITS.clone()))


@pytest.mark.parametrize("k", [1, 2, 5, 10, 49, 50, 51, 1000])  # vocab is 50: k == vocab and k > vocab included
def test_top_k_matches_transformers(k):
    ours = apply_top_k(LOGITS, k)
    assert_same(ours, TopKLogitsWarper(k)(NO_IDS, LOGITS.clone()))
    assert bool((ours > -math.inf).any(dim=-1).all()), "a row lost every token"


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    kept = apply_top_k(logits, 2) > -math.inf  # best is 3, second best 2 -- held by three tokens
    assert kept.tolist() == [[True, False, True, True, True, False]]
    assert_same(apply_top_k(logits, 2), TopKLogitsWarper(2)(NO_IDS, logits.clone()))


def test_top_k_zero_disables_it_and_nothing_is_implied():
    assert apply_top_k(LOGITS, 0) is LOGITS
    config = SamplingConfig(do_sample=True)  # transformers would add top_k=50 here; we do not
    logits = random_logits(vocab=200)
    assert bool((process_logits(logits, config, None) > -math.inf).all())


@pytest.mark.parametrize("p", [1.0, 0.999, 0.9, 0.5, 0.1, 1e-3, 1e-9])
def test_top_p_matches_transformers(p):
    ours = apply_top_p(LOGITS, p)
    assert_same(ours, TopPLogitsWarper(p)(NO_IDS, LOGITS.clone()))
    assert bool((ours > -math.inf).any(dim=-1).all()), "a row lost every token"


def test_tiny_top_p_keeps_exactly_the_best_token():
    logits = random_logits(batch=8, vocab=300)
    kept = apply_top_p(logits, 1e-9) > -math.inf
    assert kept.sum(dim=-1).tolist() == [1] * 8
    assert torch.equal(kept.float().argmax(dim=-1), logits.argmax(dim=-1))


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 0.9, 1.0])
def test_min_p_matches_transformers(min_p):
    ours = apply_min_p(LOGITS, min_p)
    assert_same(ours, MinPLogitsWarper(min_p)(NO_IDS, LOGITS.clone()))
    assert bool((ours > -math.inf).any(dim=-1).all()), "a row lost every token"


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,penalty", [
    (1.0, 0, 1.0, 0.0, 1.0),
    (0.7, 20, 0.9, 0.0, 1.2),
    (1.5, 5, 0.5, 0.05, 0.8),
    (0.3, 3, 1.0, 0.2, 2.0),
    (2.0, 100, 0.95, 0.1, 1.0),
])
def test_processing_order_matches_transformers(temperature, top_k, top_p, min_p, penalty):
    """The whole chain: repetition penalty, then temperature, top-k, top-p, min-p (generate()'s order)."""
    vocab = 60
    logits = with_edge_rows(random_logits(batch=3, vocab=vocab, seed=3))
    history_ids = torch.randint(0, vocab, (len(logits), 9), generator=torch.Generator().manual_seed(4))
    history = TokenHistory.from_prompts(history_ids.tolist(), vocab)
    config = SamplingConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=penalty)
    chain = [RepetitionPenaltyLogitsProcessor(penalty)]
    chain += [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
    chain += [TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)]
    assert_same(process_logits(logits, config, history), LogitsProcessorList(chain)(history_ids, logits.clone()))


def test_greedy_ignores_the_warpers():
    """temperature / top-k / top-p / min-p only act when sampling; temperature 0 is greedy."""
    logits = random_logits()
    for config in (SamplingConfig(top_k=1, top_p=0.1, min_p=0.9, temperature=0.1),
                   SamplingConfig(do_sample=True, temperature=0, top_k=1)):
        assert config.greedy
        assert torch.equal(process_logits(logits, config, None), logits)
        assert torch.equal(choose_next(process_logits(logits, config, None), config, None), logits.argmax(-1))


def test_processors_do_not_modify_their_input():
    logits = LOGITS.clone()
    config = SamplingConfig(do_sample=True, temperature=0.5, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5,
                            presence_penalty=0.5, frequency_penalty=0.5)
    history = TokenHistory.from_prompts([[1, 2, 3]] * len(logits), logits.shape[-1])
    history.add(torch.full((len(logits),), 7))
    process_logits(logits, config, history)
    assert torch.equal(logits, LOGITS)


# ------------------------------------------------------------------ the sampler draws from the processed distribution


def draw(logits: torch.Tensor, config: SamplingConfig, n: int) -> torch.Tensor:
    """n seeded draws for one row of logits [1, V], through the same path as generate()."""
    processed = process_logits(logits, config, None)
    generators = row_generators(config, 1)
    return torch.cat([choose_next(processed, config, generators) for _ in range(n)])


@pytest.mark.parametrize("config", [
    SamplingConfig(do_sample=True, seed=0),
    SamplingConfig(do_sample=True, temperature=0.6, seed=1),
    SamplingConfig(do_sample=True, temperature=1.4, top_k=5, seed=2),
    SamplingConfig(do_sample=True, top_p=0.8, seed=3),
    SamplingConfig(do_sample=True, temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, seed=4),
], ids=["multinomial", "T=0.6", "T=1.4,top-k=5", "top-p=0.8", "all"])
def test_empirical_frequencies_match_processed_probabilities(config):
    vocab, n = 10, 20_000
    logits = random_logits(batch=1, vocab=vocab, seed=5, scale=1.5)
    probs = process_logits(logits, config, None).softmax(-1)[0].double()
    counts = torch.bincount(draw(logits, config, n), minlength=vocab).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    expected = probs[kept] / probs[kept].sum() * n  # renormalised in float64: chisquare checks the totals agree
    result = chisquare(counts[kept].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (result, counts, probs * n)


def test_filtered_tokens_never_appear():
    vocab = 1000
    logits = random_logits(batch=1, vocab=vocab, seed=6, scale=2.0)
    for config in (SamplingConfig(do_sample=True, top_k=7, seed=0), SamplingConfig(do_sample=True, top_p=0.3, seed=0)):
        allowed = set(torch.nonzero(process_logits(logits, config, None)[0] > -math.inf).flatten().tolist())
        assert 1 < len(allowed) < vocab
        drawn = set(draw(logits, config, 5000).tolist())
        assert drawn <= allowed
        assert len(drawn) > 1


def test_rows_sample_from_their_own_streams():
    """Each row's generator is seeded with the seed: a row draws the same alone or in a batch."""
    config = SamplingConfig(do_sample=True, seed=11)
    logits = random_logits(batch=3, vocab=40, seed=7, scale=0.5)
    batch_generators, alone_generators = row_generators(config, 3), row_generators(config, 1)
    batched = torch.stack([choose_next(logits, config, batch_generators) for _ in range(50)])  # [50, 3]
    alone = torch.stack([choose_next(logits[1:2], config, alone_generators) for _ in range(50)])  # [50, 1]
    assert torch.equal(batched[:, 1], alone[:, 0])
    assert len(set(alone[:, 0].tolist())) > 1


# ------------------------------------------------------------------ properties (hypothesis)

finite_logits = st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=1, max_size=40)
distinct_logits = st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=1, max_size=40, unique=True)


@settings(max_examples=200, deadline=None)
@given(values=finite_logits, temperature=st.floats(0.05, 5.0), top_k=st.integers(0, 45),
       top_p=st.floats(1e-6, 1.0), min_p=st.floats(0.0, 1.0))
def test_probabilities_sum_to_one(values, temperature, top_k, top_p, min_p):
    config = SamplingConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = process_logits(torch.tensor([values]), config, None).softmax(-1)
    assert math.isclose(probs.sum().item(), 1.0, abs_tol=1e-5)
    assert bool((probs >= 0).all()) and bool((probs > 0).any())


@settings(max_examples=200, deadline=None)
@given(values=distinct_logits, k=st.integers(1, 45))
def test_top_k_keeps_exactly_k_without_ties(values, k):
    logits = torch.tensor([values])
    kept = apply_top_k(logits, k) > -math.inf
    assert kept.sum().item() == min(k, len(values))
    best = set(torch.topk(logits, min(k, len(values))).indices[0].tolist())
    assert set(torch.nonzero(kept[0]).flatten().tolist()) == best


@settings(max_examples=300, deadline=None)
@given(values=distinct_logits, p=st.floats(1e-6, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(values, p):
    logits = torch.tensor([values])
    kept = apply_top_p(logits, p) > -math.inf
    probs = logits.softmax(-1)[0].double()
    m = int(kept.sum())
    if m < len(values):  # the kept tokens are the most probable ones (a prefix, up to equal probabilities)
        assert probs[kept[0]].min() >= probs[~kept[0]].max(), "kept set is not a prefix"
    prefix_mass = probs.sort(descending=True).values.cumsum(0)
    tol = 1e-5  # float32 cumulative sums
    assert prefix_mass[m - 1] >= p - tol, "the kept prefix does not reach p"
    assert m == 1 or prefix_mass[m - 2] < p + tol, "a shorter prefix already reaches p"


# ------------------------------------------------------------------ reproducibility on the real model


def test_same_seed_same_tokens_on_the_default_model(default_model):
    model, tokenizer = default_model
    prompt = "Once upon a time, in a small village by the sea,"
    config = SamplingConfig(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    first = generate(model, prompt, config, tokenizer=tokenizer).rows[0]
    again = generate(model, prompt, config, tokenizer=tokenizer).rows[0]
    other = generate(model, prompt, config.with_(seed=4321), tokenizer=tokenizer).rows[0]
    assert len(first.token_ids) == 24
    assert first.token_ids == again.token_ids and first.text == again.text
    assert other.token_ids != first.token_ids, "a different seed should give a different sample"


# ------------------------------------------------------------------ bad values: one clear line


BAD_VALUES = [
    ("temperature", -0.5), ("temperature", math.inf), ("temperature", math.nan), ("top_k", -1), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.01), ("top_p", math.nan), ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.2), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", -3.0), ("frequency_penalty", 2.01), ("frequency_penalty", math.nan),
    ("max_new_tokens", -1), ("seed", -1), ("seed", 2**64), ("do_sample", "yes"), ("eos_token_id", -2),
    ("stop", [""]),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingConfig(**{field: value})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{field}=") and "must be" in message
    assert info.value.field == field


def test_config_accepts_the_boundaries():
    for fields in (dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0), dict(min_p=1.0), dict(temperature=0.0),
                   dict(top_k=0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(seed=0),
                   dict(repetition_penalty=1e-3), dict(eos_token_id=[2, 3]), dict(stop="\n\n")):
        SamplingConfig(**fields)
    assert SamplingConfig(do_sample=True, temperature=0).greedy and not SamplingConfig(do_sample=True).greedy


CLI_BAD = [
    ["--temperature", "-1"], ["--temperature", "nan"], ["--top-k", "-3"], ["--top-k", "2.5"], ["--top-p", "0"],
    ["--top-p", "1.5"], ["--min-p", "-0.1"], ["--min-p", "2"], ["--repetition-penalty", "0"],
    ["--presence-penalty", "3"], ["--frequency-penalty", "-2.5"], ["--seed", "-1"], ["--seed", "x"],
    ["--max-new-tokens", "-5"], ["--num-return-sequences", "3"], ["--num-return-sequences", "0"],
]


@pytest.mark.parametrize("flags", CLI_BAD, ids=[" ".join(f) for f in CLI_BAD])
def test_cli_rejects_bad_values_in_one_line(flags, capsys, monkeypatch):
    import minillm.speed.load

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the sampling flags were checked")

    monkeypatch.setattr(minillm.speed.load, "load_model", no_load)
    try:
        code = main(["--prompt", "Hello", *flags])
    except SystemExit as exit:  # argparse's own type errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("minillm: error: ")
    assert flags[0] in err and "Traceback" not in err


def test_cli_filters_turn_sampling_on():
    def config(*flags):
        return sampling_config(build_parser().parse_args(["--prompt", "x", *flags]))

    assert config().greedy
    assert not config("--top-p", "0.9").greedy and config("--top-p", "0.9").temperature == 1.0
    assert not config("--temperature", "0.7", "--seed", "3").greedy
    assert config("--greedy", "--top-k", "5").greedy and config("--temperature", "0", "--top-k", "5").greedy


def test_cli_draws_k_samples_per_prompt_as_the_api_does_with_seeds_seed_plus_j(capsys, default_model):
    """--num-return-sequences K without beams: K answers per prompt, the j-th the API's row with seed + j (what the
    server's n choices are); greedy decoding is refused (CLI_BAD), since all K would be the same."""
    import json

    from minillm.strategies.generate import generate

    model, tokenizer = default_model
    assert main(["--prompt", "Name a fruit.", "--prompt", "Name a color.", "--temperature", "0.9", "--seed", "4",
                 "--num-return-sequences", "3", "--max-new-tokens", "8", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Name a fruit."] * 3 + ["Name a color."] * 3
    for question, rows in (("Name a fruit.", lines[:3]), ("Name a color.", lines[3:])):
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                                add_generation_prompt=True))
        expected = [generate(model, [prompt], SamplingConfig(max_new_tokens=8, do_sample=True, temperature=0.9,
                                                             seed=4 + j)).token_ids[0] for j in range(3)]
        assert [line["token_ids"] for line in rows] == expected
    assert len({tuple(line["token_ids"]) for line in lines[:3]}) > 1


def test_notebook_runs(run_notebook):
    run_notebook("03_sampling.ipynb")
