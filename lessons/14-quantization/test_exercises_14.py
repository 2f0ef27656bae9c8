"""Checks for lesson 14's exercises: `pytest lessons/14-quantization` (yours) or `--solutions`.

References: the `gguf` package's own Q4_1 and MXFP4 codecs, PyTorch's int4 kernel, and F.cross_entropy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F


def test_exercise_1_a_q4_1_block_decodes_as_gguf_does(answers):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    weights = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    blocks = quantize(weights, GGMLQuantizationType.Q4_1)  # [4, 20]
    expected = dequantize(blocks, GGMLQuantizationType.Q4_1)
    for row in range(4):
        decoded = answers.decode_q4_1_block(blocks[row].tobytes())
        assert decoded.shape == (32,) and np.array_equal(decoded.astype(np.float32), expected[row])


@pytest.mark.parametrize("group_size", [32, 64])
def test_exercise_2_int4_groups_run_on_the_kernel(answers, group_size):
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(32, 128, generator=gen)
    weight[0, :group_size] = 0.5  # a constant group
    q, scale, zero = answers.quantize_int4(weight, group_size)
    assert q.shape == (32, 128) and q.min() >= 0 and q.max() <= 15
    assert scale.shape == zero.shape == (32, 128 // group_size) and (scale > 0).all()
    per_weight = lambda t: t.repeat_interleave(group_size, dim=1)
    rebuilt = (q.float() - 8) * per_weight(scale) + per_weight(zero)
    assert ((rebuilt - weight).abs() <= per_weight(scale) / 2 + 1e-5).all()  # half a step at most
    assert torch.equal(q.reshape(32, -1, group_size).amin(-1)[1:], torch.zeros(31, 128 // group_size).long())
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    x = torch.randn(3, 128, generator=gen)
    scale_and_zero = torch.stack((scale, zero), -1).transpose(0, 1).contiguous()  # [K / group_size, N, 2]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zero)
    torch.testing.assert_close(out, x @ rebuilt.T, rtol=1e-5, atol=1e-5)


def test_exercise_3_an_mxfp4_block_matches_gguf(answers):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    gen = torch.Generator().manual_seed(3)
    for spread in (1e-3, 1.0, 50.0):
        x = torch.randn(8, 32, generator=gen) * spread
        x[0, 0] = 7.9 * x[0].abs().max()  # a block whose max saturates at 6 after scaling
        expected = dequantize(quantize(x.numpy(), GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4)
        for row in range(8):
            got = answers.mxfp4_quantize_dequantize(x[row])
            assert torch.equal(got.float(), torch.from_numpy(expected[row]))


def test_exercise_4_perplexity_equals_exp_cross_entropy(answers):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(50, 1000, generator=gen) * 5
    tokens = torch.randint(0, 1000, (50,), generator=gen)
    expected = F.cross_entropy(logits[:-1], tokens[1:]).exp().item()
    assert answers.perplexity(logits, tokens) == pytest.approx(expected, rel=1e-5)
    confident = torch.full((4, 10), -1e4)
    confident[torch.arange(3), torch.tensor([1, 2, 3])] = 1e4  # certain of every next token
    assert answers.perplexity(confident, torch.tensor([0, 1, 2, 3])) == pytest.approx(1.0)
