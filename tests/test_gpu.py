"""The runner's steps prepared in the process (what a GPU runs, captured as CUDA graphs) and the GPU path itself.

The CPU checks run everywhere; the `gpu` ones run where CUDA is and are skipped with a reason elsewhere
(CI has no GPU: run `python -m pytest -m gpu` on one, `../shared/gpu/README.md` says how).
"""

from __future__ import annotations

import pytest
import torch

from minillm.model.tiny import tiny_pair
from minillm.runtime.session import DecodeSession
from minillm.speed.compile import compile_model
from minillm.speed.step_shapes import StepShape
from minillm.strategies.generate import generate

PROMPT = [5, 17, 90, 3, 42, 8, 61]  # ids below the tiny models' vocabulary of 96


def greedy_logits(model, steps: int = 12):
    """Greedy decode through a fixed-shape session over `model`: the logits [steps + 1, V] it chose from."""
    session = DecodeSession(model, "static", StepShape.decode(model.config, 1, None).cache_len, 1, fixed_shape=True)
    logits = [session.prefill([PROMPT])[0]]
    for _ in range(steps):
        logits.append(session.extend([[int(logits[-1].argmax())]])[0, -1])
    return torch.stack(logits), session


@pytest.mark.slow  # it compiles: out of the quick subset, as every compiling check is
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_prepared_in_the_process_decode_like_eager_and_never_compile_in_the_loop(device):
    """prepare() compiles (and on a GPU captures) the decode step before the first token; the run then
    compiles nothing more, and its logits are eager's (FP32: the same math, fused)."""
    model = tiny_pair("llama")[1].to(device)
    compiled = compile_model(model)  # in the process, not kept
    expected, _ = greedy_logits(model)
    session = DecodeSession(compiled, "static", StepShape.decode(model.config, 1, None).cache_len, 1,
                            fixed_shape=True)
    compiled.prepare([StepShape.decode(model.config, 1, None)], session)
    graphs = compiled.graphs
    assert graphs >= 1
    logits = [session.prefill([PROMPT])[0]]
    for _ in range(12):
        logits.append(session.extend([[int(logits[-1].argmax())]])[0, -1])
    assert compiled.graphs == graphs, "a step compiled inside the decode loop"
    torch.testing.assert_close(torch.stack(logits), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # it compiles
def test_generate_through_a_twin_compiled_in_the_process_sizes_its_cache_as_a_gpu_does():
    """A twin compiled in this process (a GPU's way; the decode suite's cuBLAS contender passes one) is given a
    cache of its own fixed length on a CPU too, not the kept packages' any-length one: 300 tokens (a 512-key
    cache, past the any-length graphs' hint) decode eager's tokens."""
    model = tiny_pair("llama", context_length=512)[1]
    eager = generate(model, [PROMPT], max_new_tokens=300).token_ids
    assert generate(compile_model(model), [PROMPT], max_new_tokens=300, compile=True).token_ids == eager


def test_preparing_in_the_process_needs_the_session_it_compiles_over():
    compiled = compile_model(tiny_pair("llama")[1])
    with pytest.raises(ValueError, match="pass the fixed-shape DecodeSession"):
        compiled.prepare([StepShape.decode(compiled.config, 1, None)])


def cuda_launches(fn) -> dict[str, int]:
    """How many times `fn` asks the driver to launch: single kernels and CUDA graphs, counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # CUDA: the driver calls
        fn()
        torch.cuda.synchronize()
    counts = {"kernels": 0, "graphs": 0}
    for event in prof.events():  # runtime and driver API names, with their per-stream variants (_ptsz)
        if event.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            counts["kernels"] += 1
        elif event.name.startswith(("cudaGraphLaunch", "cuGraphLaunch")):
            counts["graphs"] += 1
    return counts


@pytest.mark.real_model  # loads the default model itself: marked by hand
@pytest.mark.gpu
def test_a_captured_decode_step_is_one_graph_launch_where_eager_launches_hundreds():
    """The reason for capturing: eager PyTorch launches every op's kernel from Python, one by one; the
    captured step replays them all with one cudaGraphLaunch."""
    from minillm import load_model
    from minillm.decoding.sampling import SamplingConfig
    from minillm.runtime.runner import ModelRunner
    from minillm.runtime.sequence import Sequence

    model, _ = load_model("default", dtype="float32", device="cuda")
    counts = {}
    for graph in ("eager", "compiled"):
        runner = ModelRunner(model, graph=graph, max_len=64)
        seq = Sequence.create(PROMPT, SamplingConfig(max_new_tokens=1), vocab_size=model.config.vocab_size,
                              device="cuda")
        runner.prefill([seq])
        seq.tokens.append(1)
        runner.decode([seq])  # warm
        runner.rollback([seq])
        counts[graph] = cuda_launches(lambda: runner.decode([seq]))
    print(counts)
    assert counts["compiled"]["graphs"] == 1
    assert counts["eager"]["kernels"] > 10 * (counts["compiled"]["kernels"] + 1)


@pytest.mark.real_model  # loads the default model itself: marked by hand
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_captured_path_on_a_gpu_gives_eagers_tokens_and_fp32_gives_transformers(dtype):
    """On the real model: greedy through the captured step equals eager greedy (BF16: at least the first 16
    tokens, where reduced-precision sums may part later), a second run (a new cache, the graph recorded
    again) repeats the first, and FP32 eager equals transformers on the GPU."""
    from transformers import AutoModelForCausalLM

    from minillm import load_model
    from minillm.model.loading import resolve_checkpoint_folder

    model, tokenizer = load_model("default", dtype=dtype, device="cuda")
    prompt = tokenizer.encode("The three primary colors of light are")
    eager = generate(model, [prompt], max_new_tokens=32, compile=False).token_ids[0]
    captured = generate(model, [prompt], max_new_tokens=32, compile=True).token_ids[0]
    again = generate(model, [prompt], max_new_tokens=32, compile=True).token_ids[0]  # recorded over a new cache
    same = 32 if dtype == "float32" else 16
    assert captured[:same] == eager[:same] and again == captured
    if dtype == "float32":
        hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint_folder("default"), dtype=torch.float32)
        hf = hf.to("cuda").eval()
        hf.generation_config.eos_token_id = None
        ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False)
        assert eager == ids[0, len(prompt):].tolist()


def test_building_ahead_for_a_gpu_is_refused_in_one_line_saying_what_runs_there(monkeypatch, capsys):
    """`python -m minillm.compile` keeps CPU packages; on a GPU (simulated: one present) nothing is kept, and the
    refusal names the command that records the graph in the run, before the checkpoint is located."""
    import importlib

    def located(*args, **kwargs):
        raise AssertionError("the checkpoint was located: the refusal came too late")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("minillm.model.loading.resolve_checkpoint_folder", located)
    assert importlib.import_module("minillm.compile").main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing is kept for a GPU" in err and "--device cuda --compile" in err, err


# ------------------------------------------------------------------ quantized on a GPU (lesson 14's modules there)


def linear_576x1536(device):
    gen = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(1536, 576, bias=False)
    linear.weight.data = torch.randn(576, 1536, generator=gen) * 0.05
    return linear.to(device)


def relative_error(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.gpu
def test_quantized_linears_on_a_gpu_hold_the_cpus_weights_and_multiply_like_them():
    """Made on a GPU, int8 keeps the CPU's codes and scales, and int4 packs the same codes into tinygemm's layout:
    read back through the kernel (x = I) it gives the CPU kernel's float32 weight rounded to bfloat16 (the GPU
    kernel's one precision); each product is within bfloat16's bound of its dequantized reference (test_14's)."""
    from minillm.speed.quant import Int4WeightLinear, Int8WeightLinear, quantize_int4_groupwise

    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    cpu8, gpu8 = (Int8WeightLinear.from_linear(linear_576x1536(d)) for d in ("cpu", "cuda"))
    assert torch.equal(gpu8.weight_int8.cpu(), cpu8.weight_int8)
    assert relative_error(gpu8(x.cuda()).cpu(), x.float() @ gpu8.dequantized_weight().cpu().t()) < 2e-2
    q, scale, zero = quantize_int4_groupwise(linear_576x1536("cpu").weight, 32)
    cpu4 = Int4WeightLinear(q, scale, zero, compute_dtype=torch.float32)
    gpu4 = Int4WeightLinear(q.cuda(), scale.cuda(), zero.cuda())
    exact = cpu4.dequantized_weight()
    assert ((gpu4.dequantized_weight().cpu() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    assert relative_error(gpu4(x.cuda()).cpu(), x.float() @ exact.t()) < 2e-2


@pytest.mark.real_model  # loads the default model itself: marked by hand
@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["int8", "gguf"])
def test_the_quantized_model_on_a_gpu_scores_like_the_cpus_and_its_captured_step_decodes_like_eager(quant):
    """`--quant int8|gguf --device cuda`: the first step's logits within bfloat16's bound of the CPU's quantized
    model (the same codes), and greedy through the captured step equal to eager for 16 tokens (BF16 products)."""
    from minillm import load_model

    gpu, tokenizer = load_model("default", device="cuda", quant=quant)
    cpu, _ = load_model("default", device="cpu", quant=quant)
    prompt = tokenizer.encode("The three primary colors of light are")
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad():
        expected = cpu(torch.tensor([prompt]), positions)[0, -1]
        got = gpu(torch.tensor([prompt], device="cuda"), positions.cuda())[0, -1].cpu()
    assert relative_error(got, expected) < 2e-2
    eager = generate(gpu, [prompt], max_new_tokens=16, compile=False).token_ids[0]
    assert generate(gpu, [prompt], max_new_tokens=16, compile=True).token_ids[0] == eager


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [False, True])
def test_a_one_row_matmul_compiled_for_a_gpu_is_a_generated_reduction_not_a_cublas_call(quantized):
    """Under the GPU's "generated" settings a one-row matmul is Inductor's own kernel (no extern mm), so it can
    fuse with its neighbours, int8's widening included; it gives the eager product."""
    from torch._inductor.utils import run_and_get_code

    from minillm.speed.inductor import inductor_settings
    from minillm.speed.quant import Int8WeightLinear

    linear = linear_576x1536("cuda").requires_grad_(False)
    module = Int8WeightLinear.from_linear(linear) if quantized else linear.to(torch.bfloat16)
    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_settings("generated", "cuda"):
        out, code = run_and_get_code(torch.compile(module, fullgraph=True, dynamic=False), x)
    source = "\n".join(code)
    assert "extern_kernels.mm" not in source and "extern_kernels.addmm" not in source, source
    with torch.no_grad():
        assert relative_error(out, module(x)) < 2e-2


@pytest.mark.real_model  # loads the default model itself: marked by hand
@pytest.mark.gpu
def test_the_profiler_counts_a_captured_steps_kernels():
    """The decode suite's kernel count: hundreds of kernels in one captured step of the default model, the GPU
    busy for less than the step's wall time."""
    from minillm import load_model
    from minillm.bench.kernels import captured_kernels

    model, tokenizer = load_model("default", device="cuda")
    counted = captured_kernels(model, tokenizer.encode("The three primary colors of light are"))
    print(counted)
    assert counted["kernels"] >= 100 and 0 < counted["kernel_us"] < counted["step_us"]
    assert sum(count for _, count, _ in counted["longest"]) <= counted["kernels"]


@pytest.mark.slow  # it compiles
def test_counting_a_steps_kernels_on_a_cpu_times_the_step_and_counts_none():
    """Off a GPU the same profile runs (the runner's compiled step, in this process) and finds no device kernels."""
    from minillm.bench.kernels import captured_kernels

    counted = captured_kernels(compile_model(tiny_pair("llama")[1]), PROMPT)
    assert (counted["kernels"], counted["copies"], counted["kernel_us"], counted["longest"]) == (0, 0, 0, [])
    assert counted["step_us"] > 0


# ------------------------------------------------------------------ the engine's step, bucketed (a GPU's server)


def test_buckets_double_from_two_and_a_step_beyond_the_largest_is_refused():
    from minillm.speed.paged_buckets import bucket, buckets_up_to

    assert buckets_up_to(16) == [2, 4, 8, 16] and buckets_up_to(17) == [2, 4, 8, 16, 32] and buckets_up_to(1) == [2]
    assert [bucket(n, [2, 4, 8]) for n in (1, 2, 3, 8)] == [2, 2, 4, 8]
    with pytest.raises(ValueError, match="exceeds the largest bucket recorded"):
        bucket(9, [2, 4, 8])


def test_every_bucket_is_recorded_before_serving_largest_first_over_the_scratch_block_alone():
    """What a GPU records at start: one recording per (rows, blocks) bucket, the largest first, each over inputs
    that touch only the scratch block (a recording's writes must land where no sequence reads)."""
    from minillm.speed.paged_buckets import BucketedPagedStep

    pool = [torch.zeros(13, 4, 2, 8)]
    made = []

    def record(step, inputs, keys, values):
        made.append(inputs)
        return step

    step = BucketedPagedStep("the step", pool, pool, scratch_block=12, block_size=4, most_rows=3, most_blocks=5,
                             record=record)
    step.record_all(progress=False)
    assert [tuple(inputs[3].shape) for inputs in made] == [(4, 8), (4, 4), (4, 2), (2, 8), (2, 4), (2, 2)]
    for tokens, positions, slots, tables in made:
        assert not tokens.any() and not positions.any()
        assert (slots == 12 * 4).all() and (tables == 12).all()
    assert set(step.recorded.values()) == {"the step"}


def test_a_bucketed_paged_step_keeps_the_real_rows_and_writes_its_padding_to_the_scratch_block():
    """Three rows over at most 3 blocks padded to a bucket of 4 rows and 4 blocks: the real rows' logits and every
    block the block manager owns are the engine's eager step's; only the scratch block (one past the pool) was
    written."""
    from minillm.cache.paged import PackedSequences
    from minillm.runtime.runner import ModelRunner
    from minillm.speed.paged_buckets import BucketedPagedStep
    from minillm.speed.step_shapes import PagedShape

    _, model = tiny_pair("llama", context_length=256)
    runner = ModelRunner(model, cache="paged", graph="eager", num_blocks=12, block_size=4)
    tables = [[3, 7, 1], [0, 5, 9], [2, 4]]
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [23, 24, 25, 26, 27]]
    with torch.inference_mode():
        packed = PackedSequences.build(tables, [0, 0, 0], [6, 9, 5], 4)
        runner.step(packed, torch.tensor(sum(prompts, [])), packed.last_tokens)
        keys, values = ([torch.cat((pool, torch.zeros_like(pool[:1]))) for pool in pools]  # + the scratch block
                        for pools in runner.cache.block_pools())
        before = [pool[12].clone() for pool in keys]
        packed = PackedSequences.build(tables, [6, 9, 5], [1, 1, 1], 4)
        tokens = torch.tensor([21, 22, 28])
        expected = runner.step(packed, tokens, packed.last_tokens)
        step = BucketedPagedStep(PagedShape(4).module(compile_model(model).step_module), keys, values,
                                 scratch_block=12, block_size=4, most_rows=3, most_blocks=5)
        got = step(tokens[:, None], packed.positions[:, None], packed.slots, packed.decode_blocks, keys, values)
    assert got.shape[0] == 3 and set(step.recorded) == {(4, 4)}
    torch.testing.assert_close(got[:, 0], expected, rtol=1e-5, atol=1e-5)
    for mine, engine in zip(keys + values, sum(map(list, runner.cache.block_pools()), [])):
        torch.testing.assert_close(mine[:12], engine, rtol=1e-6, atol=1e-6)
    assert any(not torch.equal(pool[12], old) for pool, old in zip(keys, before))


@pytest.mark.slow  # it compiles
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_compiled_in_the_process_decodes_the_eager_tokens(device):
    """A GPU's server path: the engine's step compiled once in the process (sizes symbolic), padded to buckets and,
    on a GPU, captured per bucket before the first request; one request and three, keys in one block and many,
    greedy and sampled: the eager engine's tokens, and a second engine compiles nothing more. On a CPU the same, run
    without recording."""
    from minillm.decoding.sampling import SamplingConfig
    from minillm.runtime.continuous import generate_continuous

    model = tiny_pair("llama", context_length=256)[1].to(device)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2, 3, 7, 3]]
    configs = [SamplingConfig(max_new_tokens=n, do_sample=i == 1, seed=i, temperature=0.8)
               for i, n in enumerate((30, 20, 9, 16))]
    options = {"block_size": 4, "num_blocks": 64, "max_num_seqs": 3}
    eager = generate_continuous(model, prompts, configs, arrivals=[0, 2, 2, 12],
                                engine_options={**options, "graph": "eager"})
    twin = compile_model(model)
    runs = [generate_continuous(twin, prompts, configs, arrivals=[0, 2, 2, 12],
                                engine_options={**options, "graph": "compiled"}) for _ in range(2)]
    for compiled in runs:  # the second engine records its own pool, from the kernels the first compiled
        assert compiled.token_ids == eager.token_ids
        assert compiled.stats.extra["compiled_steps"] == compiled.stats.forward_passes - 3
    assert twin.graphs <= 2  # compiled once (a first attempt that dynamo restarts reaches the backend too)


def test_a_captured_steps_time_is_predicted_from_its_kernel_count_a_probed_floor_and_its_bytes():
    """The decode suite's prediction, from constants alone: 240 kernels at 4 µs each and 538 MB at 4 TB/s are
    0.96 + 0.1345 ms in series, the kernels 88% of it; the profiled durations play no part."""
    from minillm.bench.kernels import predicted_step

    counted = {"kernels": 240, "copies": 3, "kernel_us": 1e9, "step_us": 1e9, "longest": []}
    predicted = predicted_step(counted, 4e-6, 538_000_000, 4e12)
    assert predicted["predicted_ms"] == pytest.approx(0.96 + 0.1345)
    assert predicted["predicted_launch_share"] == pytest.approx(0.96 / 1.0945)
    assert predicted["floor_us"] == pytest.approx(4.0) and predicted["kernels"] == 240


def test_a_count_that_fails_is_reported_in_one_line_and_leaves_the_suite_running():
    from minillm.bench.kernels import counted_and_predicted

    counted = counted_and_predicted(object(), PROMPT, 4e-6, 1, 1.0)  # no model: the runner cannot be made
    assert set(counted) == {"error"} and counted["error"].startswith("AttributeError") and "\n" not in counted["error"]


@pytest.mark.gpu
def test_the_floor_a_kernel_pays_inside_a_cuda_graph_is_microseconds():
    from minillm.costmodel.probes import measure_graph_kernel_seconds

    floor = measure_graph_kernel_seconds()
    print(f"{floor * 1e6:.2f} µs a kernel")
    assert 1e-7 < floor < 5e-5
