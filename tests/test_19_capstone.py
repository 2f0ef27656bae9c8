"""Lesson 19: the capstone engine (lessons/19-capstone/engine.py), one file rebuilt from scratch.

References, none of them the capstone's own code:
- the package's `generate` run on each request alone (and its continuous-batching engine): the
  capstone must give every greedy request exactly those tokens, however the requests arrive,
  whatever shares their forwards, through preemption, with prompt lookup on or off;
- the package's logits processors and transformers' warpers on fixed logits, and the package's
  seeded sampling (same seed, same tokens);
- a contiguous cache (the package's DynamicCache, filled by the package's model): every key and
  value the capstone's block tables point at, in every layer;
- counts of the pool: every block is held by one running request or free, and all are free at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minillm.cache.kv_cache import DynamicCache
from minillm.decoding.sampling import SamplingConfig, process_logits
from minillm.model.tiny import tiny_pair
from minillm.runtime.continuous import generate_continuous
from minillm.strategies.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons" / "19-capstone"))
from engine import Engine, Model, Params, propose, sample, warp

ARRIVALS = [[0, 0, 0, 0, 0], [0, 1, 2, 3, 4], [0, 0, 5, 5, 11], [3, 0, 7, 1, 2]]


def tiny(kind: str = "llama", seed: int = 1):
    return tiny_pair(kind, seed=seed, context_length=128)[1]


def held_out_prompts(seed: int, lengths=(5, 17, 9, 30, 3), vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompts, max_new_tokens=20, **options) -> list[list[int]]:
    return [generate(model, p, max_new_tokens=max_new_tokens, compile=False, **options).rows[0].token_ids
            for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("lookup", [0, 4])
def test_greedy_tokens_equal_the_package_for_staggered_batches(kind, lookup):
    """Five held-out prompts arriving at different steps, three at most in a batch, a pool of 14 blocks of 4
    slots: requests are preempted and recomputed, and each still gets the tokens `generate` gives it alone."""
    model = tiny(kind)
    capstone = Model.from_minillm(model)
    for trial, arrivals in enumerate(ARRIVALS):
        prompts = held_out_prompts(100 + trial)
        engine = Engine(capstone, num_blocks=14, block_size=4, max_batch=3, lookup=lookup)
        out = engine.run(prompts, Params(max_new_tokens=20), arrivals=arrivals)
        assert [r.generated for r in out] == alone(model, prompts), (kind, lookup, arrivals)
        assert engine.pool.num_free == 14
    prefills = sum(kind == "prefill" for step in engine.history for _, _, kind, _ in step["fed"])
    assert prefills > len(prompts), "the small pool should have preempted someone"


def test_a_batch_equals_the_package_engine():
    model = tiny("qwen2", seed=3)
    prompts, arrivals = held_out_prompts(7, lengths=(12, 4, 25, 8)), [0, 2, 2, 6]
    package = generate_continuous(model, prompts, max_new_tokens=24, arrivals=arrivals)
    out = Engine(Model.from_minillm(model), block_size=8, num_blocks=32).run(prompts, Params(max_new_tokens=24),
                                                                             arrivals=arrivals)
    assert [r.generated for r in out] == [row.token_ids for row in package.rows]


def test_prompt_lookup_gives_plain_greedy_tokens_and_rolls_back():
    model = tiny("llama", seed=2)
    capstone = Model.from_minillm(model)
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(0, 96, (6,), generator=g).tolist()
    prompts = [phrase * 4, phrase[:3] * 5 + phrase, held_out_prompts(9, lengths=(20,))[0] * 2]
    plain = Engine(capstone, block_size=4, num_blocks=64).run(prompts, Params(max_new_tokens=30))
    looked = Engine(capstone, block_size=4, num_blocks=64, lookup=5)
    out = looked.run(prompts, Params(max_new_tokens=30), arrivals=[0, 1, 4])
    assert [r.generated for r in out] == [r.generated for r in plain] == alone(model, prompts, 30)
    accepted, drafted = sum(r.accepted for r in out), sum(r.drafted for r in out)
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts were both kept and rolled back
    steps = sum(1 for step in looked.history for fed in step["fed"] if fed[1] == 1 or fed[2] == "verify")
    assert steps < sum(len(r.generated) for r in out), "verifying drafts should save forwards"
    assert looked.pool.num_free == 64


def test_a_draft_shrinks_before_anyone_is_preempted():
    """Two requests hold the whole pool, 4 blocks of 8 slots. The second, the most recently admitted, would feed
    its token and a 3-token draft, 19 keys, 3 blocks: rather than preempt itself (no one else is newer), its draft
    shrinks to what fits, and it decodes. The prompts are picked so that prompt lookup finds a draft for both."""
    model = tiny("llama")
    capstone = Model.from_minillm(model)
    g = torch.Generator().manual_seed(21)
    while True:  # prompts whose first greedy token already occurs in them, so the lookup has something to copy
        prompts = [torch.randint(0, 12, (n,), generator=g).tolist() for n in (11, 15)]
        if all(alone(model, [p], 1)[0][0] in p for p in prompts):
            break
    engine = Engine(capstone, num_blocks=4, block_size=8, lookup=3, max_batch=2)
    first, second = (engine.add_request(p, Params(max_new_tokens=n)) for p, n in zip(prompts, (12, 9)))
    engine.step()  # both prefill (2 blocks each) and draw their first token
    assert all(propose(r.tokens, 3) for r in (first, second)) and engine.pool.num_free == 0
    plan = {r.id: feed for r, feed in engine.schedule()}
    assert engine.running == [first, second] and not engine.waiting  # nobody preempted
    assert len(plan[second.id]) == 1 and len(plan[first.id]) > 1  # its draft gone; the first keeps its own


def test_propose_copies_what_followed_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # the latest "1 2 3"
    assert propose([4, 2, 3, 8, 1, 5, 3], 2) == [8, 1]  # no "5 3" earlier: the 1-gram "3"
    assert propose([1, 2, 3], 4) == [] and propose([7], 4) == []


def test_blocks_are_held_once_and_all_return_to_the_free_list():
    """Stepping by hand: after every step each block is either free or in exactly one running request's
    table, the free list holds no block twice, and once every request is done all blocks are free."""
    capstone = Model.from_minillm(tiny("llama"))
    prompts = held_out_prompts(11, lengths=(9, 22, 3, 14, 6, 17))
    arrivals = [0, 0, 1, 4, 4, 9]
    engine = Engine(capstone, num_blocks=12, block_size=4, max_batch=4, lookup=3)
    step = 0
    while step <= max(arrivals) or engine.waiting or engine.running:
        for prompt, arrival in zip(prompts, arrivals):
            if arrival == step:
                engine.add_request(prompt, Params(max_new_tokens=18 if arrival % 2 else 9))
        engine.step()
        held = [b for r in engine.running for b in r.blocks]
        assert len(held) == len(set(held)), "a block in two tables"
        assert len(engine.pool.free_blocks) == len(set(engine.pool.free_blocks)), "a block freed twice"
        assert sorted(held + engine.pool.free_blocks) == list(range(12))
        assert all(not r.blocks for r in engine.waiting)
        step += 1
    assert engine.pool.num_free == 12 and not engine.running


def test_block_tables_hold_what_a_contiguous_cache_holds():
    """Mid-run, every running request's keys and values read through its block table equal those the package's
    model writes into a contiguous cache for the same tokens, in every layer."""
    model = tiny("qwen2", seed=4)
    capstone = Model.from_minillm(model)
    engine = Engine(capstone, num_blocks=20, block_size=4, max_batch=3, lookup=4)
    prompts = held_out_prompts(13, lengths=(7, 19, 4, 11))
    checked = 0
    for step in range(26):
        if step in (0, 2, 3, 8):
            engine.add_request(prompts[(0, 2, 3, 8).index(step)], Params(max_new_tokens=16))
        engine.step()
        for r in engine.running:
            n = r.computed
            cache = DynamicCache(model.config.n_layer)
            with torch.no_grad():
                model(torch.tensor([r.tokens[:n]]), torch.arange(n)[None], cache=cache)
            table = torch.tensor(r.blocks)
            for layer in range(model.config.n_layer):
                for pool, contiguous in ((engine.kv.k, cache.keys), (engine.kv.v, cache.values)):
                    paged = pool[layer][table].flatten(0, 1)[:n]  # [n, KV, hd]
                    torch.testing.assert_close(paged, contiguous[layer][0].transpose(0, 1), atol=2e-5, rtol=1e-5)
            checked += 1
    assert checked > 20


# ------------------------------------------------------------------ sampling


SETTINGS = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.8),
            dict(temperature=0.5, top_k=40, top_p=0.95), dict(temperature=1.0, top_k=1)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_warping_equals_the_package_and_transformers(settings):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 3
    package = process_logits(logits, SamplingConfig(do_sample=True, **settings), None)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if settings.get("top_k"):
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p"):
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    hf = warpers(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    for row in range(3):
        mine = warp(logits[row], Params(**settings))
        torch.testing.assert_close(mine, package[row])
        torch.testing.assert_close(mine, hf[row])


def test_draws_follow_the_warped_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    params = Params(temperature=0.9, top_k=4, top_p=0.9)
    probs = warp(logits, params).softmax(-1)
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, params, generator) for _ in range(4000)]), minlength=6)
    assert counts[probs == 0].sum() == 0  # removed tokens are never drawn
    torch.testing.assert_close(counts / 4000, probs, atol=0.03, rtol=0)
    assert sample(logits, Params(), None) == 0  # temperature 0: the argmax


def test_seeded_sampling_equals_the_package_alone_and_in_a_batch():
    model = tiny("llama", seed=6)
    capstone = Model.from_minillm(model)
    prompts = held_out_prompts(17, lengths=(6, 13, 9))
    params = [Params(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=s) for s in (1, 2, 3)]
    expected = [generate(model, p, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                         seed=s, compile=False).rows[0].token_ids for p, s in zip(prompts, (1, 2, 3))]
    out = Engine(capstone, num_blocks=10, block_size=4, lookup=4).run(prompts, params, arrivals=[0, 2, 3])
    assert [r.generated for r in out] == expected


def test_what_it_cannot_run_is_refused():
    with pytest.raises(ValueError, match="Llama-family"):
        Model.from_minillm(tiny_pair("gpt2")[1])
    engine = Engine(Model.from_minillm(tiny()), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="does not fit"):
        engine.add_request(list(range(10)), Params(max_new_tokens=7))


# ------------------------------------------------------------------ the real model

HELD_OUT = ["Name three rivers in Africa.",
            "Rewrite in the past tense: I walk to the old mill every morning and I walk back.",
            "What is the boiling point of water at sea level?"]


def test_real_model_greedy_tokens_equal_the_package(default_model):
    model, tok = default_model
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in HELD_OUT]
    expected = alone(model, prompts, 20, tokenizer=tok)
    engine = Engine(Model.from_minillm(model), eos_token_id=tok.eos_token_id, tokenizer=tok, lookup=4)
    out = engine.run(prompts, Params(max_new_tokens=20), arrivals=[0, 1, 3])
    assert [r.generated for r in out] == expected
    assert sum(r.accepted for r in out) > 0  # the rewrite quotes its prompt


def test_notebook_runs(run_notebook):
    run_notebook("19_capstone.ipynb", timeout=600)
