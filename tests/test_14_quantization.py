"""Lesson 14: quantized linears equal their dequantize-then-F.linear references; the GGUF's Q4_1 blocks run
natively and equal the dequantized model; block codecs against gguf.quants; MX codecs bit-exact against ml_dtypes,
torch's float8 casts, brute force and hand tables, ties included."""

from __future__ import annotations

import copy
import itertools

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer, causal_positions, init_weights
from minillm.speed.mx import (
    MX_FORMATS,
    SHARED_MICROEXPONENT,
    apply_mx_to_weights,
    bits_per_weight,
    microexponent_decode,
    microexponent_encode,
    mx_decode,
    mx_encode,
    pack_fp4,
    quantize_dequantize,
    scale_values,
    unpack_fp4,
)
from minillm.speed.mx_elements import E2M1, E2M3, E3M2, E4M3, E5M2, INT8, finite_grid
from minillm.speed.quality import compare_models, held_out_tokens
from minillm.speed.quant import (
    DynamicInt8Linear,
    Int4WeightLinear,
    Int8WeightLinear,
    QuantizationError,
    QuantizedLinear,
    StaticInt8Linear,
    check_device,
    dequantize_int4,
    dequantize_int8,
    inner_k_tiles,
    int4_pairs,
    int8_dequantizing_matmul,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    quantize_rows_int8,
)
from minillm.speed.quant_gguf import (
    BLOCK_BYTES,
    decode_blocks,
    dequantize_blocks,
    encode_blocks,
    int4_linear_from_blocks,
    int8_linear_from_blocks,
)
import minillm.speed.quant_widen as quant_widen
from minillm.speed.quant_widen import EXACT_K, int4_block, int8_product, scratch, unpack_int4, widens
from minillm.speed.quantize_model import dequantize_model, quantize_model, quantized_modules, weight_bytes

# The default model's matrices (N, K): q/k/v fused, o, gate/up fused, down; and a small odd one.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (48, 64)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def linear_with(n, k, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    linear.weight.data = torch.randn(n, k, generator=gen) * 0.05
    if bias:
        linear.bias.data = torch.randn(n, generator=gen)
    return linear


# ------------------------------------------------------------------ weight-only kernels vs their references


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_kernel_equals_dequantize_then_linear(n, k):
    linear = linear_with(n, k, bias=True)
    q, scale = quantize_int8_per_channel(linear.weight)
    reference_weight = dequantize_int8(q, scale)  # from the codes, not through the kernel
    assert (reference_weight - linear.weight).abs().max() <= scale.max() / 2 + 1e-7  # half a step at most
    x = torch.randn(3, 5, k)
    reference = F.linear(x, reference_weight, linear.bias)
    exact = Int8WeightLinear(q, scale, linear.bias, compute_dtype=torch.float32)
    assert relative_error(exact(x), reference) < 1e-5
    fast = Int8WeightLinear(q, scale, linear.bias)  # bfloat16 activations: 8 mantissa bits, ~0.4% per product
    assert fast(x).dtype == torch.float32 and relative_error(fast(x), reference) < 2e-2


@pytest.mark.parametrize("n,k,group_size", [(n, k, 32) for n, k in SHAPES] + [(576, 576, 64), (48, 128, 128)])
def test_int4_kernel_equals_dequantize_then_linear(n, k, group_size):
    linear = linear_with(n, k, bias=True)
    q, scale, zero = quantize_int4_groupwise(linear.weight, group_size)
    assert q.max() <= 15 and q.shape == (n, k) and scale.shape == (n, k // group_size)
    reference_weight = dequantize_int4(q, scale, zero)
    assert ((reference_weight - linear.weight).abs() <= scale.repeat_interleave(group_size, 1) / 2 + 1e-6).all()
    x = torch.randn(2, 3, k)
    reference = F.linear(x, reference_weight, linear.bias)
    exact = Int4WeightLinear(q, scale, zero, linear.bias, compute_dtype=torch.float32)
    assert relative_error(exact(x), reference) < 1e-5
    if n * k < 500_000:  # reading the weight back through the kernel's float32 path is slow on big ones
        assert relative_error(exact.dequantized_weight(), reference_weight) < 1e-6
    fast = Int4WeightLinear(q, scale, zero, linear.bias)
    assert relative_error(fast(x), reference) < 2e-2


# ------------------------------------------------------------------ the GPU's forms, checked where a CPU can


def test_the_gpu_int8_form_is_the_int8_kernels_product():
    """On a GPU int8 runs as the widening and a matmul (fused by Inductor there): the same product as ATen's
    int8 kernel here, in float32."""
    linear = linear_with(576, 1536, seed=3)
    q, scale = quantize_int8_per_channel(linear.weight)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(4))
    kernel = torch.ops.aten._weight_int8pack_mm(x, q, scale)
    assert relative_error(int8_dequantizing_matmul(x, q, scale), kernel) < 1e-5  # float32 sums, another order


def test_int4_pairs_are_the_gpu_packings_input():
    """torch's GPU packing (`_convert_weight_to_int4pack`) reads [N, K / 2] bytes, code 2j in the high nibble and
    2j + 1 in the low one (torch's own test helper packs so); checked element by element."""
    q = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    pairs = int4_pairs(q)
    assert pairs.dtype == torch.uint8 and pairs.shape == (16, 32) and pairs.is_contiguous()
    for n, j in itertools.product(range(16), range(32)):
        assert int(pairs[n, j]) == 16 * int(q[n, 2 * j]) + int(q[n, 2 * j + 1])


@pytest.mark.parametrize("k, tiles", [(576, 4), (1536, 8), (96, 2), (32, 2), (4096, 8)])
def test_the_gpu_layout_takes_the_widest_tiling_k_fills(k, tiles):
    """The tinygemm layout packs `inner_k_tiles` 16-wide tiles side by side (2, 4 or 8): K must be a multiple of
    16 x tiles, and wider is fewer loads; the default model's K of 576 takes 4, its MLP's 1536 takes 8."""
    assert inner_k_tiles(k) == tiles


def test_quantizing_off_a_cpu_or_gpu_and_moving_packed_codes_are_refused():
    """The kernels run on a CPU or a CUDA GPU; an int4 module's packed layout is its device's own, so moving it
    to another device is refused rather than run on codes laid out for the other kernel."""
    with pytest.raises(QuantizationError, match="run on a CPU or a CUDA GPU"):
        check_device(linear_with(16, 32).to("meta"), "blocks.0.mlp.fc", "int8")
    q, scale, zero = quantize_int4_groupwise(linear_with(16, 64).weight, 32)
    with pytest.raises(QuantizationError, match="move the model first, then quantize it"):
        Int4WeightLinear(q, scale, zero).to("meta")


# ------------------------------------------------------------------ many rows: the codes widened to bfloat16


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576)])
def test_int4_layout_reads_back_the_codes_the_kernel_packed(n, k):
    block = int4_block()
    if block is None:
        pytest.skip(f"the int4 kernel's layout on {torch.backends.cpu.get_cpu_capability()} is not the AVX-512 or "
                    f"AVX2 one: the kernel runs at every row count")
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_int4(packed, n, k, block).t(), q.to(torch.uint8))


def count_calls(monkeypatch, name):
    """Wrap minillm.speed.quant's `name` so the test sees how often the widened path ran."""
    import minillm.speed.quant as quant
    calls, original = [], getattr(quant, name)
    monkeypatch.setattr(quant, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64)])
def test_many_rows_widen_the_codes_and_agree_with_the_kernel(monkeypatch, kind, n, k):
    linear = linear_with(n, k, bias=True)
    module = Int8WeightLinear.from_linear(linear) if kind == "int8" else Int4WeightLinear.from_linear(linear, 32)
    calls = count_calls(monkeypatch, f"{kind}_widened_matmul")
    for rows in (module.widen_rows - 1, module.widen_rows, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        before = len(calls)
        y = module(x)
        reference = F.linear(x, module.dequantized_weight(), linear.bias)
        kernel = (torch.ops.aten._weight_int8pack_mm(x.bfloat16(), module.weight_int8, module.scale) if kind == "int8"
                  else torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), module.weight_int4,
                                                                  module.group_size, module.scale_and_zero))
        assert y.dtype == torch.float32 and y.shape == reference.shape
        assert relative_error(y, reference) < 2e-2  # bfloat16 activations, as the kernel's own bound above
        assert relative_error(y - linear.bias, kernel) < 2e-2
        widened = rows >= module.widen_rows and (kind == "int8" or (int4_block() and n % int4_block() == 0))
        assert len(calls) - before == widened


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("bf16_hardware", [True, False])
def test_codes_widen_to_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, kind, bf16_hardware):
    """Without bfloat16 dot products (the AMD EPYC) a bfloat16 matmul is PyTorch's generic loop, many times
    float32's: there the codes widen to float32, from the rows where that wins, and agree with the reference
    more closely than bfloat16 can."""
    monkeypatch.setattr(quant_widen, "bfloat16_dot_products", lambda: bf16_hardware)
    n, k = 960, 576
    linear = linear_with(n, k, bias=False)
    module = Int8WeightLinear.from_linear(linear) if kind == "int8" else Int4WeightLinear.from_linear(linear, 32)
    dtype = torch.bfloat16 if bf16_hardware else torch.float32
    assert module.widen_rows == quant_widen.WIDEN_FROM_ROWS[dtype][kind]
    if kind == "int4" and not (int4_block() and n % int4_block() == 0):
        pytest.skip("this CPU's int4 layout is not one quant_widen reads: the kernel runs at every row count")
    x = torch.randn(module.widen_rows, k, generator=torch.Generator().manual_seed(1))
    widened = getattr(quant_widen, f"{kind}_widened_matmul")
    args = ((module.weight_int8, module.scale) if kind == "int8"
            else (module.weight_int4, module.scale_and_zero, n, module.group_size))
    y = widened(x.to(module.compute_dtype), *args)
    assert y.dtype == dtype
    bound = 2e-2 if bf16_hardware else 2e-3  # float32 widening: only the activations' rounding to bfloat16
    assert relative_error(y.float(), F.linear(x, module.dequantized_weight())) < bound


def test_int8_product_through_float32_is_exact():
    """A float32 sum of int8 products is exact while it stays below 2^24: pieces of EXACT_K columns are, one
    piece of 2 * EXACT_K extreme codes is not (so the split is what makes it exact)."""
    k = 2 * EXACT_K + 7
    x = torch.full((16, k), 127, dtype=torch.int8)
    w = torch.full((32, k), 127, dtype=torch.int8)
    x[1::2, ::3], w[::5, 1::2] = -127, -128
    x[4:] = torch.randint(-128, 128, (12, k), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(int8_product(x, w), torch._int_mm(x, w.t()))
    assert not torch.equal((x.float() @ w.float().t()).to(torch.int32), torch._int_mm(x, w.t()))


@pytest.mark.parametrize("int8_hardware", [True, False])
def test_dynamic_int8_takes_the_float32_product_only_without_int8_dot_products(monkeypatch, int8_hardware):
    monkeypatch.setattr(quant_widen, "int8_dot_products", lambda: int8_hardware)
    calls = count_calls(monkeypatch, "int8_product")
    module = DynamicInt8Linear.from_linear(linear_with(576, 1536, bias=False))
    for rows in (1, quant_widen.INT8_PRODUCT_FROM_ROWS, 64):
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
        before = len(calls)
        x_scale = module.input_scale(x)
        exact = torch._int_mm(quantize_rows_int8(x, x_scale), module.weight_int8.t()).float() * x_scale * module.scale
        assert torch.equal(module(x), exact)
        assert len(calls) - before == (not int8_hardware and rows >= quant_widen.INT8_PRODUCT_FROM_ROWS)


def test_compiled_graphs_keep_the_kernels():
    """Under torch.compile (and export) `widens` says no, so a kept graph never holds the widened matmul."""
    x = torch.zeros(max(rows["int4"] for rows in quant_widen.WIDEN_FROM_ROWS.values()), 16, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: t + int(widens(t, torch.bfloat16, "int4")), backend="eager", fullgraph=True)
    assert widens(x, torch.bfloat16, "int4") and not widens(x, torch.float32, "int4")
    assert not widens(x[:8], torch.bfloat16, "int4")
    assert torch.equal(compiled(x), x)


def test_int4_linear_exports_before_any_eager_call():
    """A first `--quant gguf --compile` in a new process exports the int4 linear before any eager forward has run
    `int4_block`'s probe (a data-dependent comparison export cannot trace): the graph holds the kernel alone."""
    module = Int4WeightLinear.from_linear(torch.nn.Linear(64, 128, bias=False))
    int4_block.cache_clear()
    program = torch.export.export(module, (torch.randn(1, 64),), strict=False)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "aten._weight_int4pack_mm_for_cpu.default" in targets and "aten.equal.default" not in targets


def test_scratch_buffers_are_kept_per_thread():
    import threading
    mine = scratch("test", (4, 4), torch.bfloat16)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(scratch("test", (4, 4), torch.bfloat16)))
    thread.start(), thread.join()
    assert scratch("test", (4, 4), torch.bfloat16) is mine and theirs[0] is not mine


def test_dynamic_and_static_int8_equal_their_fake_quantized_references():
    linear = linear_with(1536, 576, bias=True)
    q, w_scale = quantize_int8_per_channel(linear.weight)
    x = torch.randn(4, 576)
    x[1] *= 10  # rows of very different ranges: each gets its own scale
    x_scale = x.abs().amax(1, keepdim=True) / 127
    fake_x = torch.round(x / x_scale).clamp(-127, 127) * x_scale
    reference = F.linear(fake_x, dequantize_int8(q, w_scale), linear.bias)
    assert relative_error(DynamicInt8Linear.from_linear(linear)(x), reference) < 1e-5
    static = StaticInt8Linear.from_linear(linear, input_absmax=2.0)  # row 1 exceeds it: saturates at ±127
    fixed = 2.0 / 127
    reference = F.linear(torch.round(x / fixed).clamp(-127, 127) * fixed, dequantize_int8(q, w_scale), linear.bias)
    assert relative_error(static(x), reference) < 1e-5


# ------------------------------------------------------------------ swaps on a tiny model


def tiny_llama(seed=0) -> Transformer:
    config = ModelConfig(vocab_size=96, context_length=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128,
                         norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, qkv_bias=False)
    return init_weights(Transformer(config), std=0.1, seed=seed).eval()


@pytest.mark.parametrize("method", ["int8", "int4", "dynamic-int8", "static-int8"])
def test_swap_equals_its_dequantized_model_and_stays_close_to_float(method):
    model = tiny_llama()
    tokens = torch.randint(0, 96, (2, 12))
    positions = causal_positions(2, 12)
    with torch.no_grad():
        original = model(tokens, positions)
        quantize_model(model, method, compute_dtype=torch.float32, calibration_tokens=tokens)
        out = model(tokens, positions)
        plain = dequantize_model(copy.deepcopy(model))
        assert not quantized_modules(plain) and sum(quantized_modules(model).values()) == 2 * 4 + 1
        if method in ("int8", "int4"):  # weight-only: exactly the dequantized weights
            assert relative_error(out, plain(tokens, positions)) < 1e-5
        # random Gaussian weights are a hard case for 4 bits (no structure, full range in every group)
        bound, agreement = {"int8": (0.02, 0.9), "int4": (0.4, 0.6), "dynamic-int8": (0.05, 0.9),
                            "static-int8": (0.08, 0.9)}[method]
        assert relative_error(out, original) < bound
        assert (out.argmax(-1) == original.argmax(-1)).float().mean() > agreement


def test_weight_bytes_count_what_a_step_reads():
    model = tiny_llama()
    float_bytes = weight_bytes(model)
    assert float_bytes == model.num_weight_bytes()  # tied head: the embedding is the head
    quantize_model(model, "int8")
    linear_weights = 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 96 * 64
    scales = 2 * (128 + 64 + 256 + 64) + 96  # bfloat16
    norms = 2 * 2 * 64 + 64
    assert weight_bytes(model) == linear_weights + 2 * scales + 4 * (norms + 64)  # + one embedding row


# ------------------------------------------------------------------ refusals, one clear line each


def test_kernels_refuse_what_they_cannot_run():
    with pytest.raises(QuantizationError, match="group size 128 does not fit .*K=576.*use 32 or 64"):
        Int4WeightLinear.from_linear(linear_with(64, 576), group_size=128)
    with pytest.raises(QuantizationError, match="multiple of 16; weight has N=40"):
        Int4WeightLinear.from_linear(linear_with(40, 64))
    with pytest.raises(QuantizationError, match="K a multiple of 16.*K=24.*compute_dtype=torch.float32"):
        Int8WeightLinear.from_linear(linear_with(32, 24))
    Int8WeightLinear.from_linear(linear_with(32, 24), compute_dtype=torch.float32)  # float32 activations: fine
    model = tiny_llama()
    before = [type(m) for m in model.modules()]
    with pytest.raises(QuantizationError, match="blocks.0.attn.qkv"):
        quantize_model(model, "int4", group_size=128)
    assert [type(m) for m in model.modules()] == before  # refused before anything was swapped
    with pytest.raises(QuantizationError, match="unknown quantization 'int3'"):
        quantize_model(model, "int3")
    with pytest.raises(QuantizationError, match="calibration_tokens"):
        quantize_model(model, "static-int8")
    with pytest.raises(QuantizationError, match=r"is Q8_0: the int4 kernel runs 4-bit blocks \(Q4_0, Q4_1, Q4_K\)"):
        int4_linear_from_blocks(encode_blocks(np.ones((16, 32), np.float32), "Q8_0"), "Q8_0")
    with pytest.raises(QuantizationError, match="MX blocks of 32 do not divide"):
        mx_encode(torch.ones(2, 48), "mxfp4")


# ------------------------------------------------------------------ GGUF blocks: codecs against gguf.quants


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_codecs_are_bit_exact_against_gguf(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    w[3] = 0  # an all-zero row
    ours = encode_blocks(w, kind)
    theirs = quantize(w, GGMLQuantizationType[kind])
    assert np.array_equal(ours, theirs)
    assert np.array_equal(dequantize_blocks(ours, kind), dequantize(theirs, GGMLQuantizationType[kind]))


def test_q4_1_blocks_run_natively_code_for_code():
    w = np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32)
    blocks = encode_blocks(w, "Q4_1")
    q, d, m = decode_blocks(blocks, "Q4_1")
    # one block by hand: byte i holds element i (low nibble) and element i + 16 (high nibble)
    raw = blocks[0, :20]
    assert d[0, 0] == np.frombuffer(raw[:2].tobytes(), np.float16)[0]
    assert q[0, 5] == raw[4 + 5] & 15 and q[0, 21] == raw[4 + 5] >> 4
    linear = int4_linear_from_blocks(blocks, "Q4_1", compute_dtype=torch.float32)
    reference = torch.from_numpy(dequantize_blocks(blocks, "Q4_1"))
    x = torch.randn(3, 128)
    assert relative_error(linear(x), x @ reference.T) < 1e-6


# ------------------------------------------------------------------ MX codecs: elements against ml_dtypes and torch

# Independent references: ml_dtypes' casts (round to nearest even; every OCP element format), torch's float8 casts,
# and a brute-force nearest-even search over each format's enumerated values.
ML_DTYPES = {"E2M1": "float4_e2m1fn", "E2M3": "float6_e2m3fn", "E3M2": "float6_e3m2fn", "E4M3": "float8_e4m3fn",
             "E5M2": "float8_e5m2"}
FLOAT_ELEMENTS = [E2M1, E2M3, E3M2, E4M3, E5M2]
FORMAT_OF = {element.name: fmt for fmt, element in MX_FORMATS.items()}


def ml_dtype(element):
    return getattr(ml_dtypes, ML_DTYPES[element.name])


def reference_codes(values: np.ndarray, element) -> np.ndarray:
    """ml_dtypes' bit patterns for `values` after saturating at the largest element (ml_dtypes' E4M3 would give NaN,
    its E5M2 inf); for INT8, numpy's round-half-even of x·64."""
    clipped = np.clip(values.astype(np.float32), -element.max_value, element.max_value)
    if element is INT8:
        return np.rint(clipped * 64).astype(np.int8).view(np.uint8)
    return clipped.astype(ml_dtype(element)).view(np.uint8)


def nearest_by_brute_force(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each value -> the nearest entry of `table` (ascending, entry i has code i), ties to the one with an even code."""
    distance = (values[:, None] - table[None, :]).abs()
    candidates = distance == distance.min(dim=1, keepdim=True).values
    even_tie = candidates & (torch.arange(len(table)) % 2 == 0)
    return table[torch.where(even_tie.any(1), even_tie.float().argmax(1), candidates.float().argmax(1))]


def every_tie(element) -> torch.Tensor:
    """The midpoints between neighbouring elements, with both signs: the values ties-to-even decides."""
    table, _ = finite_grid(element)
    middles = (table[1:] + table[:-1]) / 2
    return torch.cat([middles, -middles])


@pytest.mark.parametrize("element", FLOAT_ELEMENTS, ids=lambda e: e.name)
def test_every_element_code_decodes_as_ml_dtypes_does(element):
    codes = np.arange(2 ** element.bits, dtype=np.uint8)
    expected = codes.view(ml_dtype(element)).astype(np.float32)  # E4M3's NaN, E5M2's inf and NaN included
    assert np.array_equal(element.decode(torch.from_numpy(codes)).numpy(), expected, equal_nan=True)
    finite = np.isfinite(expected)
    assert np.array_equal(element.encode(torch.from_numpy(expected[finite])).numpy(), codes[finite])  # −0 too
    assert element.max_value == float(ml_dtypes.finfo(ml_dtype(element)).max)


@pytest.mark.parametrize("element", [*FLOAT_ELEMENTS, INT8], ids=lambda e: e.name)
def test_element_rounding_is_bit_exact_on_ties_and_everywhere_else(element):
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(20_000, generator=gen) * torch.exp2(torch.empty(20_000).uniform_(-12, 10, generator=gen))
    values = torch.cat([every_tie(element), spread, torch.tensor([0.0, -0.0, 1e30, -1e30])])
    codes = element.encode(element.round(values))
    assert np.array_equal(codes.numpy(), reference_codes(values.numpy(), element))
    table, _ = finite_grid(element)
    expected = nearest_by_brute_force(values.abs().clamp(max=element.max_value), table) * values.sign()
    assert torch.equal(element.round(values), expected)


@pytest.mark.parametrize("element,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)],
                         ids=["E4M3", "E5M2"])
def test_fp8_rounding_equals_torch_casts(element, dtype):
    values = torch.cat([every_tie(element), torch.randn(10_000) * 100])
    expected = values.clamp(-element.max_value, element.max_value).to(dtype).float()
    assert torch.equal(element.round(values), expected)


def test_e2m1_ties_go_to_the_even_code():
    """Halfway between two E2M1 values, the one whose last mantissa bit is 0 wins: up as often as down."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    even = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # codes 0000 0010 0010 0100 0100 0110 0110
    assert torch.equal(E2M1.round(ties), even) and torch.equal(E2M1.round(-ties), -even)
    assert E2M1.encode(E2M1.round(ties)).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert E2M1.round(torch.tensor([6.9, 7.0, 100.0])).tolist() == [6.0, 6.0, 6.0]  # saturates
    assert E2M1.encode(E2M1.round(torch.tensor([-0.2]))).item() == 0b1000  # −0: keeps the sign, as IEEE
    assert INT8.round(torch.tensor([0.5, 1.5, 2.5, -1.5]) / 64).mul(64).tolist() == [0.0, 2.0, 2.0, -2.0]


# ------------------------------------------------------------------ MX codecs: blocks


def reference_block(block: np.ndarray, element) -> tuple[int, np.ndarray]:
    """One OCP MX block by the spec, in numpy and ml_dtypes: (E8M0 byte, element codes)."""
    amax = np.abs(block).max()
    exponent = int(np.clip(np.frexp(amax)[1] - 1 - element.emax, -127, 127)) if amax > 0 else -127
    scale = np.float32(2.0 ** exponent).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    return int(scale), reference_codes(block / np.float32(2.0 ** exponent), element)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=32, max_size=32),
       st.sampled_from(sorted(MX_FORMATS)))
def test_mx_blocks_equal_the_spec_computed_independently(values, fmt):
    x = torch.tensor([values])
    codes, scales = mx_encode(x, fmt)
    scale, expected = reference_block(x.numpy()[0], MX_FORMATS[fmt])
    assert scales.item() == scale and np.array_equal(codes.numpy()[0], expected)
    assert torch.equal(mx_decode(codes, scales, fmt), quantize_dequantize(x, fmt))


def test_e8m0_scales_are_ml_dtypes_e8m0():
    codes = np.arange(256, dtype=np.uint8)
    decoded = scale_values(torch.from_numpy(codes)).numpy()
    assert np.array_equal(decoded, codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), equal_nan=True)


MX_EDGES = {  # format: [(input with block max 1 unless noted, expected decoded value)], worked out by hand
    # E4M3, shared scale 2^(0 - 8): elements hold x·256; smallest subnormal 2^-9 -> x = 2^-17
    "mxfp8": [(1.0, 1.0), (0.0, 0.0), (2.0 ** -17, 2.0 ** -17), (2.0 ** -18, 0.0), (1.5 * 2.0 ** -17, 2.0 ** -16),
              (1.74, 1.75), (-0.3, -0.3125)],
    # E5M2, scale 2^(0 - 15): x·2^15; two mantissa bits: 1.375 is halfway between 1.25 (01) and 1.5 (10)
    "mxfp8_e5m2": [(1.0, 1.0), (1.3, 1.25), (1.375, 1.5), (1.125, 1.0), (2.0 ** -31, 2.0 ** -31), (2.0 ** -33, 0.0)],
    # E2M1, scale 2^(0 - 2): elements x·4 in {0, .5, 1, 1.5, 2, 3, 4, 6}; 1.9 -> 7.6 saturates at 6 -> 1.5;
    # 0.1875 -> 0.75 and 0.875 -> 3.5 are ties: up to the even codes 1.0 and 4.0
    "mxfp4": [(1.0, 1.0), (1.9, 1.5), (0.0625, 0.0), (0.1875, 0.25), (0.3125, 0.25), (-0.7, -0.75), (0.875, 1.0)],
    # E3M2, scale 2^(0 - 4): x·16; largest 28 -> 1.75; smallest subnormal 2^-4 -> 2^-8
    "mxfp6_e3m2": [(1.0, 1.0), (1.99, 1.75), (2.0 ** -8, 2.0 ** -8), (2.0 ** -10, 0.0)],
    # E2M3, scale 2^(0 - 2): x·4; largest 7.5 -> 1.875; smallest subnormal 0.125 -> 2^-5
    "mxfp6_e2m3": [(1.0, 1.0), (1.99, 1.875), (2.0 ** -5, 2.0 ** -5), (0.3, 0.3125)],
    # MXINT8, scale 2^0: x·64 rounded, ±127 at most
    "mxint8": [(1.0, 1.0), (1.999, 127 / 64), (-1.999, -127 / 64), (0.01, 1 / 64), (2.0 ** -8, 0.0)],
}


@pytest.mark.parametrize("fmt", list(MX_EDGES))
def test_mx_edge_values_match_hand_computed_tables(fmt):
    inputs, expected = zip(*MX_EDGES[fmt])
    block = torch.zeros(1, 32)
    block[0, : len(inputs)] = torch.tensor(inputs)
    block[0, -1] = 1.0 if fmt != "mxfp4" else 1.9  # the block's max fixes the scale (log2 floor = 0)
    out = quantize_dequantize(block, fmt)
    assert out[0, : len(inputs)].tolist() == list(expected)
    assert torch.equal(mx_decode(*mx_encode(block, fmt), fmt), out)  # through the bit patterns: the same
    codes, scales = mx_encode(torch.zeros(1, 32), fmt)
    assert (codes == 0).all() and scales.item() == 0 and mx_decode(codes, scales, fmt).eq(0).all()  # zero block
    for bad in (float("nan"), float("inf")):
        codes, scales = mx_encode(torch.tensor([[bad] + [1.0] * 31]), fmt)
        assert scales.item() == 255 and mx_decode(codes, scales, fmt).isnan().all()
        assert quantize_dequantize(torch.tensor([[bad] + [1.0] * 31]), fmt).isnan().all()


def test_mx_scale_is_e8m0_and_largest_finite_round_trips():
    assert mx_encode(torch.full((1, 32), 448.0 * 2.0 ** 20), "mxfp8")[1].item() == 127 + 20
    assert mx_encode(torch.full((1, 32), 2.0 ** -140), "mxfp4")[1].item() == 0  # e = −142 clamps to −127
    assert quantize_dequantize(torch.full((1, 32), 448.0), "mxfp8").eq(448.0).all()
    assert quantize_dequantize(torch.full((1, 32), 6.0), "mxfp4").eq(6.0).all()
    assert [bits_per_weight(f) for f in ("mxfp4", "mxfp6_e2m3", "mxfp8_e5m2", "mxint8")] == [4.25, 6.25, 8.25, 8.25]
    assert [bits_per_weight(f) for f in ("mx4", "mx6", "mx9")] == [4, 6, 9]


def test_fp4_codes_pack_two_per_byte():
    codes, _ = mx_encode(torch.randn(3, 64), "mxfp4")
    packed = pack_fp4(codes)
    assert packed.shape == (3, 32) and torch.equal(unpack_fp4(packed), codes)
    assert pack_fp4(torch.tensor([0b0001, 0b1010], dtype=torch.uint8)).item() == 0b1010_0001  # first in the low nibble


def test_mxfp4_bytes_match_gguf_except_on_ties():
    """gguf's MXFP4 block: an E8M0 byte, then 16 bytes of E2M1 codes, element i low nibble of byte i (i + 16 high).

    gguf picks each element by an argmin over its table, so a tie goes to the smaller magnitude, and a negative
    value that rounds to zero is stored as +0: off ties, and with −0 read as +0, the bytes are the same.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    x = torch.randn(8, 64) * 3
    codes, scales = mx_encode(x, "mxfp4")
    c = torch.where(codes == 0b1000, 0, codes).reshape(8, 2, 32).numpy()  # −0 -> +0
    ours = np.concatenate([scales.numpy()[..., None], (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)], axis=-1)
    assert np.array_equal(ours.reshape(8, -1), quantize(x.numpy(), GGMLQuantizationType.MXFP4))
    tie = torch.tensor([[3.5] + [4.0] * 31])  # scale 2^0: 3.5 is halfway between 3 and 4
    theirs = dequantize(quantize(tie.numpy(), GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4)
    assert theirs[0, 0] == 3.0 and quantize_dequantize(tie, "mxfp4")[0, 0] == 4.0  # gguf down, the spec to even


# ------------------------------------------------------------------ MX9 / MX6 / MX4


@pytest.mark.parametrize("fmt", list(SHARED_MICROEXPONENT))
def test_shared_microexponent_formats_against_brute_force(fmt):
    m = SHARED_MICROEXPONENT[fmt]
    x = torch.randn(4, 32) * torch.tensor([1e-3, 1.0, 7.0, 100.0])[:, None]
    x[0, 2:16] *= 0.01  # pairs far below the block max take the extra bit
    out = quantize_dequantize(x, fmt)
    codes, micro, shared = microexponent_encode(x, fmt)
    assert torch.equal(microexponent_decode(codes, micro, shared, fmt), out)
    assert codes.shape == (4, 32) and micro.shape == (4, 16) and shared.shape == (4, 2)
    for row, block in itertools.product(range(4), range(2)):
        values = x[row, 16 * block: 16 * block + 16]
        e = torch.floor(torch.log2(values.abs().max()))
        assert shared[row, block] == e + 127
        for pair in range(8):
            v = values[2 * pair: 2 * pair + 2]
            beta = 1 if v.abs().max() < 2 ** e else 0
            assert micro[row, 8 * block + pair] == beta
            grid = torch.arange(-(2 ** m - 1), 2 ** m) * 2.0 ** (e - beta - (m - 1))  # every representable value
            for i in range(2):
                index = 16 * block + 2 * pair + i
                nearest = grid[(grid - v[i]).abs().argmin()]  # no ties on random data
                assert out[row, index] == nearest, (row, index)


def test_mx6_block_by_hand():
    """MX6 (m = 4): block max 1.5 -> E = 0; a pair below 1 gets β = 1, step 2^(0 − 1 − 3) = 1/16, else 1/8."""
    x = torch.zeros(1, 16)
    x[0, :6] = torch.tensor([1.5, 0.3, 0.40625, -0.09375, 1.0, 0.0])  # pairs (1.5, .3) (.40625, −.09375) (1, 0)
    codes, micro, shared = microexponent_encode(x, "mx6")
    assert shared.item() == 127 and micro[0, :3].tolist() == [0, 1, 0]
    # 0.3 / (1/8) = 2.4 -> 2; 0.40625 / (1/16) = 6.5 -> 6 (tie, even); −0.09375 / (1/16) = −1.5 -> −2 (tie, even)
    assert quantize_dequantize(x, "mx6")[0, :4].tolist() == [1.5, 0.25, 0.375, -0.125]
    assert codes[0, :4].tolist() == [12, 2, 6, 0b10000 | 2]  # sign bit above the 4 magnitude bits
    assert quantize_dequantize(torch.full((1, 16), 1.99), "mx6").eq(1.875).all()  # q saturates at 15


# ------------------------------------------------------------------ on the real model


@pytest.fixture(scope="module")
def france(default_model):
    model, tokenizer = default_model
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True)
    return torch.tensor([tokenizer.encode(text)])


def test_gguf_native_q4_1_equals_the_dequantized_model(default_model, france):
    """minillm's float32 model is the GGUF dequantized: running the Q4_1 codes natively must give its logits."""
    from minillm.speed.quant_gguf import gguf_path_for, use_gguf_weights

    model, _ = default_model
    prompt = france[:, :12]  # the kernel's float32 path is a slow reference: a short prompt
    positions = causal_positions(1, prompt.shape[1])
    native = use_gguf_weights(copy.deepcopy(model), gguf_path_for("default"), compute_dtype=torch.float32, head="none")
    assert quantized_modules(native) == {"Int4WeightLinear": 4 * 30}
    assert weight_bytes(native) < 0.5 * weight_bytes(model)  # the float32 head still counts in full
    with torch.no_grad():
        assert relative_error(native(prompt, positions), model(prompt, positions)) < 1e-4


def test_q8_0_head_becomes_int8_rows_within_half_a_step():
    w = np.random.default_rng(2).standard_normal((64, 96)).astype(np.float32)
    w[:, :32] *= 10  # one block per row much larger: per-row int8 steps are coarser than its other blocks'
    blocks = encode_blocks(w, "Q8_0")
    head = int8_linear_from_blocks([(blocks, "Q8_0")], compute_dtype=torch.float32, rows_per_chunk=16)
    decoded = torch.from_numpy(dequantize_blocks(blocks, "Q8_0"))
    step = decoded.abs().amax(1, keepdim=True) / 127
    assert ((head.dequantized_weight() - decoded).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(2, 96)
    assert relative_error(head(x), x @ head.dequantized_weight().T) < 1e-5


def test_held_out_text_and_quality_measures(default_model):
    model, tokenizer = default_model
    tokens = held_out_tokens(tokenizer)
    assert len(tokens) >= 10_000
    int8 = quantize_model(copy.deepcopy(model), "int8")
    mxfp4 = apply_mx_to_weights(copy.deepcopy(model), "mxfp4")
    result = compare_models({"int8": int8, "same": model, "mxfp4": mxfp4}, model, tokens[:128], window=64)
    assert result["reference"]["tokens"] == 2 * 63  # two windows, each first token unpredicted
    assert result["same"]["kl"] == pytest.approx(0, abs=1e-6) and result["same"]["top1_agreement"] == 1
    assert result["same"]["perplexity"] == pytest.approx(result["reference"]["perplexity"])
    assert 1 < result["reference"]["perplexity"] < 100
    assert result["int8"]["kl"] < result["mxfp4"]["kl"] and result["int8"]["top1_agreement"] > 0.9


def test_cli_quant_refuses_what_it_cannot_map(capsys):
    from minillm.infer import main
    from minillm.speed.quant_gguf import apply_quantization

    with pytest.raises(QuantizationError,
                       match="'./my-folder' is not a GGUF: use --model default, gemma3-270m or a .gguf path"):
        apply_quantization(tiny_llama(), "gguf", "./my-folder")
    assert main(["--prompt", "hi", "--quant", "int3"]) == 2
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    model = apply_quantization(tiny_llama(), "int4", "tiny")
    assert type(model.lm_head) is Int8WeightLinear and type(model.blocks[0].mlp.fc) is Int4WeightLinear


def test_quant_results_plot_and_report(tmp_path):
    """The committed results/quant.json draws and reports, quoting its own numbers."""
    from minillm.base.jsonio import read_json
    from minillm.bench.common import RESULTS
    from minillm.bench.quant import plot
    from minillm.bench.sections_systems import quant_section

    if not (RESULTS / "quant.json").exists():
        pytest.skip("results/quant.json not measured yet: python -m minillm.bench quant")
    data = read_json(RESULTS / "quant.json")
    plot(data, tmp_path / "quant.png")
    assert 0 < (tmp_path / "quant.png").stat().st_size < 200_000
    text = quant_section("Quantized weights", data, {"png": "quant.png", "json": "quant.json"})
    assert f"| float32 | 32.00 | {data['accuracy']['float32']['perplexity']:.2f} |" in text


def test_quantized_modules_are_not_float_linears():
    assert not issubclass(QuantizedLinear, nn.Linear)  # a second swap never re-quantizes a quantized linear


def test_notebook_runs(run_notebook):
    run_notebook("14_quantization.ipynb", timeout=600)


# ---------------------------------------------------------------------------------------------- llama.cpp's copies

def write_gguf(path, tensors: dict, file_type: int = 3) -> None:
    """A small GGUF: the metadata llama.cpp reads first and `tensors` (name -> (array, GGML type))."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_file_type(file_type)
    writer.add_block_count(1)
    writer.add_token_list(["<a>", "<b>"])
    for name, (array, kind) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_copies_for_llama_cpp_keep_the_weights_and_the_metadata(tmp_path, monkeypatch):
    """The F32 copy holds exactly the dequantized weights; Q8_0 within its half-step, BF16 within its rounding (half
    a unit in its 8-bit mantissa); norms and metadata as they were."""
    import gguf

    from minillm.bench.llama_cpp import gguf_as

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path / "home"))
    Q4_1, Q8_0, F32 = (gguf.GGMLQuantizationType[k] for k in ("Q4_1", "Q8_0", "F32"))
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    norm = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    source = tmp_path / "model.Q4_1.gguf"
    write_gguf(source, {"blk.0.ffn_down.weight": (gguf.quants.quantize(weight, Q4_1), Q4_1),
                        "blk.0.attn_norm.weight": (norm, F32)})
    stored = gguf.quants.dequantize(gguf.GGUFReader(source).tensors[0].data, Q4_1)  # what minillm loads
    for kind, tolerance in (("F32", 0.0), ("Q8_0", None), ("BF16", np.abs(stored).max() * 2.0**-8)):
        copy_path = gguf_as(source, kind)
        reader = gguf.GGUFReader(copy_path)
        tensors = {t.name: t for t in reader.tensors}
        down, kept = tensors["blk.0.ffn_down.weight"], tensors["blk.0.attn_norm.weight"]
        assert down.tensor_type == gguf.GGMLQuantizationType[kind] and kept.tensor_type == F32
        values = gguf.quants.dequantize(down.data, down.tensor_type).reshape(stored.shape)
        bound = tolerance if tolerance is not None else np.abs(stored).max() / 127 / 2 * 1.01  # Q8_0: half a step
        assert np.abs(values - stored).max() <= bound
        np.testing.assert_array_equal(kept.data, norm)
        assert reader.fields["general.file_type"].contents() == {"F32": 0, "Q8_0": 7, "BF16": 32}[kind]
        assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<a>", "<b>"]
        assert gguf_as(source, kind) == copy_path  # made once
    assert sorted(p.name for p in copy_path.parent.iterdir()) == ["model.Q4_1.BF16.gguf", "model.Q4_1.F32.gguf",
                                                                  "model.Q4_1.Q8_0.gguf"]
    with pytest.raises(ValueError, match="choose one of F32, Q8_0, BF16"):
        gguf_as(source, "Q2_K")


def test_an_interrupted_gguf_copy_leaves_nothing_behind(tmp_path, monkeypatch):
    import gguf

    from minillm.bench.llama_cpp import gguf_as

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path / "home"))
    source = tmp_path / "model.gguf"
    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(source, {"blk.0.ffn_down.weight": (gguf.quants.quantize(np.ones((4, 32), np.float32), Q8_0), Q8_0)})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_as(source, "F32")
    assert list((tmp_path / "home" / "llama.cpp").iterdir()) == []


# --- K-quants and Q5 blocks, decoded by hand (a Q4_K_M file's blocks). -----------------------------------------------

def random_blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Rows of random `kind` blocks whose float16 fields hold finite scales (random bytes elsewhere: every code)."""
    from minillm.speed.kquants import KQUANT_BLOCK

    rng = np.random.default_rng(seed)
    size = KQUANT_BLOCK[kind][1]
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    fields = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}[kind]
    for at in fields:
        data[:, :, at:at + 2] = rng.uniform(-0.2, 0.2, (rows, blocks)).astype(np.float16).view(np.uint8).reshape(
            rows, blocks, 2)
    return data.reshape(rows, blocks * size)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k_quant_blocks_decode_by_hand_exactly_as_the_gguf_package(kind, seed):
    from gguf import GGMLQuantizationType, quants

    from minillm.speed.kquants import decode_kquant, dequantize_kquant

    data = random_blocks(kind, rows=4, blocks=3, seed=seed)
    ours = dequantize_kquant(data, kind)
    assert np.array_equal(ours, quants.dequantize(data, getattr(GGMLQuantizationType, kind)))  # bit for bit
    codes, scale, offset = decode_kquant(data, kind)
    low, high = {"Q4_K": (0, 15), "Q6_K": (-32, 31), "Q5_0": (-16, 15), "Q5_1": (0, 31)}[kind]
    assert codes.min() >= low and codes.max() <= high and (codes.min(), codes.max()) == (low, high)  # every code
    group = codes.shape[1] // scale.shape[1]
    assert group == (16 if kind == "Q6_K" else 32) and (offset is None) == (kind in ("Q6_K", "Q5_0"))


def test_q4_k_scales_and_mins_unpack_as_llama_cpp_packs_them():
    """Brute force over llama.cpp's `get_scale_min_k4`, written as it is in C, for random 12-byte fields."""
    from minillm.speed.kquants import q4_k_scales_and_mins

    packed = np.random.default_rng(7).integers(0, 256, (50, 12), dtype=np.uint8)
    scales, mins = q4_k_scales_and_mins(packed)
    for row, q in enumerate(packed.astype(int)):
        for j in range(8):
            if j < 4:
                d, m = q[j] & 63, q[j + 4] & 63
            else:
                d, m = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
            assert (scales[row, j], mins[row, j]) == (d, m)


@pytest.mark.slow
def test_every_k_quant_and_q5_matrix_of_gemma3_270m_decodes_as_the_gguf_package():
    """The course's own Q4_K_M file: its Q4_K, Q6_K and Q5_0 matrices (the last where rows are not a multiple of
    256), each decoded by hand equal to the `gguf` package's reading, weight for weight."""
    from gguf import GGUFReader, quants

    from minillm.model.loading import gemma3_source, resolve_checkpoint_folder
    from minillm.speed.kquants import KQUANT_BLOCK, dequantize_kquant

    resolve_checkpoint_folder("gemma3-270m")  # fetches the file on first use
    seen = set()
    for tensor in GGUFReader(gemma3_source().path).tensors:
        kind = tensor.tensor_type.name
        if kind in KQUANT_BLOCK:
            data = np.asarray(tensor.data)
            assert np.array_equal(dequantize_kquant(data, kind), quants.dequantize(data, tensor.tensor_type)), \
                tensor.name
            seen.add(kind)
    assert seen == {"Q4_K", "Q6_K", "Q5_0"}


def test_a_q4_k_m_file_runs_its_4_bit_blocks_code_for_code_and_its_wider_ones_as_int8_rows(tmp_path):
    """A llama-architecture GGUF laid out as llama.cpp's Q4_K_M lays out the default model (random blocks): q/k/v
    mixing Q5_0 and Q8_0, gate and up Q4_K, down Q6_K, the output projection Q4_K, the head Q6_K. Each 4-bit matrix
    reads back through the int4 kernel as its blocks decode by hand (rotary rows unpermuted as the loader does), to
    float32 rounding; each other one within half an int8 step of them."""
    import gguf

    from minillm.model.gguf import unpermute_rope
    from minillm.speed.kquants import KQUANT_BLOCK, dequantize_kquant
    from minillm.speed.quant_gguf import use_gguf_weights

    config = ModelConfig(vocab_size=96, context_length=64, n_layer=1, n_head=4, n_kv_head=2, d_model=256, d_ff=512,
                         norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, qkv_bias=False,
                         tie_embeddings=False)
    model = init_weights(Transformer(config), seed=0).eval()
    layout = {"attn_q": ("Q5_0", 256, 256), "attn_k": ("Q5_0", 128, 256), "attn_v": ("Q8_0", 128, 256),
              "attn_output": ("Q4_K", 256, 256), "ffn_gate": ("Q4_K", 512, 256), "ffn_up": ("Q4_K", 512, 256),
              "ffn_down": ("Q6_K", 256, 512)}
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    stored = {}
    for i, (name, (kind, n, k)) in enumerate([*layout.items(), ("output", ("Q6_K", 96, 256))]):
        weights, size = KQUANT_BLOCK.get(kind, (32, BLOCK_BYTES.get(kind)))
        if kind == "Q8_0":
            data = encode_blocks(np.random.default_rng(i).standard_normal((n, k)).astype(np.float32), "Q8_0")
        else:
            data = random_blocks(kind, rows=n, blocks=k // weights, seed=i)
        tensor = name if name == "output" else f"blk.0.{name}"
        writer.add_tensor(f"{tensor}.weight", data, raw_shape=data.shape, raw_dtype=getattr(gguf.GGMLQuantizationType,
                                                                                             kind))
        heads = {"attn_q": 4, "attn_k": 2}.get(name)
        rows = unpermute_rope(data, heads) if heads else data
        stored[name] = dequantize_kquant(rows, kind) if kind in KQUANT_BLOCK else dequantize_blocks(rows, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    native = use_gguf_weights(copy.deepcopy(model), tmp_path / "tiny.gguf", compute_dtype=torch.float32)
    expected = {"blocks.0.attn.qkv": np.concatenate([stored["attn_q"], stored["attn_k"], stored["attn_v"]]),
                "blocks.0.attn.proj": stored["attn_output"], "blocks.0.mlp.fc": np.concatenate(
                    [stored["ffn_gate"], stored["ffn_up"]]), "blocks.0.mlp.proj": stored["ffn_down"],
                "lm_head": stored["output"]}
    for name, weight in expected.items():
        linear, weight = native.get_submodule(name), torch.from_numpy(weight)
        four_bit = name in ("blocks.0.attn.proj", "blocks.0.mlp.fc")
        assert type(linear).__name__ == ("Int4WeightLinear" if four_bit else "Int8WeightLinear"), name
        if four_bit:  # code for code: (q − 8)·scale + zero rounds apart from scale·q + offset, by float32 ulps
            torch.testing.assert_close(linear.dequantized_weight(), weight, rtol=1e-6, atol=1e-5)
        else:
            step = weight.abs().amax(1, keepdim=True) / 127
            assert ((linear.dequantized_weight() - weight).abs() <= step * (0.5 + 1e-5)).all(), name


@pytest.mark.slow
def test_gemma3_270m_runs_its_q4_k_m_file_natively():
    """Gemma 3 270M's own file: its Q4_K matrices (the attention outputs) run on the int4 kernel code for code, the
    Q5_0 / Q6_K / Q8_0 ones on int8 rows; its rotary rows are not permuted (llama.cpp permutes llama's only)."""
    from minillm import load_model
    from minillm.model.gguf import read_gguf
    from minillm.speed.kquants import dequantize_kquant
    from minillm.speed.quant_gguf import gguf_path_for, use_gguf_weights

    model, _ = load_model("gemma3-270m", dtype="float32", fast=False)
    path = gguf_path_for("gemma3-270m")
    native = use_gguf_weights(copy.deepcopy(model), path, compute_dtype=torch.float32)
    tensors = {t.name: t for t in read_gguf(path)[0].tensors}
    parts = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.proj": ("attn_output",),
             "mlp.fc": ("ffn_gate", "ffn_up"), "mlp.proj": ("ffn_down",)}
    for i in range(model.config.n_layer):
        for module, names in parts.items():
            stored_kinds = {tensors[f"blk.{i}.{name}.weight"].tensor_type.name for name in names}
            four_bit = stored_kinds <= {"Q4_K"}
            assert type(native.get_submodule(f"blocks.{i}.{module}")).__name__ == \
                ("Int4WeightLinear" if four_bit else "Int8WeightLinear"), (i, module, stored_kinds)
    assert type(native.lm_head).__name__ == "Int8WeightLinear"
    stored = torch.from_numpy(dequantize_kquant(np.asarray(tensors["blk.3.attn_output.weight"].data), "Q4_K"))
    torch.testing.assert_close(native.blocks[3].attn.proj.dequantized_weight(), stored, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.blocks[3].attn.proj.weight, stored, rtol=0, atol=0)  # the loader's own reading
