"""Mechanism figures: the pictures that show how a lesson's mechanism works, and the data they draw.

A lesson README shows its figures as committed PNGs (lessons/NN-name/figures/), so a missing or
oversized file is a broken page. The notebooks draw the same pictures in cells tagged "mechanism"
(next to the code they explain), and several draw what the package's own objects hold: a block
table, a tree mask, a quantizer's grid, the online softmax's running state, the scheduler's
plan. The pictures are only as right as those data, so each is checked here against an
independent computation (brute force, or the format's definition), without the real model.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from minillm.cache.blocks import BlockManager
from minillm.cache.paged import PagedKVCache, slot_mapping
from minillm.runtime.scheduler import Scheduler
from minillm.runtime.session import Tree, new_token_mask
from minillm.speed import mx
from minillm.speed.attention_kernels import OnlineSoftmax
from minillm.speed.quant import dequantize_int4, dequantize_int8, quantize_int4_groupwise, quantize_int8_per_channel
from minillm.speed.quant_gguf import decode_blocks, encode_blocks

ROOT = Path(__file__).resolve().parent.parent
READMES = sorted(ROOT.glob("lessons/*/README.md"))
MAX_FIGURE_BYTES = 150_000
FIGURE = re.compile(r"\]\((figures/[\w.-]+\.png)\)")

# Every notebook's mechanism cell, and the figure it draws (the same picture its README shows). The data
# the pictures of lessons 00-05, 07, 09 and 10 draw are checked in test_figures_decoding.py; the rest here.
MECHANISM = {
    "00_tokenization": "bpe-merges.png",
    "01_model_and_weights": "decoder-block.png",
    "02_greedy_decoding": "sliding-window.png",
    "03_sampling": "filters.png",
    "04_penalties": "penalties.png",
    "05_precision": "float-bits.png",
    "06_kv_cache": "cache-layouts.png",
    "07_batching": "cache-columns.png",
    "08_speculative_decoding": "verify-round.png",
    "09_streaming": "held-bytes.png",
    "10_beam_search": "beam-steps.png",
    "11_lookahead": "tree-mask.png",
    "12_continuous_batching": "static-vs-continuous.png",
    "13_serving": "request-timeline.png",
    "14_quantization": "quant-grids.png",
    "15_compile_and_export": "decode-graph.png",
    "16_attention_kernels": "online-softmax-tiles.png",
    "17_model_families": "family-switches.png",
    "18_structured_output": "dfa-mask.png",
    "19_capstone": "engine-step.png",
    "20_parallelism": "megatron-split.png",
}


# ------------------------------------------------------------------ the files


@pytest.mark.parametrize("readme", READMES, ids=lambda path: path.parent.name)
def test_readme_figures_exist_and_are_small(readme):
    """Every figure a README shows is committed and small; every committed figure is shown somewhere."""
    lesson = readme.parent
    shown = set(FIGURE.findall(readme.read_text()))
    for name in shown:
        path = lesson / name
        assert path.is_file(), f"{lesson.name}/README.md shows {name}, which does not exist"
        assert path.stat().st_size <= MAX_FIGURE_BYTES, f"{lesson.name}/{name} is over {MAX_FIGURE_BYTES} bytes"
    committed = {f"figures/{path.name}" for path in (lesson / "figures").glob("*.png")}
    assert committed <= shown, f"{lesson.name}: figures no README shows: {sorted(committed - shown)}"


@pytest.mark.parametrize("notebook, figure", MECHANISM.items())
def test_notebook_draws_its_mechanism(notebook, figure):
    """The notebook has a code cell tagged "mechanism", and its lesson's README shows the figure."""
    cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    assert any(cell["cell_type"] == "code" and "mechanism" in cell["metadata"].get("tags", []) for cell in cells), \
        f"{notebook}: no code cell tagged 'mechanism'"
    readme = ROOT / "lessons" / notebook.replace("_", "-") / "README.md"
    assert f"figures/{figure}" in readme.read_text(), f"{readme.parent.name}/README.md does not show {figure}"


# ------------------------------------------------------------------ 08 and 11: the verify masks


def random_parents(rng: random.Random, size: int) -> list[int]:
    """A random tree with parents before children, as drafts are flattened."""
    return [-1] + [rng.randrange(i) for i in range(1, size)]


@pytest.mark.parametrize("seed", range(20))
def test_tree_mask_is_the_ancestor_relation(seed):
    """Lesson 11's mask (and 08's, a chain): node i sees node j exactly when j is i or one of its ancestors,
    at position prefix + depth, and every node sees the whole cached prefix."""
    rng = random.Random(seed)
    parents = random_parents(rng, rng.randrange(1, 14))
    tree = Tree.from_parents(parents)

    def ancestors(i):  # walk up to the root
        found = {i}
        while parents[i] >= 0:
            i = parents[i]
            found.add(i)
        return found

    T = len(parents)
    brute = torch.tensor([[j in ancestors(i) for j in range(T)] for i in range(T)])
    assert torch.equal(tree.mask, brute)
    assert tree.depth.tolist() == [len(ancestors(i)) - 1 for i in range(T)]
    P = rng.randrange(0, 6)
    full = new_token_mask(torch.tensor([P]), tree.mask, P + T)[0]
    assert full[:, :P].all() and torch.equal(full[:, P:], brute)


def test_a_chain_is_the_causal_triangle():
    """Lesson 08 draws its chain of drafts with the tree helpers: a one-branch tree is plain causal attention."""
    for k in range(9):
        chain = Tree.from_parents(list(range(-1, k)))
        assert torch.equal(chain.mask, torch.ones(k + 1, k + 1, dtype=torch.bool).tril())
        assert chain.depth.tolist() == list(range(k + 1))


# ------------------------------------------------------------------ 14: the quantizers' grids


def a_row(seed: int, length: int = 576) -> torch.Tensor:
    """A weight-like row: Gaussian, with a few larger values, as real rows have."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(length, generator=gen) * 0.05
    row[torch.randint(0, length, (4,), generator=gen)] *= 6
    return row


@pytest.mark.parametrize("seed", range(5))
def test_quantizer_grids_follow_their_definitions(seed):
    """Each grid the figure draws (every code decoded with the row's or first group's shared data) equals the
    format's definition: int8 k·max|w|/127, int4 min + q·(max − min)/15, Q4_1 d·q + m with float16 d and m, and
    MXFP4 the 16 E2M1 values times 2^(floor(log2 max|block|) − 2)."""
    row = a_row(seed)
    codes = torch.arange(16, dtype=torch.uint8)

    _, scale = quantize_int8_per_channel(row[None])
    int8 = dequantize_int8(torch.arange(-127, 128, dtype=torch.int8)[None], scale)[0]
    torch.testing.assert_close(int8, torch.arange(-127, 128) * row.abs().max() / 127)

    _, scale, zero = quantize_int4_groupwise(row[None], 64)
    int4 = dequantize_int4(codes[None], scale[:, :1], zero[:, :1])[0]
    low, high = row[:64].min(), row[:64].max()
    torch.testing.assert_close(int4, low + torch.arange(16) * (high - low) / 15)

    _, d, m = decode_blocks(encode_blocks(row[None].numpy(), "Q4_1"), "Q4_1")
    block = row[:32].numpy()
    d_ref = np.float32(np.float16((block.max() - block.min()) / 15))
    m_ref = np.float32(np.float16(block.min()))
    assert (d[0, 0], m[0, 0]) == (d_ref, m_ref)

    _, scale = mx.mx_encode(row[None], "mxfp4")
    grid = mx.mx_decode(codes.repeat(2)[None], scale[:, :1], "mxfp4")[0]
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    exponent = math.floor(math.log2(row[:32].abs().max().item())) - 2
    torch.testing.assert_close(grid.unique(), torch.cat([-e2m1.flip(0), e2m1]).unique() * 2.0 ** exponent)


# ------------------------------------------------------------------ 16: the online softmax, tile by tile


@pytest.mark.parametrize("block_k", [1, 4, 6, 7, 24])
def test_online_softmax_tile_by_tile(block_k):
    """The state the figure draws after each tile: m is the largest score seen so far, l the sum of
    exp(score − m) over the keys seen so far; at the end acc / l (the values an identity) is torch.softmax."""
    gen = torch.Generator().manual_seed(block_k)
    S, hd = 24, 8
    q, k = torch.randn(1, hd, generator=gen), torch.randn(S, hd, generator=gen) * 2
    visible = torch.arange(S) < 21  # the last keys masked, as a causal row sees them
    scores = (q @ k.T / math.sqrt(hd))[0].masked_fill(~visible, float("-inf"))
    state = OnlineSoftmax((1,), S, torch.float32, "cpu", 1 / math.sqrt(hd))
    for k0 in range(0, S, block_k):
        k1 = min(k0 + block_k, S)
        state.update(q, k[k0:k1], torch.eye(S)[k0:k1], visible[k0:k1])
        seen = scores[:k1]
        assert state.m.item() == pytest.approx(seen.max().item(), abs=1e-6)
        assert state.l.item() == pytest.approx(torch.exp(seen - seen.max()).sum().item(), rel=1e-5)
    probabilities, lse = state.result()
    torch.testing.assert_close(probabilities[0], scores.softmax(-1))
    torch.testing.assert_close(lse[0], scores.logsumexp(-1))


# ------------------------------------------------------------------ 06: a paged cache and its block tables


def test_paged_pool_holds_what_the_block_tables_say():
    """The figure's paged run: after an earlier request frees its blocks, two sequences growing in turn hold
    blocks anywhere in the pool, never the same one, each only as many as its tokens need, and the pool holds
    each key at table[p // block_size] * block_size + p % block_size."""
    block, blocks = 4, 8
    manager, pool = BlockManager(blocks, block), PagedKVCache(1, 1, 1, blocks, block)
    manager.allocate("earlier", list(range(100, 108)))
    written = {}  # slot -> (sequence, position): the brute-force record of every write
    for name, length in (("A", 5), ("B", 3)):
        slots = slot_mapping(manager.allocate(name, list(range(length))), range(length), block)
        pool.write(0, slots, torch.arange(length, dtype=torch.float32).view(-1, 1, 1), torch.zeros(length, 1, 1))
        written.update({int(s): (name, p) for p, s in enumerate(slots)})
    manager.free("earlier")
    for _ in range(6):
        for name in ("A", "B"):
            position = manager.num_tokens(name)
            slot = manager.append(name, 0)
            pool.write(0, torch.tensor([slot]), torch.full((1, 1, 1), float(position)), torch.zeros(1, 1, 1))
            written[slot] = (name, position)
    tables = {name: manager.block_table(name) for name in ("A", "B")}
    assert not set(tables["A"]) & set(tables["B"])
    assert {0, 1} & set(tables["A"] + tables["B"]), "the freed blocks are reused"
    for name, table in tables.items():
        n = manager.num_tokens(name)
        assert len(table) == -(-n // block)
        for p in range(n):
            slot = table[p // block] * block + p % block
            assert written[slot] == (name, p) and pool.k[0].flatten(0, 1)[slot, 0, 0] == p
        k, _ = pool.gather(0, table, n)
        assert k[0, :, 0].tolist() == list(range(n))


# ------------------------------------------------------------------ 12: static against continuous batching


@dataclass(eq=False)
class FakeRequest:
    """What the scheduler reads of a request, and how many tokens this one generates."""

    id: int
    tokens: list
    wants: int
    computed: int = 0
    preemptions: int = 0
    wants_prompt_logits: bool = False


def first_steps_from_scheduler(arrivals, slots, static):
    """{request: the step it first ran}, the Scheduler stepped as the notebook's figure steps it."""
    requests = [FakeRequest(i, [1000 * i + t for t in range(4)], wants) for i, (_, wants) in enumerate(arrivals)]
    scheduler = Scheduler(BlockManager(num_blocks=256, block_size=4), max_num_seqs=slots, max_num_batched_tokens=64)
    queue, first, done, step = list(requests), {}, 0, 0
    while done < len(requests):
        if not static or not scheduler.has_unfinished:
            arrived = [r for r in queue if arrivals[r.id][0] <= step]
            for r in arrived[:slots] if static else arrived:
                scheduler.add(r)
                queue.remove(r)
        for r, n in scheduler.schedule().work:
            first.setdefault(r.id, step)
            r.computed += n
            r.tokens.append(0)
            if len(r.tokens) - 4 == r.wants:
                scheduler.remove(r)
                done += 1
        step += 1
    return first


def first_steps_by_hand(arrivals, slots, static):
    """The same schedule from the rules alone: a request runs `wants` consecutive steps from its start;
    continuous: it starts at the first step from its arrival with a free slot (first come, first served);
    static: a batch of up to `slots` arrived requests starts only at a step when nothing runs."""
    start, waiting = {}, list(range(len(arrivals)))
    step = 0
    while waiting:
        running = [i for i in start if start[i] <= step < start[i] + arrivals[i][1]]
        arrived = [i for i in waiting if arrivals[i][0] <= step]
        free = 0 if static and running else slots - len(running)
        for i in arrived[:free]:
            start[i] = step
            waiting.remove(i)
        step += 1
    return start


@pytest.mark.parametrize("seed", range(12))
def test_scheduler_timeline_matches_the_rules(seed):
    """The figure's rows (when each request runs) equal the batching rules worked out by hand, for the
    notebook's arrivals (seed 0) and random ones."""
    rng = random.Random(seed)
    arrivals = [(0, 9), (0, 3), (0, 5), (1, 4), (2, 6), (4, 2), (5, 5), (6, 3)] if seed == 0 else \
        sorted((rng.randrange(8), rng.randrange(1, 10)) for _ in range(rng.randrange(1, 12)))
    slots = 3 if seed == 0 else rng.randrange(1, 5)
    for static in (True, False):
        assert first_steps_from_scheduler(arrivals, slots, static) == first_steps_by_hand(arrivals, slots, static)


def tiny_llama():
    """A random 2-layer Llama-shaped minillm model, built without transformers."""
    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=96, context_length=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                                   d_ff=64, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False,
                                   qkv_bias=False)).eval()


# ------------------------------------------------------------------ 13: one request's path through the server


def test_streamed_requests_follow_the_queue_and_their_token_counts():
    """Lesson 13's figure: bodies read by the server's request model, added between two steps, stepped under a
    batch limit and a token budget, each event streamed as a chunk. Every prompt token and every generated token
    but the last is fed once; each request streams one chunk per token, from the step its prompt's last chunk ran,
    and their text is its answer; no step is over the limits; and a request starts at the first step from its
    arrival with a free place (first come, first served), worked out from the limits alone."""
    from minillm.runtime.engine import Engine
    from minillm.serving.openai_api import (
        CompletionRequest,
        completion_choice,
        envelope,
        max_new_tokens,
        sampling_config,
    )

    class Words:  # every token is final text at once
        eos_token_id = None

        def decode(self, ids):
            return "".join(f" w{i}" for i in ids)

    model, places, budget = tiny_llama(), 2, 8
    engine = Engine(model, Words(), block_size=4, num_blocks=32, max_num_seqs=places, max_num_batched_tokens=budget)
    arrivals = [(0, 6, 5), (0, 11, 4), (1, 5, 4), (4, 3, 3)]  # (step, prompt tokens, max_tokens), the figure's
    ids, fed, chunks, step = {}, {}, {}, 0
    while step == 0 or engine.has_unfinished():
        for k, (arrival, n, wants) in enumerate(arrivals):
            if arrival == step:
                body = CompletionRequest.model_validate_json(json.dumps(
                    {"prompt": [(7 * i + 23 * k + 1) % 96 for i in range(n)], "max_tokens": wants, "temperature": 0,
                     "stream": True}))
                request_id = engine.add_request(body.prompt, sampling_config(body, max_new_tokens(body, n, 64)))
                ids[k], chunks[request_id] = request_id, []
        before = {i: r.computed for i, r in engine.requests.items()}
        for event in engine.step():
            chunk = envelope("text_completion", "cmpl", "tiny", [completion_choice(0, event.text, event.finish_reason)])
            chunks[event.row].append((step, chunk["choices"][0]))
        for i in engine.timeline[-1].requests:
            fed[i, step] = engine.requests[i].computed - before[i]
        step += 1
    steps = {k: sorted(s for j, s in fed if j == i) for k, i in ids.items()}
    for k, (arrival, prompt_tokens, wants) in enumerate(arrivals):
        i, output = ids[k], engine.output(ids[k])
        assert len(output.token_ids) == wants and sum(fed[i, s] for s in steps[k]) == prompt_tokens + wants - 1
        assert [s for s, _ in chunks[i]] == steps[k][-wants:]
        assert "".join(c["text"] for _, c in chunks[i]) == output.text and chunks[i][-1][1]["finish_reason"]
    for s in range(step):
        assert sum(n for (_, t), n in fed.items() if t == s) <= budget and sum(t == s for _, t in fed) <= places
    for k, (arrival, _, _) in enumerate(arrivals):  # first come, first served, into the first free place
        start = arrival
        while sum(steps[j][0] <= start <= steps[j][-1] for j in range(k)) >= places:
            start += 1
        assert steps[k][0] == start


# ------------------------------------------------------------------ 15: the decode step as one graph


def test_exported_decode_step_is_one_graph_for_every_position():
    """Lesson 15's figure: the package's CacheStep exported at its decode StepShape, as a kept graph is built. Run
    as a decode loop it gives the eager model's logits at every position and writes only the cache columns it is
    given; its weight matmuls are the model's nn.Linear modules, in one graph with a key and a value write per
    layer."""
    from minillm.speed.compile import CompiledModel
    from minillm.speed.step_shapes import StepShape

    model = tiny_llama()
    shape = StepShape.decode(model.config, batch=1, max_len=None)
    with torch.no_grad():
        program = torch.export.export(CompiledModel(model, kept=True).step_module,
                                      shape.example_inputs(model.config, model.dtype, model.device), strict=False)
    ops = [getattr(n.target, "__name__", "").split(".")[0] for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count("linear") == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert ops.count("index_put_") == 2 * model.config.n_layer
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1))
    keys = [torch.zeros(1, model.config.kv_heads, shape.cache_len, model.config.head_size) for _ in range(2)]
    values = [torch.zeros_like(k) for k in keys]
    step, logits = program.module(), []
    with torch.no_grad():
        for p, token in enumerate(prompt.tolist()):
            where = torch.tensor([[p]])
            logits.append(step(torch.tensor([[token]]), where, where, torch.arange(shape.cache_len) <= where[..., None],
                               None, keys, values))
        eager = model(prompt[None], torch.arange(len(prompt))[None])
    torch.testing.assert_close(torch.cat(logits, dim=1), eager, rtol=1e-5, atol=1e-5)
    for cache in keys + values:
        assert cache[:, :, :len(prompt)].abs().sum(-1).all() and not cache[:, :, len(prompt):].any()


# ------------------------------------------------------------------ 17: the families' switches


@pytest.mark.parametrize("kind", ["gpt2", "opt-pre", "opt", "gptj", "llama", "qwen2", "qwen3", "mistral", "phi3",
                                  "gemma2", "gemma3"])
def test_family_switches_match_the_transformers_model(kind):
    """Lesson 17's grid: the switches the loader reads from a tiny family's config (`config_from_hf`) against the
    transformers model itself: its norm classes and modules, its biases, its tied head, its config fields."""
    from minillm.model.checkpoint import config_from_hf
    from minillm.model.tiny import tiny_hf_model

    hf = tiny_hf_model(kind)
    c, cfg = config_from_hf(hf.config.to_dict()), hf.config
    layer = next(m for name, m in hf.named_modules() if name.endswith(("layers.0", "h.0")))
    names = {name.rsplit(".", 1)[-1] for name, _ in layer.named_modules()}
    norms = [type(m).__name__ for name, m in layer.named_modules()
             if "Norm" in type(m).__name__ and not name.endswith(("q_norm", "k_norm"))]
    assert c.norm == ("gemma_rmsnorm" if norms[0].startswith("Gemma") else "rmsnorm" if "RMS" in norms[0]
                      else "layernorm")
    assert c.block == ("parallel" if len(norms) == 1 else "post" if getattr(cfg, "do_layer_norm_before", True) is False
                       else "pre")
    assert c.post_norms == ("post_feedforward_layernorm" in names) and c.qk_norm == ("q_norm" in names)
    learned = sum(isinstance(m, torch.nn.Embedding) for m in hf.modules()) == 2
    assert c.positions == ("learned" if learned else "rope")
    rope = cfg.to_dict().get("rope_parameters") or {}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotary = getattr(cfg, "rotary_dim", None) or int(head_dim * rope.get("partial_rotary_factor", 1.0))
    assert (c.rotary_dim or c.head_size) == (head_dim if learned else rotary)
    assert (c.rope_long_factor is not None) == (rope.get("rope_type") == "longrope")
    assert (c.rope_local_theta is not None) == ("sliding_attention" in rope)
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or cfg.activation_function
    gated = bool(names & {"gate_proj", "gate_up_proj"})
    assert c.mlp == {"relu": "relu", "silu": "swiglu"}.get(act, "geglu" if gated else "gelu")
    q_proj = next(m for name, m in layer.named_modules() if name.endswith(("q_proj", "c_attn", "qkv_proj")))
    assert c.qkv_bias == (q_proj.bias is not None)
    assert c.kv_heads == (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    out, emb = hf.get_output_embeddings(), hf.get_input_embeddings()
    assert c.tie_embeddings == (out.weight.data_ptr() == emb.weight.data_ptr())
    assert c.lm_head_bias == (out.bias is not None)
    assert c.final_norm == any(name.endswith(("model.norm", "ln_f", "decoder.final_layer_norm"))
                               for name, _ in hf.named_modules())
    types = getattr(cfg, "layer_types", None) or (["sliding_attention"] * cfg.num_hidden_layers
                                                  if getattr(cfg, "sliding_window", None) else [])
    assert [c.is_sliding(i) for i in range(c.n_layer)] == [t == "sliding_attention" for t in types or
                                                          ["full_attention"] * c.n_layer]
    assert c.final_logit_softcap == getattr(cfg, "final_logit_softcapping", None)


# ------------------------------------------------------------------ 18: a regex's byte DFA and its masks


@pytest.mark.parametrize("pattern, alphabet, longest", [
    (r"-?\d{1,2}(\.\d)?°C", "-15.°C", 7),  # the figure's: a class, an optional part, a two-byte character
    (r"(yes|no)!{1,2}", "yesno!", 5),
    (r"(sí|no)[!?]{0,2}", "síno!?", 4),
    (r"[a-c]{1,2}(é|€)?", "abé€", 3),  # a three-byte character
])
def test_regex_dfa_and_masks_by_brute_force(pattern, alphabet, longest):
    """Lesson 18's figure: the package's DFA holds exactly the byte prefixes of the language's strings (all of them,
    found by re.fullmatch over a few characters that stand for every class the pattern uses, up to its longest) and
    accepts exactly the strings; each state's mask allows a token exactly when the state's prefix plus its bytes is
    such a prefix, and EOS exactly when the prefix is a whole string. The tokens: every piece of up to 3 bytes of
    those strings (half characters included), and some that fit nowhere."""
    from minillm.decoding.regex import regex_dfa
    from minillm.decoding.structured import TokenIndex, Vocabulary

    language = {"".join(s).encode() for n in range(1, longest + 1) for s in itertools.product(alphabet, repeat=n)
                if re.fullmatch(pattern, "".join(s))}
    prefixes = {word[:i] for word in language for i in range(len(word) + 1)}
    pieces = sorted({w[i:j] for w in language for i in range(len(w)) for j in range(i + 1, min(i + 3, len(w)) + 1)})
    token_bytes = [None, *pieces, b"x", b"\xff", b" "]
    dfa = regex_dfa(pattern)
    index = TokenIndex(dfa, Vocabulary(token_bytes, eos_ids=(0,)))
    states = {}
    for prefix in prefixes:
        state = dfa.walk(dfa.start, prefix)
        assert state >= 0 and dfa.accepting[state] == (prefix in language), prefix
        for byte in set(alphabet.encode()) | set(b"x\xff "):  # the language's bytes (as represented), and others
            assert (dfa.walk(state, bytes([byte])) >= 0) == (prefix + bytes([byte]) in prefixes), (prefix, byte)
        states.setdefault(state, prefix)
    assert sorted(states) == list(range(dfa.num_states))  # no state that no prefix reaches
    for state, prefix in states.items():
        brute = [prefix in language] + [prefix + data in prefixes for data in token_bytes[1:]]
        assert index.mask(state).tolist() == brute, prefix


# ------------------------------------------------------------------ 19: one step of the capstone engine


def test_capstone_steps_pack_slots_and_verify_by_definition():
    """Lesson 19's figure, for every step of its run: each request's new keys go to table[p // bs] * bs + p % bs, in
    blocks that are its own and slots no one else's key takes; the packed forward's logits equal the package's
    model run on that request alone; a verified draft keeps the prefix that agrees with the argmax, plus one."""
    from minillm.model.tiny import tiny_pair

    sys.path.insert(0, str(ROOT / "lessons" / "19-capstone"))
    from engine import Engine, Model, Params

    _, model = tiny_pair("llama")
    capstone = Model.from_minillm(model)
    engine = Engine(capstone, num_blocks=12, block_size=4, lookup=3)
    forwards, plain = [], capstone.forward

    def recording(tokens, positions, slots, feeds, kv, logit_rows):
        logits = plain(tokens, positions, slots, feeds, kv, logit_rows)
        forwards.append((tokens, positions, slots, feeds, logits, list(engine.pool.free_blocks)))
        return logits

    capstone.forward = recording
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (4, 5, 7)]
    prompts[0] *= 3  # a repeated phrase: prompt lookup drafts from it
    params = [Params(max_new_tokens=10), Params(max_new_tokens=10, temperature=0.8, seed=1), Params(max_new_tokens=4)]
    requests, contexts, kinds = {}, [], set()
    for step in range(40):
        for i, arrival in enumerate([0, 0, 4]):
            if arrival == step:
                request = engine.add_request(prompts[i], params[i])
                requests[request.id] = request
        if not (engine.waiting or engine.running):
            break
        contexts.append({rid: list(r.tokens) for rid, r in requests.items()})
        engine.step()
    bs = engine.pool.block_size
    for record, (tokens, positions, slots, feeds, logits, free), before in zip(engine.history, forwards, contexts):
        assert len(slots.unique()) == len(slots)
        first = 0
        for (rid, n, kind, gained), feed in zip(record["fed"], feeds):
            kinds.add(kind)
            where = positions[feed.start:feed.end]
            assert torch.equal(slots[feed.start:feed.end], feed.blocks[where // bs] * bs + where % bs)
            assert not set(feed.blocks.tolist()) & set(free)
            fed = tokens[feed.start:feed.end].tolist()
            context = before[rid][:feed.num_keys - n] + fed
            wanted = n if kind == "verify" else 1
            with torch.no_grad():
                reference = model(torch.tensor([context]), torch.arange(len(context))[None])[0, -wanted:]
            torch.testing.assert_close(logits[first:first + wanted], reference, rtol=1e-4, atol=1e-4)
            first += wanted
            if kind == "verify":
                argmax = reference.argmax(-1).tolist()
                agreeing = next((i for i, (d, a) in enumerate(zip(fed[1:], argmax)) if d != a), n - 1)
                assert gained == agreeing + 1
    assert kinds == {"prefill", "decode", "verify"}
