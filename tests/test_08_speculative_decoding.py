"""Lesson 08: speculative decoding changes the speed, never the output.

References: plain decoding (`minillm.strategies.generate.generate`) for greedy runs, token for token;
exact probability arithmetic and brute-force enumeration for sampling; a fresh prefill
for the caches after rollbacks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from minillm.cache.kinds import make_cache
from minillm.cache.kv_cache import StaticCache
from minillm.decoding.sampling import SamplingConfig, process_logits
from minillm.infer import main as cli_main
from minillm.model.tiny import tiny_pair
from minillm.model.transformer import causal_positions
from minillm.strategies.acceptance import (
    acceptance_probability,
    expected_tokens_per_round,
    predicted_speedup,
    residual_distribution,
)
from minillm.strategies.drafters import (
    Draft,
    DraftModel,
    PromptLookup,
    check_same_vocabulary,
    load_draft,
    truncated_draft,
)
from minillm.strategies.generate import generate
from minillm.strategies.speculative import SpeculativeDecoder, speculative_generate

KS = range(1, 9)
TINY_PROMPT = [5, 17, 3, 42, 8, 5, 17, 3, 9, 61, 5, 17]  # repeats, so prompt lookup finds matches


def tiny_drafters(target, kind):
    """Every kind of drafter for a tiny target: a different random model with the same
    vocabulary (mostly rejected), the target's own first block, and prompt lookup."""
    return {"other-model": DraftModel(tiny_pair(kind, seed=1)[1]), "first-layer": DraftModel(truncated_draft(target, 1)),
            "prompt-lookup": PromptLookup()}


def run_rounds(model, drafter, prompt, k, tokenizer=None, **config):
    decoder = SpeculativeDecoder(model, drafter, prompt, SamplingConfig(**config), num_draft_tokens=k,
                                 tokenizer=tokenizer)
    decoder.prefill()
    rounds = []
    while not decoder.finished:
        rounds.append(decoder.round())
    return decoder, rounds


def token_inside_accepted_draft(first_token, rounds, wanted=lambda token, before: token not in before):
    """A token the run emitted as an accepted draft token with more tokens emitted after it in the
    same round, and `wanted` (by default: its first occurrence): (token, its index among the generated tokens)."""
    generated = [first_token]
    for r in rounds:
        for i, token in enumerate(r.emitted):
            if i < min(r.accepted, len(r.emitted) - 1) and wanted(token, generated):
                return token, len(generated)
            generated.append(token)
    return None


# ------------------------------------------------------------------ greedy: identical to plain decoding


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_greedy_identical_to_plain_on_tiny_models(tiny, tiny_kind, cache):
    _, model = tiny
    plain = generate(model, TINY_PROMPT, max_new_tokens=40, eos_token_id=()).rows[0]
    for name, drafter in tiny_drafters(model, tiny_kind).items():
        for k in KS if cache == "static" else (2, 7):
            out = speculative_generate(model, TINY_PROMPT, drafter, num_draft_tokens=k, cache=cache,
                                       max_new_tokens=40, eos_token_id=())
            assert out.rows[0].token_ids == plain.token_ids, f"{name}, k={k}"
            assert out.rows[0].finish_reason == "length"
            assert out.stats.decode_tokens == 39
            assert 0 <= out.stats.extra["accepted"] <= out.stats.extra["drafted"]


def test_greedy_with_penalties_identical_to_plain(tiny, tiny_kind):
    """p and q go through the same processors as plain decoding, penalties included."""
    _, model = tiny
    config = SamplingConfig(max_new_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5, eos_token_id=())
    plain = generate(model, TINY_PROMPT, config).rows[0].token_ids
    for name, drafter in tiny_drafters(model, tiny_kind).items():
        for k in (1, 3, 8):
            assert speculative_generate(model, TINY_PROMPT, drafter, config, num_draft_tokens=k).rows[0].token_ids \
                == plain, f"{name}, k={k}"


class OracleDrafter:
    """Proposes plain greedy's own continuation, so every draft is accepted and a stop token
    can be placed deliberately in the middle of one. With `length`, it proposes that many tokens
    whatever the budget, as a drafter sure of a long copy may."""

    def __init__(self, full_sequence, length: int | None = None):
        self.full, self.length = full_sequence, length

    def begin(self, target, tokenizer, max_len):
        pass

    def propose(self, sequence, n, config, history, generator):
        assert sequence == self.full[:len(sequence)]
        return Draft(self.full[len(sequence):len(sequence) + (self.length or n)])

    def rollback(self, sequence):
        pass


def test_eos_inside_an_accepted_draft_stops_there(tiny, tiny_kind):
    _, model = tiny
    continuation = generate(model, TINY_PROMPT, max_new_tokens=40, eos_token_id=()).rows[0].token_ids
    tested = 0
    for k in KS:
        oracle = OracleDrafter(TINY_PROMPT + continuation)
        decoder, rounds = run_rounds(model, oracle, TINY_PROMPT, k, max_new_tokens=40, eos_token_id=())
        assert all(r.accepted == len(r.drafted) for r in rounds)
        found = token_inside_accepted_draft(decoder.state.token_ids[0], rounds)
        if found is None:  # for this k, every new token's first occurrence ends a round
            continue
        eos, index = found
        tested += 1
        plain = generate(model, TINY_PROMPT, max_new_tokens=40, eos_token_id=eos).rows[0]
        for drafter in (oracle, PromptLookup()):
            out = speculative_generate(model, TINY_PROMPT, drafter, num_draft_tokens=k, max_new_tokens=40,
                                       eos_token_id=eos).rows[0]
            assert plain.finish_reason == out.finish_reason == "eos"
            assert out.token_ids == plain.token_ids and len(out.token_ids) == index + 1 and out.token_ids[-1] == eos
    assert tested >= 6


def test_greedy_identical_to_plain_on_the_default_model(default_model):
    model, tok = default_model
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat this sentence exactly: The old lighthouse "
                                       "keeper climbed the stairs every evening to light the lamp."}])
    plain = generate(model, prompt, tokenizer=tok, max_new_tokens=20)
    draft = DraftModel(truncated_draft(model, 4))
    for k in KS:
        for drafter in (PromptLookup(), draft):
            out = speculative_generate(model, prompt, drafter, tokenizer=tok, num_draft_tokens=k, max_new_tokens=20)
            assert out.rows[0].token_ids == plain.rows[0].token_ids, f"{type(drafter).__name__}, k={k}"
            assert out.rows[0].text == plain.rows[0].text
    assert out.stats.extra["drafted"] > 0


def test_stop_and_eos_inside_an_accepted_draft_on_the_default_model(default_model):
    """Construct the stop deliberately: a word that greedy emits inside a long accepted draft."""
    model, tok = default_model
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat this sentence exactly: Seven silver swans "
                                       "glided across the quiet northern lake before dawn."}])
    decoder, rounds = run_rounds(model, PromptLookup(), tok.encode(prompt), 8, tokenizer=tok, max_new_tokens=24)
    first = decoder.state.token_ids[0]
    eos, eos_index = token_inside_accepted_draft(first, rounds)
    stop_token, stop_index = token_inside_accepted_draft(
        first, rounds, lambda t, before: len(w := tok.decode([t]).strip()) >= 3 and w not in tok.decode(before))
    for overrides, reason, last in (({"eos_token_id": eos}, "eos", eos_index),
                                    ({"stop": [tok.decode([stop_token]).strip()]}, "stop", stop_index)):
        plain = generate(model, prompt, tokenizer=tok, max_new_tokens=24, **overrides).rows[0]
        out = speculative_generate(model, prompt, PromptLookup(), tokenizer=tok, num_draft_tokens=8,
                                   max_new_tokens=24, **overrides).rows[0]
        assert plain.finish_reason == out.finish_reason == reason
        assert out.token_ids == plain.token_ids and len(out.token_ids) == last + 1
        assert out.text == plain.text


# ------------------------------------------------------------------ sampling: the target distribution, exactly


def emitted_distribution(p, q):
    """P(emit y) under the acceptance rule, from the rule's own pieces:
    draw x ~ q, keep it with probability min(1, p/q), else draw from the residual."""
    kept = q * acceptance_probability(p, q)  # P(draft y and keep it)
    return kept + (1 - kept.sum()) * residual_distribution(p, q)


def test_acceptance_rule_leaves_the_target_distribution_unchanged():
    gen = torch.Generator().manual_seed(0)
    config = SamplingConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    for trial in range(200):
        V = 2 + trial % 7
        p_logits, q_logits = torch.randn(2, V, generator=gen, dtype=torch.float64) * 3
        if trial % 3 == 0:  # processed like plain sampling: zeros where top-k/top-p cut
            p_logits, q_logits = process_logits(torch.stack([p_logits, q_logits]), config, None).double()
        p, q = p_logits.softmax(-1), q_logits.softmax(-1)
        if trial % 5 == 0:  # a deterministic drafter: one-hot q
            q = torch.nn.functional.one_hot(torch.randint(V, (), generator=gen), V).double()
        torch.testing.assert_close(emitted_distribution(p, q), p, rtol=0, atol=1e-12)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    torch.testing.assert_close(emitted_distribution(p, p), p)  # q == p: every draft kept


def exact_marginals(model, prompt, config, n_tokens):
    """P(token at generated position j) for j < n_tokens, by enumerating every continuation."""
    V = model.config.vocab_size
    joint = torch.ones(())  # probability of each continuation so far, shape [V] * j
    marginals = []
    for j in range(n_tokens):
        contexts = [prompt + list(c) for c in itertools.product(range(V), repeat=j)]
        tokens = torch.tensor(contexts)
        logits = model(tokens, causal_positions(*tokens.shape))[:, -1]
        probs = process_logits(logits, config, None).softmax(-1).double()  # [V**j, V]
        joint = (joint.reshape(-1, 1) * probs).reshape([V] * (j + 1))
        marginals.append(joint.sum(dim=tuple(range(j))))
    return marginals


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["model", "prompt-lookup"])
def test_speculative_sampling_matches_plain_sampling_statistically(drafter_kind):
    """Many seeded draws: the first four generated tokens follow the target's exact marginals (chi-square)."""
    _, target = tiny_pair("llama", seed=0, vocab_size=8)
    _, draft = tiny_pair("llama", seed=1, vocab_size=8)
    prompt = [1, 2, 3, 1, 2]
    config = SamplingConfig(do_sample=True, temperature=1.2, top_p=0.95, max_new_tokens=4, eos_token_id=())
    with torch.inference_mode():
        expected = exact_marginals(target, prompt, config, 4)
    draws, counts = 1200, torch.zeros(4, 8)
    drafted = accepted = 0
    for seed in range(draws):
        drafter = DraftModel(draft) if drafter_kind == "model" else PromptLookup(max_ngram=2)
        out = speculative_generate(target, prompt, drafter, config, num_draft_tokens=2, seed=seed)
        for j, token in enumerate(out.rows[0].token_ids):
            counts[j, token] += 1
        drafted, accepted = drafted + out.stats.extra["drafted"], accepted + out.stats.extra["accepted"]
    assert 0 < accepted < drafted  # both branches of the rule were exercised
    for j in range(1, 4):  # token 0 comes from the prefill, as in plain sampling; 1..3 from verification
        observed, want = counts[j].double(), expected[j] * draws
        keep = want >= 5
        observed = torch.cat([observed[keep], observed[~keep].sum()[None]])
        want = torch.cat([want[keep], want[~keep].sum()[None]])
        observed, want = observed[want > 0], want[want > 0]
        assert chisquare(observed.numpy(), want.numpy() * observed.sum().item() / want.sum().item()).pvalue > 1e-3, j


def test_seeded_speculative_sampling_is_reproducible():
    _, target = tiny_pair("qwen2", seed=0)
    _, draft = tiny_pair("qwen2", seed=1)
    config = SamplingConfig(do_sample=True, temperature=0.8, max_new_tokens=20, seed=7, eos_token_id=())
    runs = [speculative_generate(target, TINY_PROMPT, DraftModel(draft), config, num_draft_tokens=3).rows[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ caches after rollbacks


def cache_contents(cache, n):
    """Keys and values of the first n tokens, every layer: [n_layer, 1, n_kv_head, n, head_dim] each."""
    if isinstance(cache, StaticCache):
        return cache.k[:, :1, :, :n], cache.v[:, :1, :, :n]
    return torch.stack(cache.keys)[:, :, :, :n], torch.stack(cache.values)[:, :, :, :n]


def assert_cache_holds(model, cache, kind, ids):
    assert cache.length == len(ids)
    fresh = make_cache(kind, model, 1, len(ids) + 1)
    tokens = torch.tensor([ids])
    model(tokens, causal_positions(1, len(ids)), cache=fresh)
    for got, want in zip(cache_contents(cache, len(ids)), cache_contents(fresh, len(ids))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_caches_hold_exactly_the_accepted_tokens_after_rejections(tiny, tiny_kind, cache):
    _, target = tiny
    # Greedy from the target's first block agrees sometimes, not always: rounds with rejections.
    drafter = DraftModel(truncated_draft(target, 1), cache=cache)
    decoder = SpeculativeDecoder(target, drafter, TINY_PROMPT, SamplingConfig(max_new_tokens=40, eos_token_id=()),
                                 num_draft_tokens=4, cache=cache)
    rejected = 0
    with torch.inference_mode():
        decoder.prefill()
        while not decoder.finished:
            r = decoder.round()
            rejected += r.accepted < len(r.drafted)
            sequence = decoder.sequence
            assert_cache_holds(target, decoder.cache, cache, sequence[:-1])  # all but the newest token
            assert drafter.cached == sequence[:len(drafter.cached)] and len(drafter.cached) > len(TINY_PROMPT)
            assert_cache_holds(drafter.model, drafter.cache, cache, drafter.cached)
    assert rejected > 0


# ------------------------------------------------------------------ cost model


def test_cost_model():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    # a = 0.5, k = 2: 1 + 0.5 + 0.25 tokens per round
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert predicted_speedup(0.9, 4, 1.0) < 1  # a draft as slow as the target never pays


# ------------------------------------------------------------------ bad input


def test_bad_input_is_refused_with_one_clear_line(default_model):
    _, target = tiny_pair("llama", seed=0, vocab_size=96)
    _, small_vocab = tiny_pair("llama", seed=1, vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary of 64 tokens but the target has 96"):
        speculative_generate(target, [1, 2, 3], DraftModel(small_vocab), max_new_tokens=4)
    _, tok = default_model

    class ShiftedTokenizer:  # same vocabulary size, different ids
        eos_token_id = tok.eos_token_id

        def encode(self, text):
            return [(i + 1) % 49152 for i in tok.encode(text)]

    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        check_same_vocabulary(target, ShiftedTokenizer(), target, tok)
    for k in (0, -1):
        with pytest.raises(ValueError, match=f"num_draft_tokens={k} is invalid"):
            speculative_generate(target, [1, 2, 3], PromptLookup(), num_draft_tokens=k)
    with pytest.raises(ValueError, match="one prompt at a time"):
        speculative_generate(target, [[1, 2], [3, 4]], PromptLookup())
    with pytest.raises(ValueError, match="does not slide the window"):
        speculative_generate(target, [1, 2, 3], PromptLookup(), max_new_tokens=62)
    with pytest.raises(ValueError, match="use 'static' or 'dynamic'"):
        speculative_generate(target, [1, 2, 3], PromptLookup(), cache="none")
    with pytest.raises(ValueError, match="keep 1..2"):
        load_draft("layers:3", target)


def cli(capsys, *argv):
    code = cli_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_refuses_bad_speculative_flags(capsys):
    code, _, err = cli(capsys, "--prompt", "hi", "--speculative", "prompt-lookup", "--num-draft-tokens", "0")
    assert code == 2 and err.count("\n") == 1 and "--num-draft-tokens=0 is invalid" in err
    code, _, err = cli(capsys, "--prompt", "hi", "--speculative", "model", "--max-new-tokens", "2")
    assert code == 2 and err.count("\n") == 1 and "needs --draft-model" in err


def test_cli_speculative_json_reports_acceptance(capsys, default_model):
    import json

    argv = ["--prompt", "Repeat exactly: red green blue red green blue", "--max-new-tokens", "12", "--json"]
    code, plain, _ = cli(capsys, *argv)
    assert code == 0
    code, spec, _ = cli(capsys, *argv, "--speculative", "model", "--draft-model", "layers:6", "--num-draft-tokens", "3")
    assert code == 0
    plain, spec = json.loads(plain), json.loads(spec)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    extra = spec["stats"]["extra"]
    assert extra["num_draft_tokens"] == 3 and 0 <= extra["accepted"] <= extra["drafted"]
    code, _, err = cli(capsys, "--prompt", "Say hi", "--max-new-tokens", "4", "--speculative", "prompt-lookup",
                       "--stats")
    assert code == 0 and "tokens per target forward" in err


def test_notebook_runs(run_notebook):
    run_notebook("08_speculative_decoding.ipynb", timeout=600)
