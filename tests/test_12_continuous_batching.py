"""Lesson 12 (second part): continuous batching over the paged cache.

References: each request run alone by `generate` (the engine must give every request
exactly those tokens, whatever else shares its forwards, however it arrives, and
through preemption and prefix-cache hits), `paged_attention` (the reference that
gathers one sequence at a time; the packed step's batched attention must equal it),
and the block manager's own counts (nothing may leak once the requests end).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache.blocks import BlockManager
from minillm.cache.paged import PackedSequences, PagedKVCache, packed_attention, paged_attention, slot_mapping
from minillm.decoding.sampling import SamplingConfig
from minillm.decoding.settings import SamplingError
from minillm.runtime.continuous import generate_continuous
from minillm.runtime.engine import Engine
from minillm.strategies.generate import generate

GREEDY = SamplingConfig(max_new_tokens=16, eos_token_id=())


def random_prompts(n: int, vocab: int, seed: int, shared: int = 0, longest: int = 30) -> list[list[int]]:
    """n prompts of random lengths; the first `shared` tokens are the same in all (a system prompt)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (shared,), generator=g).tolist()
    lengths = torch.randint(1, longest, (n,), generator=g).tolist()
    return [system + torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def solo_runs(model, prompts, configs) -> list[list[int]]:
    return [generate(model, p, c).rows[0].token_ids for p, c in zip(prompts, configs)]


def run_engine(model, prompts, configs, arrivals, tokenizer=None, **options) -> tuple[list[list[int]], Engine]:
    """Add prompt i at step arrivals[i]; step until everything ends. Returns each request's tokens."""
    engine = Engine(model, tokenizer, **options)
    ids, step = [None] * len(prompts), 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                ids[i] = engine.add_request(prompts[i], configs[i])
        engine.step()
        step += 1
    return [engine.output(i).token_ids for i in ids], engine


def prefill_steps(engine: Engine, request) -> int:
    """Forwards the request took part in before its first token: more than one means a chunked prefill."""
    return sum(request.id in step.requests and step.start < request.token_times[0] for step in engine.timeline)


def assert_nothing_leaked(engine: Engine) -> None:
    m = engine.manager
    assert m.num_free == m.num_blocks and m.ref_counts == [0] * m.num_blocks, "blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting


POOLS = {  # name: (engine options, what must happen)
    "roomy": (dict(block_size=4, num_blocks=200), None),
    "tight: preemption": (dict(block_size=4, num_blocks=13, max_num_seqs=6), "preempted"),
    "small token budget: chunked prefill": (dict(block_size=3, num_blocks=200, max_num_batched_tokens=8,
                                                 max_num_seqs=4), "chunked"),
    "shared system prompt: prefix hits": (dict(block_size=4, num_blocks=200), "hits"),
}


@pytest.mark.parametrize("pool", POOLS)
def test_every_request_equals_its_solo_run(tiny, pool):
    _, model = tiny
    options, must = POOLS[pool]
    prompts = random_prompts(7, model.config.vocab_size, seed=3, shared=13 if must == "hits" else 0)
    configs = [GREEDY.with_(max_new_tokens=n) for n in (16, 3, 20, 9, 16, 1, 12)]
    solo = solo_runs(model, prompts, configs)
    for order_seed in range(3):  # different arrival orders and times
        rng = random.Random(order_seed)
        arrivals = [rng.randint(0, 12) for _ in prompts]
        tokens, engine = run_engine(model, prompts, configs, arrivals, **options)
        assert tokens == solo, f"arrivals {arrivals}"
        assert_nothing_leaked(engine)
        if must == "preempted":
            assert any(r.preemptions for r in engine.requests.values()), "the pool was meant to force preemption"
        if must == "chunked":
            assert max(prefill_steps(engine, r) for r in engine.requests.values()) >= 3
        if must == "hits":
            assert engine.prefix_hit_rate > 0.3


def test_requests_admitted_in_one_step_share_their_prefix(tiny):
    """The first request's prefill registers its full blocks before the forward; the others, admitted in the
    same step, hit them and read keys that the same forward writes (each layer writes before it attends)."""
    _, model = tiny
    prompts = random_prompts(4, model.config.vocab_size, seed=8, shared=17, longest=6)
    tokens, engine = run_engine(model, prompts, [GREEDY] * 4, [0] * 4, block_size=4, num_blocks=60)
    assert tokens == solo_runs(model, prompts, [GREEDY] * 4)
    assert engine.timeline[0].requests == [0, 1, 2, 3] and engine.manager.prefix_hit_tokens == 3 * 16


def test_generate_continuous_returns_rows_in_input_order(tiny):
    _, model = tiny
    prompts = random_prompts(5, model.config.vocab_size, seed=5)
    out = generate_continuous(model, prompts, GREEDY, arrivals=[4, 0, 2, 2, 1],
                              engine_options=dict(block_size=4, num_blocks=40))
    assert out.token_ids == solo_runs(model, prompts, [GREEDY] * 5)
    assert [r.finish_reason for r in out.rows] == ["length"] * 5 and out.stats.forward_passes > 16


# ------------------------------------------------------------------ packed attention == reference


@settings(max_examples=30, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 5), group=st.integers(1, 3), n_kv_head=st.integers(1, 2),
       sequences=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4))
def test_packed_attention_equals_the_reference(data, block_size, group, n_kv_head, sequences):
    """Sequences (tokens already stored, new tokens), a mix of decodes, chunks and prefills, in one packed row."""
    head_dim = 8
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    lengths = [stored + new for stored, new in sequences]
    manager = BlockManager(sum(-(-n // block_size) for n in lengths) + 3, block_size)
    shared = data.draw(st.integers(0, min(lengths) - 1))  # leading tokens every sequence has in common
    tokens = [[0] * shared + [i + 1] * (n - shared) for i, n in enumerate(lengths)]
    tables = []
    for i, ((stored, new), toks) in enumerate(zip(sequences, tokens)):
        tables.append(manager.allocate(i, toks))  # later sequences share the first one's full prefix blocks
        manager.mark_computed(i, len(toks))
    cache = PagedKVCache(1, n_kv_head, head_dim, manager.num_blocks, block_size)
    packed = PackedSequences.build(tables, [s for s, _ in sequences], [n for _, n in sequences], block_size)
    keys = torch.randn(max(lengths), n_kv_head, head_dim, generator=g)  # keys of position p: the same in all
    values = torch.randn(max(lengths), n_kv_head, head_dim, generator=g)  # sequences (shared blocks hold them once)
    for table, n in zip(tables, lengths):
        cache.write(0, slot_mapping(table, range(n), block_size), keys[:n], values[:n])
    q = torch.randn(1, n_kv_head * group, packed.num_tokens, head_dim, generator=g)
    out = packed_attention(q, cache.k[0], cache.v[0], packed)
    for i, (stored, new) in enumerate(sequences):
        first, end = packed.query_starts[i], packed.query_starts[i + 1]
        positions = torch.arange(stored, stored + new)[None]
        expected = paged_attention(q[:, :, first:end], cache, 0, [tables[i]], [lengths[i]], positions)
        torch.testing.assert_close(out[:, :, first:end], expected, atol=1e-5, rtol=1e-5)


def test_the_paged_backend_leaves_other_steps_to_the_model_backend(tiny):
    _, model = tiny
    prompt = random_prompts(1, model.config.vocab_size, seed=9)[0]
    before = generate(model, prompt, GREEDY).rows[0].token_ids
    generate_continuous(model, [prompt], GREEDY, engine_options=dict(block_size=4, num_blocks=40))  # wraps the backend
    assert all(type(block.attn.backend).__name__ == "PagedAttention" for block in model.blocks)
    assert generate(model, prompt, GREEDY).rows[0].token_ids == before  # ...and plain generation is unchanged


# ------------------------------------------------------------------ per-request settings


def test_a_sampled_request_depends_only_on_its_prompt_settings_and_seed(tiny):
    _, model = tiny
    prompts = random_prompts(6, model.config.vocab_size, seed=7)
    sampled = [SamplingConfig(max_new_tokens=14, eos_token_id=(), do_sample=True, temperature=1.2, top_k=30,
                              seed=11 + i) for i in range(3)]
    others = [GREEDY, SamplingConfig(max_new_tokens=10, eos_token_id=(), do_sample=True, top_p=0.8, seed=5),
              SamplingConfig(max_new_tokens=12, eos_token_id=(), repetition_penalty=1.5, frequency_penalty=0.5)]
    alone = solo_runs(model, prompts, sampled + others)
    for arrivals in ([0] * 6, [3, 0, 5, 1, 1, 0], [0, 9, 2, 4, 0, 7]):
        tokens, _ = run_engine(model, prompts, sampled + others, arrivals, block_size=4, num_blocks=30)
        assert tokens == alone, f"arrivals {arrivals}"


@pytest.mark.parametrize("length, copies", [(13, 2), (12, 0)], ids=["partial-last-block", "whole-blocks"])
def test_n_choices_compute_their_prompt_once_and_draw_what_separate_requests_draw(tiny, length, copies):
    """Three samples of one prompt (a server's n=3): added together, the prompt is prefilled once and the others
    fork its blocks; each draws the tokens it draws alone. With the prefix cache off, separate requests compute the
    prompt three times. The two that write into the shared partial last block first copy it; the last writes in
    place; a prompt of whole blocks shares them all and copies nothing."""
    _, model = tiny
    (prompt,) = random_prompts(1, model.config.vocab_size, seed=8, shared=length, longest=2)
    prompt = prompt[:length]
    configs = [SamplingConfig(max_new_tokens=9, eos_token_id=(), do_sample=True, temperature=1.3, seed=s)
               for s in (1, 2, 3)]
    alone = solo_runs(model, [prompt] * 3, configs)
    grouped = Engine(model, block_size=4, num_blocks=40, prefix_caching=False)
    ids = grouped.add_requests(prompt, configs)
    while grouped.has_unfinished():
        grouped.step()
    assert [grouped.output(i).token_ids for i in ids] == alone and len(set(map(tuple, alone))) == 3
    assert sum(s.prefill_tokens for s in grouped.timeline) == length
    assert sum(s.blocks_copied for s in grouped.timeline) == copies
    separate, engine = run_engine(model, [prompt] * 3, configs, [0, 0, 0], block_size=4, num_blocks=40,
                                  prefix_caching=False)
    assert separate == alone and sum(s.prefill_tokens for s in engine.timeline) == 3 * length
    assert_nothing_leaked(grouped)


def test_a_held_request_is_continued_by_a_fork_that_feeds_one_token(tiny):
    """hold=True keeps a finished request's blocks; continue_request forks them and feeds only the new token, and
    gives what generate gives the whole text; release frees the blocks; a request not held is refused."""
    _, model = tiny
    (prompt,) = random_prompts(1, model.config.vocab_size, seed=10, shared=13, longest=2)
    engine = Engine(model, block_size=4, num_blocks=40)
    (parent,) = engine.add_requests(prompt, [SamplingConfig(max_new_tokens=1, eos_token_id=())], hold=True)
    while engine.has_unfinished():
        engine.step()
    held = engine.manager.num_free
    children = [engine.continue_request(parent, token, GREEDY) for token in (5, 9)]
    assert engine.manager.num_free == held  # forks take no block until they write
    engine.release(parent)
    while engine.has_unfinished():
        engine.step()
    for child, token in zip(children, (5, 9)):
        assert engine.output(child).token_ids == solo_runs(model, [prompt + [token]], [GREEDY])[0]
    assert sum(step.prefill_tokens for step in engine.timeline) == len(prompt) + 2  # the children fed one token each
    assert sum(step.blocks_copied for step in engine.timeline) == 1  # 13 + 1 tokens: one shared partial block
    with pytest.raises(ValueError, match="cannot be continued: only a finished request added with hold=True"):
        engine.continue_request(children[0], 1, GREEDY)
    for child in children:
        engine.release(child)
    assert_nothing_leaked(engine)


def test_an_aborted_leader_leaves_its_forks_to_compute_their_own_prompt(tiny):
    _, model = tiny
    (prompt,) = random_prompts(1, model.config.vocab_size, seed=9, shared=10, longest=2)
    engine = Engine(model, block_size=4, num_blocks=40, max_num_batched_tokens=16)
    leader, follower = engine.add_requests(prompt, [GREEDY, GREEDY])
    engine.abort(leader)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(follower).token_ids == solo_runs(model, [prompt], [GREEDY])[0]
    assert_nothing_leaked(engine)


# ------------------------------------------------------------------ events and stopping


def test_events_are_the_ones_generate_yields(default_model):
    """Text pieces, stop strings, EOS and an empty request, per request, against `generate` streaming alone."""
    model, tokenizer = default_model
    prompts = ["The capital of France is", "List three colours:", "Count: one, two,", "Hi"]
    configs = [SamplingConfig(max_new_tokens=12), SamplingConfig(max_new_tokens=30, stop=("\n",)),
               SamplingConfig(max_new_tokens=14, stop=(" five",)), SamplingConfig(max_new_tokens=0)]
    expected = []
    for prompt, config in zip(prompts, configs):
        events = list(generate(model, prompt, config, tokenizer=tokenizer, stream=True))
        expected.append([(e.token_ids, e.text, e.finish_reason) for e in events])
    engine = Engine(model, tokenizer, block_size=16, num_blocks=64)
    ids = [engine.add_request(p, c) for p, c in zip(prompts, configs)]
    seen = {i: [] for i in ids}
    while engine.has_unfinished():
        for e in engine.step():
            seen[e.row].append((e.token_ids, e.text, e.finish_reason))
    assert [seen[i] for i in ids] == expected
    assert {engine.output(i).finish_reason for i in ids} >= {"stop", "length"}


def test_a_request_that_fills_the_context_stops_with_length(tiny):
    _, model = tiny
    context = model.config.context_length
    prompt = random_prompts(1, model.config.vocab_size, seed=2, shared=context - 4, longest=2)[0]
    engine = Engine(model, block_size=8, num_blocks=20)
    request = engine.add_request(prompt, GREEDY.with_(max_new_tokens=50))
    while engine.has_unfinished():
        engine.step()
    out = engine.output(request)
    assert len(prompt) + len(out.token_ids) == context and out.finish_reason == "length"


# ------------------------------------------------------------------ bad input never stops the others


def test_bad_requests_get_one_clear_error_and_the_engine_keeps_serving(tiny):
    _, model = tiny
    prompts = random_prompts(3, model.config.vocab_size, seed=4)
    engine = Engine(model, block_size=4, num_blocks=12)
    good = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    engine.step()
    with pytest.raises(ValueError, match=r"40 prompt tokens \+ 16 new tokens needs 14 blocks of 4, but the pool "
                                         r"has 12: lower max_new_tokens"):
        engine.add_request(list(range(40)), GREEDY)
    with pytest.raises(SamplingError, match="temperature=-1 is invalid"):
        engine.add_request(prompts[2], temperature=-1)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="add_request takes one prompt, got 2"):
        engine.add_request([[1, 2], [3]], GREEDY)
    with pytest.raises(ValueError, match="unknown request 99"):
        engine.abort(99)
    doomed = engine.add_request(prompts[2], GREEDY)
    engine.step()
    engine.abort(doomed)
    assert engine.output(doomed).finish_reason == "abort"
    with pytest.raises(ValueError, match=f"request {doomed} already finished \\(abort\\)"):
        engine.abort(doomed)
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match=f"request {good[0]} already finished \\(length\\)"):
        engine.abort(good[0])
    assert [engine.output(i).token_ids for i in good] == solo_runs(model, prompts[:2], [GREEDY] * 2)
    assert_nothing_leaked(engine)


def test_impossible_engine_settings_are_refused(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 is invalid: must be an integer >= max_num_seqs=8"):
        Engine(model, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_num_seqs=0 is invalid"):
        Engine(model, max_num_seqs=0)
    with pytest.raises(ValueError, match=r"watermark=1.5 is invalid: a share of the pool in \[0, 1\)"):
        Engine(model, watermark=1.5)


def test_a_watermark_keeps_blocks_free_at_admission_and_every_request_its_tokens(tiny):
    """Two 12-token prompts in a pool of 8 blocks of 4: without a watermark both are admitted at once (3 + 3
    blocks). Keeping half the pool free while anything runs, the second waits: admitting it would leave 2 of the 4
    blocks the watermark keeps. Both get the tokens they get alone."""
    _, model = tiny
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist() for _ in range(2)]
    config = SamplingConfig(max_new_tokens=4, eos_token_id=())
    for watermark, together in ((0.0, True), (0.5, False)):
        tokens, engine = run_engine(model, prompts, [config, config], [0, 0], block_size=4, num_blocks=8,
                                    watermark=watermark, prefix_caching=False)
        assert tokens == solo_runs(model, prompts, [config, config])
        assert (sorted(engine.timeline[0].requests) == [0, 1]) is together

# ------------------------------------------------------------------ the real model


def test_default_model_requests_equal_their_solo_runs(default_model):
    """Chat prompts sharing a system prompt, staggered arrivals, and a pool small enough to preempt."""
    model, tokenizer = default_model
    system = "You are a helpful assistant. You answer every question in one or two full sentences."
    questions = ["What is the capital of France?", "Name a colour.", "What is two plus two?",
                 "Who wrote Hamlet?", "What do bees make?"]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                               {"role": "user", "content": q}])) for q in questions]
    configs = [SamplingConfig(max_new_tokens=24)] * 4 + [SamplingConfig(max_new_tokens=24, do_sample=True, seed=3)]
    solo = [generate(model, p, c, tokenizer=tokenizer).rows[0].token_ids for p, c in zip(prompts, configs)]
    tokens, engine = run_engine(model, prompts, configs, [0, 0, 3, 5, 6], tokenizer, block_size=8, num_blocks=14)
    assert tokens == solo
    assert engine.prefix_hit_rate > 0.3 and any(r.preemptions for r in engine.requests.values())
    assert_nothing_leaked(engine)


def test_notebook_runs(run_notebook):
    run_notebook("12_continuous_batching.ipynb", timeout=600)
