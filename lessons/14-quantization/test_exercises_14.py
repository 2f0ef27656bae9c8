"""Checks for lesson 14's exercises: `pytest lessons/14-quantization` (yours) or `--solutions`.

References: the `gguf` package's Q4_0 codec, PyTorch's int4 kernel, the E2M3 grid (minillm.speed.mx_elements) with
each tie settled by brute force and cross-checked with ml_dtypes, ml_dtypes' E2M1 (round to nearest even), and
F.cross_entropy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F


def q4_0_blocks() -> np.ndarray:
    """Q4_0 blocks [n, 18] that tell a right decoder from a wrong one: as llama.cpp quantizes, random, and extreme."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    quantized = quantize(rng.standard_normal((4, 32)).astype(np.float32), GGMLQuantizationType.Q4_0)  # [4, 18]
    scales = np.array([[0.37], [-2.5], [-6.1e-5], [6.0e-8], [-65504.0], [1.0]], np.float16)  # subnormal, fp16's max
    random = np.concatenate([scales.view(np.uint8), rng.integers(0, 256, (6, 16), dtype=np.uint8)], axis=1)
    extreme = np.zeros((4, 18), np.uint8)
    extreme[:, :2] = np.array([[-0.75], [0.75], [-0.75], [3.0]], np.float16).view(np.uint8)
    extreme[0, 2:], extreme[1, 2:], extreme[2, 2:] = 0x00, 0xFF, 0x0F  # q all 0, all 15, low 15 and high 0
    extreme[3, 2:] = np.tile([0x8F, 0x70], 8)  # nibbles 15 8 0 7: every weight differs from its neighbours
    return np.concatenate([quantized, random, extreme])


def test_exercise_1_a_q4_0_block_decodes_as_gguf_does(answers):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = q4_0_blocks()
    assert (blocks[:4, :2].copy().view(np.float16) < 0).any(), "llama.cpp's quantizer gives some blocks d < 0"
    expected = dequantize(blocks, GGMLQuantizationType.Q4_0)  # [n, 32] float32
    for block, reference in zip(blocks, expected):
        decoded = np.asarray(answers.decode_q4_0_block(block.tobytes()))
        assert decoded.shape == (32,), f"return the 32 weights of the block, not {decoded.shape}"
        d = float(block[:2].copy().view(np.float16)[0])
        assert np.array_equal(decoded.astype(np.float32), reference), (
            f"block with d = {d:g}, codes {(np.concatenate([block[2:] & 15, block[2:] >> 4])).tolist()}: "
            f"expected {reference.tolist()}, got {decoded.tolist()}")


MIN_GAIN = 0.92  # the worked answer reaches 0.83-0.88 of min-max's squared error on these weights


def heavy_tailed(rows: int, columns: int, gen: torch.Generator) -> torch.Tensor:
    """Student's t weights with 3 degrees of freedom (a normal over the root of a chi-square's mean): trained
    weights' tails are heavier than a normal's, so each group has a few outliers."""
    normal = torch.randn(rows, columns, generator=gen)
    chi_square = (torch.randn(3, rows, columns, generator=gen) ** 2).sum(0)
    return 0.02 * normal / (chi_square / 3).sqrt()


@pytest.mark.parametrize("group_size", [32, 64])
def test_exercise_2_clipped_int4_runs_on_the_kernel_and_beats_min_max(answers, group_size):
    from minillm.speed.quant import dequantize_int4, quantize_int4_groupwise

    gen = torch.Generator().manual_seed(group_size)
    weight = heavy_tailed(64, 256, gen)
    weight[0, :group_size] = 0.5  # a constant group
    q, scale, zero = answers.quantize_int4_clipped(weight, group_size)
    assert q.shape == (64, 256) and q.min() >= 0 and q.max() <= 15
    assert scale.shape == zero.shape == (64, 256 // group_size) and (scale > 0).all()
    per_weight = lambda t: t.repeat_interleave(group_size, dim=1)
    rebuilt = (q.float() - 8) * per_weight(scale) + per_weight(zero)
    assert (rebuilt[0, :group_size] == 0.5).all(), "a constant group is rebuilt exactly"
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    x = torch.randn(3, 256, generator=gen)
    scale_and_zero = torch.stack((scale, zero), -1).transpose(0, 1).contiguous()  # [K / group_size, N, 2]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zero)
    torch.testing.assert_close(out, x @ rebuilt.T, rtol=1e-5, atol=1e-5)  # the kernel's form, as it reads it
    groups = lambda w: ((w - weight) ** 2).reshape(64, -1, group_size).sum(-1)  # squared error per group
    mine, min_max = groups(rebuilt), groups(dequantize_int4(*quantize_int4_groupwise(weight, group_size)))
    worse = (mine > min_max * (1 + 1e-4) + 1e-12).nonzero().tolist()
    assert not worse, f"groups (row, group) worse than min-max, which is the ratio r = 1: {worse[:5]}"
    assert mine.sum() <= MIN_GAIN * min_max.sum(), (
        f"squared error {mine.sum() / min_max.sum():.2f}x min-max's: cut each end of the range on its own")


E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def mxfp4_by_ml_dtypes(x: np.ndarray) -> np.ndarray:
    """The spec's MXFP4 block, with ml_dtypes' E2M1 cast (round to nearest, ties to even) as the rounding."""
    import ml_dtypes

    scale = np.float32(2.0 ** (np.frexp(np.abs(x).max())[1] - 1 - 2))
    return np.clip(x / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * scale


def e2m3_ties_by_brute_force() -> dict[str, list[float]]:
    """Every tie between adjacent positive E2M3 values, settled by searching the grid: the nearest code ending in 0."""
    import ml_dtypes

    from minillm.speed.mx_elements import E2M3, finite_grid

    values, codes = finite_grid(E2M3)  # the 32 magnitudes, ascending, and their codes
    values, codes = values.double(), codes.long()
    found = {"up": [], "down": []}
    for tie in ((values[1:] + values[:-1]) / 2).tolist():
        distance = (values - tie).abs()
        nearest = torch.nonzero(distance == distance.min()).flatten()  # the two neighbours, equally near
        assert len(nearest) == 2
        (winner,) = [i for i in nearest.tolist() if codes[i] % 2 == 0]  # ties to even: the code ending in 0
        found["up" if values[winner] > tie else "down"].append(tie)
    # The reference itself, checked against an independent cast (ml_dtypes rounds to nearest, ties to even).
    ties = np.array(found["up"] + found["down"], np.float32)
    cast = ties.astype(ml_dtypes.float6_e2m3fn).astype(np.float32)
    assert np.array_equal(cast > ties, np.arange(len(ties)) < len(found["up"]))
    return found


def test_exercise_3_predict_which_e2m3_ties_round_up(answers):
    predicted = answers.e2m3_tie_predictions()
    truth = e2m3_ties_by_brute_force()
    assert set(predicted) == {"up", "down"}, 'return {"up": [...], "down": [...]}'
    ties = sorted(truth["up"] + truth["down"])
    listed = [float(tie) for tie in predicted["up"]] + [float(tie) for tie in predicted["down"]]
    not_ties = sorted(set(listed) - set(ties))
    missing = sorted(set(ties) - set(listed))
    assert not not_ties, f"not midpoints of adjacent positive E2M3 values: {not_ties}"
    assert not missing, f"{len(missing)} of the {len(ties)} ties are missing, e.g. {missing[:3]}"
    assert len(listed) == len(ties), "list each tie once"
    wrong = sorted(set(map(float, predicted["up"])) - set(truth["up"])) + sorted(
        set(map(float, predicted["down"])) - set(truth["down"]))
    assert not wrong, (f"you have {len(predicted['up'])} up and {len(predicted['down'])} down; these ties go the "
                       f"other way: {wrong}")


def test_exercise_3_an_mxfp4_block_rounds_ties_to_even(answers):
    gen = torch.Generator().manual_seed(3)
    blocks = [torch.randn(32, generator=gen) * spread for spread in (1e-3, 1.0, 50.0)]
    saturating = torch.randn(32, generator=gen)
    saturating[0] = 7.9 * saturating.abs().max()  # a block whose max saturates at 6 after scaling
    ties = torch.tensor(E2M1_TIES * 2 + [6.0, 0.5] * 9) * 2.0 ** -5  # every tie, both signs, scale 2^-5
    ties[7:14] *= -1
    for block in [*blocks, saturating, ties]:
        got = answers.mxfp4_quantize_dequantize(block.clone())
        assert torch.equal(got.float(), torch.from_numpy(mxfp4_by_ml_dtypes(block.numpy())))


def test_exercise_4_perplexity_equals_exp_cross_entropy(answers):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(50, 1000, generator=gen) * 5
    tokens = torch.randint(0, 1000, (50,), generator=gen)
    expected = F.cross_entropy(logits[:-1], tokens[1:]).exp().item()
    assert answers.perplexity(logits, tokens) == pytest.approx(expected, rel=1e-5)
    confident = torch.full((4, 10), -1e4)
    confident[torch.arange(3), torch.tensor([1, 2, 3])] = 1e4  # certain of every next token
    assert answers.perplexity(confident, torch.tensor([0, 1, 2, 3])) == pytest.approx(1.0)


@pytest.mark.parametrize("group_size", [32, 128])
def test_exercise_5_int4_error_bounds_hold_and_are_tight(answers, group_size):
    from minillm.speed.quant import dequantize_int4, quantize_int4_groupwise

    gen = torch.Generator().manual_seed(5 + group_size)
    N, K = 48, 256
    weight = torch.randn(N, K, generator=gen) * torch.logspace(-2, 0, N)[:, None]  # rows of very different ranges
    weight[0, :group_size] = 0.25  # a constant group: no error at all
    x = torch.randn(6, K, generator=gen)
    weight_bound, output_bound = answers.int4_error_bounds(weight, group_size, x)
    assert weight_bound.shape == (N, K // group_size) and output_bound.shape == (6, N)
    error = dequantize_int4(*quantize_int4_groupwise(weight, group_size)) - weight  # [N, K]
    per_group = error.abs().reshape(N, K // group_size, group_size).amax(-1)
    slack = 1e-6 * weight.abs().max()  # float32 rounding in the kernel's form (q - 8)·s + z
    assert (per_group <= weight_bound + slack).all(), "a weight moved further than your bound"
    assert weight_bound[0, 0] == 0, "a constant group is stored exactly"
    assert (per_group.sum() / weight_bound.sum()) > 0.9, "your weight bound is far from what rounding reaches"
    assert ((x @ error.T).abs() <= output_bound + K * slack).all(), "an output moved further than your bound"
    # The worst weights sit half a step between two levels; the worst input lines up with their errors' signs.
    low, step = torch.randn(N, K // group_size, 1, generator=gen), torch.rand(N, K // group_size, 1, generator=gen)
    levels = torch.randint(0, 15, (N, K // group_size, group_size), generator=gen) + 0.5
    levels[..., 0], levels[..., 1] = 0, 15  # the group's minimum and maximum
    halfway = (low + levels * step).reshape(N, K)
    error = dequantize_int4(*quantize_int4_groupwise(halfway, group_size)) - halfway
    worst_x = torch.sign(error)  # row n: the input that makes output n as wrong as it can be
    _, bound = answers.int4_error_bounds(halfway, group_size, worst_x)
    reached = (worst_x * error).sum(-1)  # output n of input n
    bound = bound.diagonal()
    assert (reached <= bound + K * slack).all()
    assert (reached >= 0.9 * bound).all(), "the worst weights and input should nearly reach your output bound"


def q4_k_blocks(count: int = 64, seed: int = 6) -> np.ndarray:
    """Random Q4_K super-blocks: finite float16 d and dmin (some negative, some subnormal), every other byte random
    (so every 6-bit scale and min, and every code, occurs)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, 144), dtype=np.uint8)
    steps = rng.uniform(-0.05, 0.05, (count, 2)).astype(np.float16)
    steps[0] = [np.float16(6e-8), np.float16(-6e-8)]  # float16 subnormals
    blocks[:, 0:4] = steps.view(np.uint8)
    return blocks


def test_exercise_6_a_q4_k_super_block_decodes_as_gguf_does(answers):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = q4_k_blocks()
    expected = dequantize(blocks, GGMLQuantizationType.Q4_K)  # [n, 256] float32
    for block, reference in zip(blocks, expected):
        decoded = np.asarray(answers.decode_q4_k_block(block.tobytes()))
        assert decoded.shape == (256,), f"return the 256 weights of the super-block, not {decoded.shape}"
        wrong = np.flatnonzero(~np.isclose(decoded.astype(np.float32), reference, rtol=1e-6, atol=0))
        assert not len(wrong), (f"weight {wrong[0]} (sub-block {wrong[0] // 32}): expected {reference[wrong[0]]}, "
                                f"got {decoded[wrong[0]]}")


def test_exercise_7_smoothing_is_exact_in_float_and_helps_static_int8(answers):
    from minillm.speed.quant import StaticInt8Linear

    gen = torch.Generator().manual_seed(7)
    k, n, t = 64, 48, 256
    x = torch.randn(t, k, generator=gen)
    x[:, [3, 40]] *= 50  # two outlier channels, as in a language model's activations
    weight = 0.05 * torch.randn(n, k, generator=gen)
    weight[:, 9] = 0  # a dead input channel
    act_absmax, w_absmax = x.abs().amax(0), weight.abs().amax(0)
    s = answers.smoothquant_scales(act_absmax, weight, 0.5)
    expected = torch.where((act_absmax > 0) & (w_absmax > 0), act_absmax.sqrt() / w_absmax.sqrt(), 1.0)
    torch.testing.assert_close(s.float(), expected)
    for alpha in (0.0, 0.3, 0.8):  # the general formula, not only its square-root case
        s_alpha = answers.smoothquant_scales(act_absmax, weight, alpha).float()
        live = w_absmax > 0
        torch.testing.assert_close(s_alpha[live], act_absmax[live] ** alpha / w_absmax[live] ** (1 - alpha))
    torch.testing.assert_close((x / s) @ (weight * s).T, x @ weight.T, rtol=1e-5, atol=1e-4)  # exact migration
    live = w_absmax > 0
    torch.testing.assert_close((x / s).abs().amax(0)[live], (weight * s).abs().amax(0)[live])  # alpha 0.5 balances

    def static_int8_error(inputs, w):
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = w.clone()
        quantized = StaticInt8Linear.from_linear(linear, inputs.abs().max().item())
        with torch.no_grad():
            return (quantized(inputs).float() - x @ weight.T).pow(2).mean().item()

    plain, smoothed = static_int8_error(x, weight), static_int8_error(x / s, weight * s)
    assert smoothed < plain / 4, f"smoothing should cut static int8's squared error: {plain:.3g} -> {smoothed:.3g}"
