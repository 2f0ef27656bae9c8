"""Mechanism figures: the pictures that show how a lesson's mechanism works, and the data they draw.

A lesson README shows its figures as committed PNGs (lessons/NN-name/figures/), so a missing or
oversized file is a broken page. The notebooks draw the same pictures in cells tagged "mechanism"
(next to the code they explain), and several draw what the package's own objects hold: a block
table, a tree mask, a quantizer's grid, the online softmax's running state, the scheduler's
plan. The pictures are only as right as those data, so each is checked here against an
independent computation (brute force, or the format's definition), without the real model.
"""

from __future__ import annotations

import json
import math
import random
import re
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

# The notebooks given mechanism cells, and the figure each draws (the same picture its README shows).
MECHANISM = {
    "01_model_and_weights": "decoder-block.png",
    "06_kv_cache": "cache-layouts.png",
    "08_speculative_decoding": "verify-round.png",
    "11_lookahead": "tree-mask.png",
    "12_continuous_batching": "static-vs-continuous.png",
    "14_quantization": "quant-grids.png",
    "16_attention_kernels": "online-softmax-tiles.png",
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
