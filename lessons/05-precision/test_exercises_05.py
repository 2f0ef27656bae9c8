"""Checks for lesson 05's exercises: `pytest lessons/05-precision` (yours) or `--solutions`.

References: PyTorch's own float16 conversion, plain greedy decoding (`generate` without a cache) in each dtype
with `first_divergence`, PyTorch's bfloat16 conversion per parameter, and a forward through the blocks written
out in the test.
"""

from __future__ import annotations

import pytest
import torch

from minillm.model.attention import AttentionStep
from minillm.model.tiny import tiny_pair
from minillm.model.transformer import causal_positions
from minillm.speed.huge_pages import huge_page_bytes, transparent_huge_pages
from minillm.speed.precision import drift, first_divergence, next_token_logits, with_dtype
from minillm.strategies.generate import generate


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def tiny(request):
    return tiny_pair(request.param, seed=0)[1]


# ------------------------------------------------------------------ Exercise 1


def test_exercise_1_fp16_round_matches_half_on_special_values(answers):
    x = torch.tensor([0.0, -0.0, 1.0, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2048.0, 2049.0, 2051.0,
                      65504.0, 65519.0, 65519.996, 65520.0, -65520.0, 70000.0, 1e10, -3e38,
                      2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 1e-8, 6e-5, -3.3e-6, 0.1, 1 / 3])
    got = answers.fp16_round(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, x.half().float()), (x, got, x.half().float())
    assert torch.isinf(got[x.abs() >= 65520]).all()  # overflow: nothing between 65504 and inf


def test_exercise_1_fp16_round_matches_half_across_magnitudes(answers):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * torch.logspace(-9, 6, 200_000)  # subnormals to overflow
    assert torch.equal(answers.fp16_round(x), x.half().float())


# ------------------------------------------------------------------ Exercise 2


def greedy_ids(model, prompt, n):
    return generate(model, prompt, max_new_tokens=n, eos_token_id=(), cache="none").rows[0].token_ids


# (tiny kind, seed, prompt, new tokens): two near ties that flip (at steps 10 and 1), and a run that stays equal.
DIVERGENCE_CASES = [("llama", 2, [67, 7, 73, 51, 53, 50], 14), ("gpt2", 2, [36, 87, 70, 56, 24, 12], 6),
                    ("llama", 0, [5, 17, 3, 42, 8], 12)]


@pytest.mark.parametrize("kind, seed, prompt, n", DIVERGENCE_CASES)
def test_exercise_2_greedy_divergence_matches_generate(answers, kind, seed, prompt, n):
    model = tiny_pair(kind, seed=seed)[1]
    got = answers.greedy_divergence(model, prompt, n)
    reference, other = greedy_ids(model, prompt, n), greedy_ids(with_dtype(model, "bfloat16"), prompt, n)
    where = first_divergence(reference, other)
    if where is None:
        assert got is None, got
        return
    assert got is not None and got["step"] == where, (got, where)
    assert (got["float32_token"], got["bfloat16_token"]) == (reference[where], other[where])
    top2 = next_token_logits(model, prompt + reference[:where])[-1].topk(2).values
    assert got["margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-6)
    assert 0 <= got["margin"] < 0.05  # only a near tie flips
    assert answers.greedy_divergence(model, prompt, where) is None  # stopping just before it: no divergence yet


# ------------------------------------------------------------------ Exercise 3


def test_exercise_3_weights_are_rounded_and_the_rest_is_exact(answers, tiny):
    before = {name: p.detach().clone() for name, p in tiny.named_parameters()}
    copied = answers.bf16_weights_fp32_compute(tiny)
    assert copied is not tiny and copied.dtype == torch.float32
    params = dict(copied.named_parameters())
    assert params.keys() == before.keys()
    for name, original in before.items():
        assert params[name].dtype == torch.float32
        expected = original.to(torch.bfloat16).float() if original.dim() >= 2 else original
        assert torch.equal(params[name], expected), name
    for name, p in tiny.named_parameters():
        assert torch.equal(p, before[name]), f"the original model changed: {name}"


def test_exercise_3_rounds_the_matrices_and_keeps_the_rest(answers, tiny):
    ids = list(range(3, 60))
    reference = next_token_logits(tiny, ids)
    weights_only = drift(reference, next_token_logits(answers.bf16_weights_fp32_compute(tiny), ids))
    assert weights_only.mean_kl > 0  # the weights did change
    tokens = torch.tensor([ids])
    hand = tiny.__class__(tiny.config)  # an independent copy: load the rounded weights by hand
    hand.load_state_dict({k: v.to(torch.bfloat16).float() if v.dim() >= 2 else v for k, v in tiny.state_dict().items()})
    with torch.inference_mode():
        expected = hand(tokens, causal_positions(1, len(ids)))[0]
    assert torch.equal(next_token_logits(answers.bf16_weights_fp32_compute(tiny), ids), expected)


# ------------------------------------------------------------------ Exercise 4


@torch.inference_mode()
def residual_stream_maxima(model, ids):
    """The forward of minillm.model.transformer.Transformer, written out, stopping after each block."""
    tokens = torch.tensor([ids])
    positions = causal_positions(1, len(ids))
    x = model.tok_emb(tokens)
    rope = None
    if model.pos_emb is not None:
        x = x + model.pos_emb(positions)
    else:
        rope = model.rope(positions, x.dtype)
    step = AttentionStep(positions, None)
    maxima = []
    for layer, block in enumerate(model.blocks):
        x = block(x, rope, layer, None, step)
        maxima.append(float(x.abs().max()))
    return maxima


def test_exercise_4_largest_activations_per_block(answers, tiny):
    ids = [5, 17, 3, 42, 8, 9, 10, 11]
    got = answers.largest_activations(tiny, ids)
    assert len(got) == len(tiny.blocks)
    assert got == pytest.approx(residual_stream_maxima(tiny, ids), rel=1e-6)
    # Hooks removed: a second call gives the same answer and no hook is left behind.
    assert answers.largest_activations(tiny, ids) == pytest.approx(got, rel=1e-6)
    assert all(not block._forward_hooks for block in tiny.blocks)


def test_exercise_4_sees_a_scaled_residual_stream(answers):
    model = tiny_pair("llama", seed=1)[1]
    ids = [5, 17, 3, 42, 8]
    base = answers.largest_activations(model, ids)
    with torch.no_grad():
        model.tok_emb.weight.mul_(1000.0)  # a huge embedding: every block's residual stream carries it
    scaled = answers.largest_activations(model, ids)
    assert scaled == pytest.approx(residual_stream_maxima(model, ids), rel=1e-6)
    assert min(scaled) > 100 * max(base)


# ------------------------------------------------------------------ Exercise 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_exercise_5_the_copy_is_exact_aligned_and_its_own(answers, dtype):
    original = (torch.randn(1536, 576) * 50).to(dtype)
    before = original.clone()
    copied = answers.copy_into_huge_pages(original)
    assert copied.dtype == dtype and copied.shape == original.shape and torch.equal(copied, before)
    assert copied.data_ptr() % (2 << 20) == 0  # the first byte on a 2 MiB boundary
    copied.view(-1)[0] += 1
    assert torch.equal(original, before)  # a copy, not a view of the original


def test_exercise_5_the_kernel_backs_the_copy_with_huge_pages(answers):
    if transparent_huge_pages() in (None, "never"):
        pytest.skip("this kernel gives no transparent huge pages")
    copied = answers.copy_into_huge_pages(torch.randn(4096, 1024))  # 16 MiB: eight huge pages
    assert huge_page_bytes(copied.data_ptr()) >= 16 << 20  # /proc/self/smaps: the whole copy in 2 MiB pages

