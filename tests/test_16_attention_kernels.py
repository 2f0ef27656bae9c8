"""Lesson 16: attention kernels. Naive, online-softmax and tiled flash attention against PyTorch's SDPA
and a float64 log-sum-exp over every mask the course uses; the whole model on each backend against the
default one; the paged loop against `minillm.cache.paged.paged_attention`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minillm.bench import attention as bench
from minillm.bench.sections_systems import attention_section
from minillm.cache.paged import PagedKVCache, paged_attention
from minillm.infer import build_parser
from minillm.model.attention import AttentionStep, SDPABackend, set_attention_backend
from minillm.runtime.session import Tree, new_token_mask
from minillm.speed.attention_kernels import (
    BACKENDS,
    KernelBackend,
    flash_attention,
    make_backend,
    naive_attention,
    online_softmax_attention,
    paged_flash_attention,
)
from minillm.strategies.generate import generate
from minillm.strategies.lookahead import Lookahead
from minillm.strategies.speculative import speculative_generate

ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = {
    "naive": naive_attention,
    "online": online_softmax_attention,
    "flash 64x64": flash_attention,
    "flash 1x1": partial(flash_attention, block_q=1, block_k=1),
    "flash 5x7": partial(flash_attention, block_q=5, block_k=7),
    "flash 16x3": partial(flash_attention, block_q=16, block_k=3),
}
HEADS = [(4, 4), (6, 2), (3, 1)]  # (query heads, key heads): plain, grouped, multi-query


def causal(T: int, S: int) -> torch.Tensor:
    return torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)


def left_padded(T: int, S: int, pads: list[int]) -> torch.Tensor:
    """Rows padded on the left by pads[b] columns: causal, and nothing sees (or is) padding."""
    keys = torch.arange(S)[None, :] >= torch.tensor(pads)[:, None]  # [B, S]
    queries = keys[:, S - T:]  # [B, T]: padding queries see nothing at all
    return causal(T, S)[None] & keys[:, None, :] & queries[:, :, None]


def tree_mask(prefix: int, parents: list[int], rows: int) -> torch.Tensor:
    tree = Tree.from_parents(parents)
    return new_token_mask(torch.full((rows,), prefix), tree.mask, prefix + len(parents))


def random_mask(B: int, T: int, S: int, seed: int) -> torch.Tensor:
    mask = torch.rand(B, T, S, generator=torch.Generator().manual_seed(seed)) < 0.4
    mask[0, 1] = False  # one row with nothing to attend to
    return mask


# name -> (B, T, S, mask): mask None is causal with the queries last
CASES = {
    "prefill": (2, 37, 37, None),
    "chunk after a cached prefix": (2, 11, 40, None),
    "decode": (3, 1, 33, None),
    "padding": (2, 23, 23, left_padded(23, 23, [0, 6])),
    "padded chunk": (2, 9, 30, left_padded(9, 30, [0, 25])),
    "padded decode": (2, 1, 30, left_padded(1, 30, [5, 0])),
    "token tree": (2, 8, 17, tree_mask(9, [-1, 0, 0, 1, 1, 2, 4, 4], 2)),
    "random with an empty row": (2, 13, 29, random_mask(2, 13, 29, 0)),
    "all masked": (1, 5, 12, torch.zeros(1, 5, 12, dtype=torch.bool)),
}


def random_qkv(B, H, KV, T, S, hd=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, hd, generator=gen).to(dtype), torch.randn(B, KV, S, hd, generator=gen).to(dtype),
            torch.randn(B, KV, S, hd, generator=gen).to(dtype))


def full_mask(mask, B, T, S):
    return causal(T, S).expand(B, T, S) if mask is None else mask


def sdpa_reference(q, k, v, mask):
    """PyTorch's SDPA with every key head repeated for its query heads and the mask spelled out."""
    B, H, T, _ = q.shape
    KV, S = k.shape[1], k.shape[2]
    group = H // KV
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=full_mask(mask, B, T, S)[:, None])


def lse_reference(q, k, mask):
    """torch.logsumexp of the masked, scaled scores, in float64."""
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    scores = q.double() @ k.double().repeat_interleave(H // KV, 1).transpose(-1, -2) / hd ** 0.5
    return scores.masked_fill(~full_mask(mask, B, T, S)[:, None], float("-inf")).logsumexp(dim=-1)


# --- Each implementation against SDPA and logsumexp. ----------------------------------------------------------------

@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-KV{h[1]}")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_each_implementation_equals_sdpa_and_its_lse_equals_logsumexp(implementation, case, heads):
    B, T, S, mask = CASES[case]
    H, KV = heads
    q, k, v = random_qkv(B, H, KV, T, S)
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, mask)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and not out.isnan().any()
    torch.testing.assert_close(out, sdpa_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    expected = lse_reference(q, k, mask)
    empty = expected == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "lse is -inf exactly where a query sees nothing"
    torch.testing.assert_close(lse[~empty].double(), expected[~empty], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-KV{h[1]}")
@pytest.mark.parametrize("case", CASES)
def test_the_sdpa_backend_groups_query_heads_without_changing_the_result(case, heads):
    """The model's default backend runs a KV head's query heads as one head's queries (no copies of the
    keys and values) and builds the lower-right causal mask itself: the same as SDPA on repeated heads."""
    B, T, S, mask = CASES[case]
    H, KV = heads
    q, k, v = random_qkv(B, H, KV, T, S)
    out = SDPABackend()(q, k, v, AttentionStep(torch.arange(S - T, S).expand(B, T), mask))
    torch.testing.assert_close(out, sdpa_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["chunk after a cached prefix", "token tree"])
def test_every_layer_of_a_forward_shares_one_grouped_mask(case):
    """The mask repeated for a KV head's query heads is built by the first layer that needs it and
    reused by the others (one copy per forward, not per layer); each layer's result is unchanged."""
    B, T, S, mask = CASES[case]
    step = AttentionStep(torch.arange(S - T, S).expand(B, T), mask)
    for layer in range(3):  # three layers of one forward: the same step, their own q, k, v
        q, k, v = random_qkv(B, 6, 2, T, S)
        torch.testing.assert_close(SDPABackend()(q, k, v, step), sdpa_reference(q, k, v, mask),
                                   rtol=1e-5, atol=1e-5)
    assert len(step.derived) == 1
    made = []
    assert [step.once("another key", lambda: made.append(1) or len(made)) for _ in range(2)] == [1, 1]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_rows_give_zeros_not_nan(implementation):
    B, T, S, mask = CASES["random with an empty row"]
    q, k, v = random_qkv(B, 4, 2, T, S)
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, mask)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1])) and (lse[0, :, 1] == float("-inf")).all()
    assert torch.equal(sdpa_reference(q, k, v, mask)[0, :, 1], out[0, :, 1])  # SDPA gives zeros too


def test_a_chunk_after_a_prefix_is_lower_right_causal():
    """Each query of a chunk sees exactly the prefix and the chunk up to itself: equal to running the
    queries one at a time, each as a decode step over the keys up to it."""
    q, k, v = random_qkv(1, 6, 2, 5, 12)
    out, _ = flash_attention(q, k, v, block_q=2, block_k=3)
    for t in range(5):
        alone, _ = naive_attention(q[:, :, t:t + 1], k[:, :, :8 + t], v[:, :, :8 + t])
        torch.testing.assert_close(out[:, :, t:t + 1], alone, rtol=1e-5, atol=1e-6)


def test_reduced_precision_stays_close_to_fp32():
    q, k, v = random_qkv(2, 6, 2, 40, 40, hd=32)
    exact = sdpa_reference(q, k, v, None)
    for dtype in (torch.bfloat16, torch.float16):
        out, lse = flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), block_q=16, block_k=16)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert (out.float() - exact).abs().max() < 3e-2, dtype


def test_bad_shapes_and_tiles_are_refused_with_one_line():
    q, k, v = random_qkv(1, 6, 4, 3, 5)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        naive_attention(q, k, v)
    q, k, v = random_qkv(1, 4, 2, 6, 5)
    with pytest.raises(ValueError, match="only 5 keys"):
        flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"mask must be bool \[B, T, S\]"):
        flash_attention(q, k, v, torch.ones(1, 6, 6, dtype=torch.bool))
    q, k, v = random_qkv(1, 4, 2, 3, 5)
    with pytest.raises(ValueError, match="block_q=0"):
        flash_attention(q, k, v, block_q=0)


# --- Paged: the same loop over a block table. ----------------------------------------------------------------------

def test_paged_flash_equals_the_paged_reference():
    """Three sequences in one pool, their blocks scattered: a prefill chunk after cached keys, a decode
    step (its other query slots padding, position -1), and a sequence that ends inside a block."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(n_layer=2, n_kv_head=2, head_dim=16, num_blocks=16, block_size=4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    order = torch.randperm(16, generator=gen).tolist()
    block_tables = [order[0:4], order[4:6], order[6:9]]
    lengths = [14, 7, 9]
    positions = torch.tensor([[9, 10, 11, 12, 13], [6, -1, -1, -1, -1], [4, 5, 6, 7, 8]])
    q = torch.randn(3, 6, 5, 16, generator=gen)
    expected = paged_attention(q, cache, 1, block_tables, lengths, positions)
    for block_q in (1, 2, 64):
        out, lse = paged_flash_attention(q, cache, 1, block_tables, lengths, positions, block_q=block_q)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1, :, 1:], torch.zeros_like(out[1, :, 1:])) and (lse[1, :, 1:] == float("-inf")).all()
    with pytest.raises(ValueError, match="sequence 1"):
        paged_flash_attention(q, cache, 1, block_tables, [14, 6, 9], positions)


# --- The backends in the model. ------------------------------------------------------------------------------------

BACKEND_OPTIONS = {"naive": {}, "flash": {"block_q": 5, "block_k": 7}}


@pytest.fixture
def swap_backend():
    """Install a backend in a model for one test and put the model's own back afterwards."""
    restore = []

    def swap(model, backend):
        restore.append((model, [block.attn.backend for block in model.blocks]))
        set_attention_backend(model, backend)

    yield swap
    for model, backends in reversed(restore):  # the first swap recorded the model's own
        for block, backend in zip(model.blocks, backends):
            block.attn.backend = backend


@pytest.mark.parametrize("name", BACKEND_OPTIONS)
@torch.inference_mode()
def test_tiny_models_give_the_same_logits_and_tokens_on_each_backend(tiny, name, swap_backend):
    model = tiny[1]
    prompts = [[5, 9, 14, 3, 27, 9, 14, 3, 8], [7, 1, 2], [11, 40, 2, 2, 9, 31]]  # padded: masks per row
    tokens = torch.tensor([prompts[0]])
    positions = torch.arange(tokens.shape[1])[None]
    plain_logits = model(tokens, positions)
    plain = generate(model, prompts, max_new_tokens=12, eos_token_id=()).rows
    swap_backend(model, make_backend(name, **BACKEND_OPTIONS[name]))
    torch.testing.assert_close(model(tokens, positions), plain_logits, rtol=1e-5, atol=1e-5)
    for cache in ("static", "dynamic", "none"):
        rows = generate(model, prompts, max_new_tokens=12, eos_token_id=(), cache=cache).rows
        assert [row.token_ids for row in rows] == [row.token_ids for row in plain], cache


@pytest.mark.parametrize("name", BACKEND_OPTIONS)
def test_lookahead_token_trees_run_on_each_backend(name, swap_backend):
    from minillm.model.tiny import tiny_pair

    model = tiny_pair("llama", seed=0)[1]
    prompt = [5, 9, 14, 3, 27, 9, 14, 3, 8, 5, 9, 14]
    plain = generate(model, prompt, max_new_tokens=30, eos_token_id=()).rows[0].token_ids
    swap_backend(model, make_backend(name, **BACKEND_OPTIONS[name]))
    out = speculative_generate(model, prompt, Lookahead(decoding_length=8, branch_length=4), max_new_tokens=30,
                               eos_token_id=())
    assert out.rows[0].token_ids == plain


def test_the_default_model_gives_the_same_greedy_tokens_on_each_backend(default_model, swap_backend):
    model, tok = default_model
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    plain = generate(model, prompt, tokenizer=tok, max_new_tokens=10).rows[0]
    for name in BACKEND_OPTIONS:
        swap_backend(model, make_backend(name))
        row = generate(model, prompt, tokenizer=tok, max_new_tokens=10).rows[0]
        assert row.token_ids == plain.token_ids, name
    assert "Paris" in plain.text


def test_backends_by_name_and_packed_steps_refused():
    assert isinstance(make_backend("sdpa"), SDPABackend)
    assert make_backend("flash", block_q=8).options == {"block_q": 8, "block_k": 64}
    with pytest.raises(ValueError, match="unknown attention backend 'tiled': use one of sdpa, naive, flash"):
        make_backend("tiled")
    with pytest.raises(ValueError, match="flash backend only, not 'naive'"):
        make_backend("naive", block_q=8)
    q, k, v = random_qkv(1, 4, 2, 1, 6)
    with pytest.raises(ValueError, match="PagedAttention"):
        make_backend("flash")(q, k, v, AttentionStep(torch.zeros(1, 1, dtype=torch.long), packed=object()))
    assert isinstance(make_backend("naive"), KernelBackend)


def test_cli_installs_the_backend_it_is_asked_for(default_model, swap_backend, monkeypatch, capsys):
    """`--attention NAME` puts make_backend(NAME) in every layer, and the tokens stay the same (the loaded
    model is the session's, so the test loads nothing; its own backends are put back afterwards)."""
    from minillm.infer import main

    action = next(a for a in build_parser()._actions if "--attention" in a.option_strings)
    assert tuple(action.choices) == BACKENDS and action.default == "sdpa" and "flash" in action.help
    model = default_model[0]
    swap_backend(model, SDPABackend())  # records the model's own backends for the fixture to restore
    monkeypatch.setattr("minillm.speed.load.load_model", lambda *args, **kwargs: default_model)
    outputs = {}
    for name in ("flash", "sdpa"):
        assert main(["--prompt", "Name a colour.", "--max-new-tokens", "6", "--json", "--attention", name]) == 0
        outputs[name] = json.loads(capsys.readouterr().out)["token_ids"]
        assert all(block.attn.backend.name == name for block in model.blocks)
    assert outputs["flash"] == outputs["sdpa"]


# --- The benchmark's accounting, plot and report. ------------------------------------------------------------------

def test_cost_counts_the_computed_pairs():
    # T = S = 4, tiles of 2: query tile 0 computes keys 0-1 (2 x 2 pairs), tile 1 keys 0-3 (2 x 4): 12 of 16
    H, KV, hd = 3, 1, 8
    assert bench.attention_cost("naive", 4, 4, H, KV, hd)["flops"] == 4 * 16 * hd * H
    flash = bench.attention_cost("flash", 4, 4, H, KV, hd, block_q=2)
    assert flash["flops"] == 4 * 12 * hd * H
    assert flash["bytes"] == 4 * (2 * H * 4 * hd + 2 * KV * (2 + 4) * hd)
    with pytest.raises(ValueError, match="no cost model for 'sdpa'"):
        bench.attention_cost("sdpa", 4, 4, H, KV, hd)


def test_peak_memory_counts_tensors_while_they_live():
    with bench.PeakMemory() as memory:
        a = torch.zeros(2**18)  # 1 MiB
        b = torch.zeros(2**18)
        del a, b
        c = torch.zeros(2**17)  # 0.5 MiB, after both were freed
        c.add_(1)  # in place: no new storage
    assert memory.peak == 2**21 and memory.live == 2**19
    q, k, v = random_qkv(1, 4, 2, 256, 256)
    scores = 4 * 256 * 256 * 4
    assert bench.peak_bytes(lambda: naive_attention(q, k, v)) > scores > 2 * bench.peak_bytes(
        lambda: flash_attention(q, k, v, block_q=32, block_k=32))


def synthetic_result() -> dict:
    costs = {name: bench.attention_cost(name, 256, 256, 9, 3, 64) for name in ("naive", "flash")}
    rows = [{"length": L, "ms": {"naive": L / 10, "flash": L / 20, "sdpa": L / 40},
             "ms_per_repeat": {name: [1.0, 2.0, 3.0] for name in bench.CONTENDERS},
             "peak_mib": {"naive": L * L / 1e4, "flash": 2.0 + L / 1e3, "sdpa": 1.0},
             "max_abs_error_vs_sdpa": {"naive": 1e-6, "flash": 2e-6}, "cost": costs} for L in (256, 512)]
    sweep = {"length": 256, "tiles": [{"tile": t, "ms": 100 / t + t / 100, "ms_per_repeat": [1.0, 2.0],
                                       "peak_mib": t / 10} for t in (16, 64, 256)]}
    return {"suite": "attention", "machine": {"cpu": "Test CPU", "cores": 4, "memory_gib": 16.0, "device": "cpu",
                                              "torch": "2.13.0+cpu"},
            "command": "python -m minillm.bench attention", "git": {"commit": "0" * 40, "dirty": False},
            "date": "2025-01-02T03:04:05+00:00", "model": "default", "quick": False, "dtype": "float32",
            "repeats": 3, "heads": 9, "kv_heads": 3, "head_dim": 64, "batch": 1, "tile": 128, "threads": 1, "rows": rows,
            "sweep": sweep}


def test_report_and_plot_from_a_synthetic_result(tmp_path):
    data = synthetic_result()
    text = attention_section("Attention kernels", data, {"png": "a.png", "json": "a.json"})
    assert "| naive ms | 25.6 | 51.2 |" in text and "| naive peak MiB | 6.6 | 26.2 |" in text
    assert "naive attention's peak memory grows 4x" in text and "64 was fastest (2.2 ms in the sweep's" in text
    assert "naive takes 2.00x flash's time and 4.00x SDPA's" in text
    bench.plot(data, tmp_path / "attention.png")
    assert (tmp_path / "attention.png").stat().st_size > 10_000


# --- Triton: the same algorithm as a GPU kernel. -------------------------------------------------------------------

def test_triton_kernel_equals_sdpa():
    """Lesson 16's kernel and flash-decoding (`check_against_sdpa`), on CUDA when present; else in Triton's
    interpreter on CPU tensors (a subprocess: the interpreter is chosen when triton is imported). Skips where
    triton is not installed."""
    pytest.importorskip("triton")
    code = ("import torch; from minillm.speed.attention_triton import check_against_sdpa; "
            "print(check_against_sdpa('cuda' if torch.cuda.is_available() else 'cpu'))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    worst = float(result.stdout.strip().splitlines()[-1])
    assert worst < 1e-4, worst


def test_notebook_runs(run_notebook):
    run_notebook("16_attention_kernels.ipynb", timeout=600)
