"""Lesson 15: a compiled decode step over a fixed-shape cache, and the model as two ONNX graphs.

References: the eager model through the same decode session (compiled logits within
float32 tolerance, greedy tokens identical), the compiler's own count of the graphs
it built (no recompilation across decode steps and prompt lengths), and `generate`
(the onnxruntime runner's greedy tokens and streamed text identical).

Compiling is slow on a small CPU, so each tiny model is compiled once per module
(Inductor also caches compiled graphs on disk, so later runs are quicker). The checks
on the real default model compile it and export it, several minutes on 2 cores: they
run when MINILLM_SLOW_TESTS=1 is set.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from minillm.decoding.sampling import SamplingConfig
from minillm.model.tiny import tiny_pair
from minillm.runtime.runner import ModelRunner
from minillm.runtime.sequence import Sequence
from minillm.runtime.session import DecodeSession, Tree
from minillm.speed.compile import CompiledModel, compile_model
from minillm.speed.export import export_onnx
from minillm.speed.inductor import MATMUL_KERNELS
from minillm.speed.onnx_model import ExportError, OnnxModel
from minillm.speed.step_shapes import StepShape, any_length_cache, context_bucket
from minillm.strategies.drafters import PromptLookup
from minillm.strategies.generate import generate
from minillm.strategies.speculative import speculative_generate

SLOW = pytest.mark.skipif(not os.environ.get("MINILLM_SLOW_TESTS"),
                          reason="compiles and exports the real default model (minutes): set MINILLM_SLOW_TESTS=1")


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny Llama with room for 100+ decode steps, and its compiled twin (prefill chunks of 8)."""
    _, model = tiny_pair("llama", context_length=256)
    return model, CompiledModel(model, chunk=8)


def decode_logits(model, prompt: list[int], steps: int, fixed_shape: bool, max_len: int = 256) -> tuple:
    """Greedy decoding through a session: (tokens, logits [steps, V]) with the logits of every step."""
    session = DecodeSession(model, "static", max_len=max_len, fixed_shape=fixed_shape)
    with torch.inference_mode():
        logits = session.prefill([prompt])  # [1, V]
        tokens, rows = [], []
        for _ in range(steps):
            rows.append(logits[0])
            tokens.append(int(logits[0].argmax()))
            logits = session.extend([[tokens[-1]]])[:, -1]
    return tokens, torch.stack(rows)


# ------------------------------------------------------------------ compiled decode step


@pytest.mark.slow
def test_compiled_matches_eager_and_never_recompiles(tiny_llama):
    model, compiled = tiny_llama
    gen = torch.Generator().manual_seed(0)
    for prompt_length in (5, 21):  # one chunk, then three chunks with a padded last one
        prompt = torch.randint(0, model.config.vocab_size, (prompt_length,), generator=gen).tolist()
        expected_tokens, expected = decode_logits(model, prompt, 100, fixed_shape=False)
        graphs = compiled.graphs
        tokens, logits = decode_logits(compiled, prompt, 100, fixed_shape=True)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert tokens == expected_tokens
        if prompt_length == 5:
            assert compiled.graphs == 2  # one decode graph, one prefill-chunk graph
        else:
            assert compiled.graphs == graphs, "a new prompt length must not compile anything"
    assert compiled.eager_calls == 0 and compiled.compile_seconds > 0


@pytest.mark.slow
def test_compiled_verify_chunk_gives_every_positions_logits(tiny_llama):
    """T > 1 new tokens with logits at each (speculative verification) go through the chunk graph."""
    model, compiled = tiny_llama
    prompt, draft = [5, 6, 7, 8, 9, 10], [[11, 12, 13]]
    expected_session = DecodeSession(model, "static", max_len=256)
    session = DecodeSession(compiled, "static", max_len=256, fixed_shape=True)
    with torch.inference_mode():
        expected_session.prefill([prompt])
        session.prefill([prompt])
        torch.testing.assert_close(session.extend(draft), expected_session.extend(draft), rtol=1e-4, atol=1e-4)


def test_compiled_model_refuses_a_growing_cache(tiny_llama):
    _, compiled = tiny_llama
    with pytest.raises(ValueError, match="fixed-shape static cache"):
        DecodeSession(compiled, "dynamic").prefill([[1, 2, 3]])
    with pytest.raises(ValueError, match="static cache"):
        generate(tiny_llama[0], [1, 2], max_new_tokens=2, cache="dynamic", compile=True)


def test_matmul_kernels_follow_the_model_and_the_rows():
    """Tiny models keep the library's matmuls (a generated kernel would triple their compile time for nothing); a
    large model's one-row steps, float or quantized, get generated kernels; its steps over several rows (a batch, a
    verify chunk, the server's any-rows step) timed ones; an explicit choice holds for every shape, is checked, and
    is part of what a kept package's key holds."""
    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer
    from minillm.speed.inductor import GENERATED_MIN_ELEMENTS, matmul_kernels
    from minillm.speed.quantize_model import quantize_model
    from minillm.speed.step_shapes import PagedShape

    tiny = tiny_pair("llama")[1]
    large = Transformer(ModelConfig(vocab_size=4096, context_length=64, n_layer=1, n_head=4, d_model=256))
    quantized = quantize_model(copy.deepcopy(large), "int8")
    assert sum(p.numel() for p in large.parameters()) >= GENERATED_MIN_ELEMENTS
    one_row, batch, verify = (StepShape.decode(large.config, 1, 64), StepShape.decode(large.config, 4, 64),
                              StepShape.verify(large.config, 1, 5, 64))
    assert (one_row.rows, batch.rows, verify.rows, PagedShape(16).rows) == (1, 4, 5, None)
    assert {matmul_kernels(tiny, rows) for rows in (1, 8, None)} == {"library"}
    assert matmul_kernels(large) == matmul_kernels(quantized) == "generated"
    # several rows timed; any number (the server's step): a float32 model's by oneDNN on packed weights
    assert matmul_kernels(large, 4) == "timed" and matmul_kernels(large, None) == "onednn"
    assert {matmul_kernels(quantized, rows) for rows in (4, None)} == {"timed"}
    with mock.patch.object(torch.backends.mkldnn, "is_available", return_value=False):
        assert matmul_kernels(large, None) == "timed"
    # int4 weights: Inductor generates their kernel only with AVX-512; on an AVX2 CPU the library's call is timed too
    int4 = quantize_model(copy.deepcopy(large), "int4")
    for capability, kernels in (("AVX512", "generated"), ("AVX2", "timed")):
        with mock.patch.object(torch.backends.cpu, "get_cpu_capability", return_value=capability):
            assert (matmul_kernels(int4), matmul_kernels(quantized)) == (kernels, "generated")
    compiled = CompiledModel(large, kept=True)
    assert compiled.settings_for(one_row) == {"matmuls": "generated"}
    assert all(compiled.settings_for(shape) == {"matmuls": "timed"} for shape in (batch, verify))
    assert compiled.settings_for(PagedShape(16)) == {"matmuls": "onednn"}
    assert CompiledModel(tiny, kept=True).settings_for(PagedShape(16)) == {"matmuls": "library"}
    assert CompiledModel(large, matmuls="library", kept=True).settings_for(batch) == {"matmuls": "library"}
    assert CompiledModel(tiny, matmuls="timed", kept=True).settings_for(one_row) == {"matmuls": "timed"}
    with pytest.raises(ValueError, match="matmuls='fast': choose one of library, generated, timed, onednn"):
        CompiledModel(large, matmuls="fast")
    assert compile_model(tiny, kept=True) is compile_model(tiny, kept=True)


def test_on_a_gpu_one_row_matmuls_are_generated_as_reductions_and_more_rows_stay_cublas():
    """On a GPU (the model's device faked: settings only) a large model's one-row matmuls are "generated", which
    there means Inductor's reductions tuned by coordinate descent (no GEMM templates to time), and every step over
    more rows keeps cuBLAS; a tiny model keeps the library's everywhere."""
    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer
    from minillm.speed.inductor import inductor_settings, matmul_kernels

    large = Transformer(ModelConfig(vocab_size=4096, context_length=64, n_layer=1, n_head=4, d_model=256))
    with mock.patch.object(Transformer, "device", torch.device("cuda")):
        assert [matmul_kernels(large, rows) for rows in (1, 4, None)] == ["generated", "library", "library"]
        assert matmul_kernels(tiny_pair("llama")[1], 1) == "library"
    from torch._inductor import config

    with inductor_settings("generated", "cuda"):
        assert config.coordinate_descent_tuning and not config.max_autotune and config.freezing
    with inductor_settings("generated", "cpu"):
        assert config.max_autotune and not config.coordinate_descent_tuning
    assert not config.coordinate_descent_tuning


@pytest.mark.slow
@pytest.mark.parametrize("matmuls", MATMUL_KERNELS)
def test_each_choice_of_matmul_kernels_runs_what_it_names(matmuls):
    """One linear of a million weights compiled at one row: the library's call (an extern mm) for "library", a
    kernel written for the shape (Inductor's C++ GEMM template) for "generated", for "timed" whichever won, and
    for "onednn" (the linear as a kept step traces it) the call of oneDNN's product on the packed weight; each
    gives the eager product."""
    from torch._inductor.utils import run_and_get_code

    from minillm.speed.inductor import inductor_settings
    from minillm.speed.onednn import linears_call_onednn

    linear = torch.nn.Linear(1024, 1024, bias=False).requires_grad_(False).eval()
    if matmuls == "onednn":
        linear = linears_call_onednn(torch.nn.Sequential(linear))[0]
    x = torch.randn(1, 1024)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_settings(matmuls, "cpu"):
        out, code = run_and_get_code(torch.compile(linear, fullgraph=True, dynamic=False), x)
    source = "\n".join(code)
    library = any(call in source for call in ("_mkl_linear", "mm_out", "extern_kernels.mm"))  # MKL's, frozen or not
    generated = "micro_gemm" in source  # the template's kernel, built around a micro-kernel for this CPU
    assert ("onednn_linear" in source) is (matmuls == "onednn")
    assert {"library": (True, False), "generated": (False, True), "onednn": (False, False)}.get(
        matmuls, (library, not library)) == (library, generated)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_the_float_matmul_kernel_asks_for_its_weight_rows_ahead_only_while_compiling():
    """Inside the compile settings Inductor's float micro-kernel prefetches the weight row `PREFETCH_ROWS` rows on,
    once, in its float load and nowhere else; outside them its text is Inductor's own."""
    import torch._inductor.select_algorithm  # noqa: F401  (imported before the template modules, as torch does)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    from minillm.speed.inductor import PREFETCH_ROWS, WEIGHT_ROW_LOAD, inductor_settings

    own = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    assert own.count(WEIGHT_ROW_LOAD) == 1  # the pinned torch's text, as the patch expects it
    with inductor_settings("generated", "cpu"):
        patched = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    prefetch = f"_mm_prefetch(reinterpret_cast<const char*>(B + (k + {PREFETCH_ROWS}) * ldb + col * VLEN), _MM_HINT_T0);"
    assert patched.count(prefetch) == 1 and patched.replace(prefetch, "").split() == own.split()
    assert patched.index(prefetch) < patched.index("vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);")
    assert CppMicroGemmFP32Vec.TEMPLATE_KERNEL is own


@pytest.mark.slow
def test_a_generated_matmul_over_eight_rows_prefetches_and_gives_the_eager_product():
    """A verify step's case: a million-weight linear over 8 rows through the generated kernel, which asks for its
    weight rows ahead (`weights_prefetched`) and still computes the eager product."""
    from torch._inductor.utils import run_and_get_code

    from minillm.speed.inductor import PREFETCH_ROWS, inductor_settings

    linear = torch.nn.Linear(1024, 1024, bias=False).requires_grad_(False).eval()
    x = torch.randn(8, 1024)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_settings("generated", "cpu"):
        out, code = run_and_get_code(torch.compile(linear, fullgraph=True, dynamic=False), x)
    assert f"B + (k + {PREFETCH_ROWS}) * ldb" in "\n".join(code)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_the_template_index_texts_are_parsed_once_to_the_same_expressions():
    """Inside the compile settings the matmul template's index parser is the kept one: each distinct text is parsed by
    Inductor's own parser once, and every answer (texts, numbers, lists of them, expressions passed through) equals
    what Inductor's parser gives."""
    import sympy
    import torch._inductor.select_algorithm  # noqa: F401  (imported before the template kernel's module, as torch does)
    from torch._inductor.codegen import cpp_template_kernel

    from minillm.speed.inductor import index_texts_parsed_once

    original = cpp_template_kernel.parse_expr_with_index_symbols
    texts = ["m_start", "n_end - n_start", "m_start + 32*k", "m_start", 16, ["n_start", "n_end - n_start"]]
    expected = [original(t) for t in texts]
    m = sympy.Symbol("m_start", integer=True)
    parses = []

    def counted(expression):
        parses.append(expression)
        return original(expression)

    with mock.patch.object(cpp_template_kernel, "parse_expr_with_index_symbols", counted), index_texts_parsed_once():
        kept = cpp_template_kernel.parse_expr_with_index_symbols
        assert kept is not counted
        assert [kept(t) for t in texts] == expected and [kept(t) for t in texts] == expected
        assert kept(m) is m
    assert sorted(map(str, parses)) == ["16", "m_start", "m_start + 32*k", "n_end - n_start", "n_start"]
    assert cpp_template_kernel.parse_expr_with_index_symbols is original


def test_a_verify_picks_the_shortest_kept_verify_step_beside_the_servers_paged_one(tiny_llama):
    """A process that ran the server keeps the engine's paged step among its packages: a verify passes over it (it
    broke lookahead in a test worker that had served first) and pads to the shortest verify step that holds it."""
    from minillm.speed.step_shapes import PagedShape

    compiled = CompiledModel(tiny_llama[0], kept=True)
    compiled.packages = {PagedShape(16): None, StepShape(1, 9, None, 9): None, StepShape(1, 5, 64, 5): None,
                         StepShape(1, 1, None, 1): None}
    assert [compiled.verify_length(1, t, 64) for t in (3, 5, 6, 9, 10)] == [5, 5, 9, 9, compiled.chunk]
    assert compiled.verify_length(1, 3, 32) == 9  # the one kept for any cache length
    compiled.packages = {PagedShape(16): None}
    assert compiled.verify_length(1, 3, 64) == compiled.chunk


def test_context_buckets_are_few_and_hold_the_run():
    assert [context_bucket(n, 8192) for n in (1, 200, 256, 257, 3000)] == [256, 256, 256, 512, 4096]
    assert context_bucket(500, 300) == 300  # never past the model's context


def test_a_step_for_any_length_allocates_the_run_rounded_to_a_chunk():
    """A kept package serves every cache length: the run allocates its own length, rounded up to the prefill chunk
    (64) so a padded chunk fits, never past the context; the exported program keeps that length symbolic."""
    assert [any_length_cache(n, 8192) for n in (1, 64, 65, 962)] == [64, 64, 128, 1024]
    assert any_length_cache(8090, 8100) == 8100
    shape = StepShape(1, 1, 256, 1).any_length()
    assert shape.cache_len is None and shape.name == "decode-b1-t1-sany"
    config = tiny_pair("llama", context_length=256)[1].config
    dims = shape.dynamic_shapes(config)
    assert dims[3] == {2: dims[5][0][2]} and len(dims[5]) == len(dims[6]) == config.n_layer  # mask, keys, values
    assert StepShape(1, 1, 256, 1).dynamic_shapes(config) is None


def test_a_prompt_over_a_compiled_runs_cache_attends_over_the_written_columns_alone():
    """A prompt no graph was prepared for runs eagerly over the compiled run's fixed-shape cache: rows alike, it
    attends causally over the columns written (`StaticCache.columns_in_use`), not over all of them behind a mask,
    with the logits and cache of the masked way."""
    from minillm.cache.kv_cache import StaticCache

    _, model = tiny_pair("llama", context_length=256)
    compiled = compile_model(model, kept=True)
    compiled.only_prepared = True  # nothing prepared: every forward runs eagerly
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    positions = torch.arange(8)[None]
    cache = StaticCache.for_model(model, 1, 256, fixed_shape=True)
    spans = []
    key_span = cache.key_span
    with mock.patch.object(cache, "key_span", lambda new: spans.append(key_span(new)) or spans[-1]):
        logits = compiled(tokens, positions, cache=cache)
    masked_cache = StaticCache.for_model(model, 1, 256, fixed_shape=True)
    mask = torch.arange(256) <= torch.arange(8)[None, :, None]
    masked = model(tokens, positions, cache=masked_cache, mask=mask)
    assert set(spans) == {8} and cache.fixed_shape and cache.lengths == [8]
    torch.testing.assert_close(logits, masked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.k, masked_cache.k)


def test_the_eager_hint_names_the_exact_build_command():
    from minillm.compile import compile_command
    from minillm.infer import build_parser

    args = build_parser().parse_args(["--prompt", "a", "--quant", "gguf", "--dtype", "bfloat16"])
    assert compile_command(args, 1, None) == "python -m minillm.compile --dtype bfloat16 --quant gguf"
    args = build_parser().parse_args(["--prompt", "a", "--model", "my model.gguf"])
    assert compile_command(args, 3, 4) == ("python -m minillm.compile --model 'my model.gguf' --batch-size 3 "
                                           "--verify-tokens 5")


def test_cli_compile_flag_is_documented_and_checked():
    from minillm.infer import main

    result = subprocess.run([sys.executable, "-m", "minillm", "--help"], capture_output=True, text=True, timeout=120)
    assert "--compile" in result.stdout
    assert main(["--prompt", "hi", "--compile", "--cache", "dynamic"]) == 2


# ------------------------------------------------------------------ ONNX export and the onnxruntime runner


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    _, model = tiny_pair("llama", context_length=256)
    folder = export_onnx(model, tmp_path_factory.mktemp("export") / "tiny", context=64, chunk=8)
    return model, folder


@pytest.mark.slow
def test_exported_graphs_have_the_promised_inputs_and_outputs(tiny_export):
    import onnx

    model, folder = tiny_export
    c = model.config
    assert sorted(p.name for p in folder.iterdir()) == ["decode.onnx", "manifest.json", "prefill.onnx",
                                                        "weights.data"]
    for name, tokens in (("prefill.onnx", 8), ("decode.onnx", 1)):
        graph = onnx.load(str(folder / name), load_external_data=False).graph
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*graph.input, *graph.output)}
        assert [v.name for v in graph.input][:2] == ["input_ids", "position_ids"]
        assert len(graph.input) == 2 + 2 * c.n_layer and len(graph.output) == 1 + 2 * c.n_layer
        assert shapes["input_ids"] == [1, tokens] and shapes["logits"] == [1, tokens, c.vocab_size]
        assert shapes["past_key.0"] == shapes["present_value.1"] == [1, c.kv_heads, 64, c.head_size]
        assert "mask" not in " ".join(v.name for v in graph.input)  # computed inside from the positions
    weights = (folder / "weights.data").stat().st_size
    assert weights < 1.2 * model.num_weight_bytes()  # both graphs read one copy


@pytest.mark.parametrize("prompt_length", [3, 8, 21])
def test_onnx_model_gives_generates_tokens_and_events(tiny_export, prompt_length):
    model, folder = tiny_export
    runner = OnnxModel(folder)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_length,),
                           generator=torch.Generator().manual_seed(prompt_length)).tolist()
    expected = generate(model, prompt, max_new_tokens=30)
    events = list(generate(runner, prompt, max_new_tokens=30, stream=True))
    assert [t for e in events for t in e.token_ids] == expected.token_ids[0]
    assert [e.finish_reason for e in events] == [None] * 29 + ["length"]
    logits, _ = runner.prefill(prompt)
    with torch.inference_mode():
        reference = model(torch.tensor([prompt]), torch.arange(prompt_length)[None])[0, -1]
    torch.testing.assert_close(torch.from_numpy(logits), reference, rtol=1e-4, atol=1e-4)


def test_onnx_model_stops_as_generate_does(tiny_export):
    model, folder = tiny_export
    prompt = [1, 2, 3, 4]
    expected = generate(model, prompt, max_new_tokens=20)
    tokens = expected.token_ids[0]
    eos = tokens[5]
    out = generate(OnnxModel(folder), prompt, max_new_tokens=20, eos_token_id=eos)
    assert out.rows[0].finish_reason == "eos" and out.token_ids[0] == tokens[: tokens.index(eos) + 1]


def test_onnx_model_runs_under_the_strategies_as_a_runner_backend(tiny_export):
    """The export is a model like any other to the runner: prompt lookup verifies chains of drafts through its
    decode graph and rolls rejected ones back (a shorter row), giving plain greedy's tokens and the PyTorch runner's
    logits; what the graphs cannot hold (a tree of drafts, two rows, a compiled or paged cache) is refused by name."""
    model, folder = tiny_export
    exported = OnnxModel(folder)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # repeats, so prompt lookup drafts
    expected = generate(model, prompt, max_new_tokens=24).token_ids[0]
    out = speculative_generate(exported, prompt, PromptLookup(), num_draft_tokens=4, max_new_tokens=24)
    assert out.token_ids[0] == expected
    assert out.stats.extra["drafted"] > 0
    # Verify a draft, forget it, decode: the same logits as the PyTorch model's runner doing the same
    runners = {"onnx": ModelRunner(exported, max_len=30), "eager": ModelRunner(model, max_len=30)}
    assert runners["onnx"].graph == "onnx"
    logits, seqs = {}, {}
    for name, runner in runners.items():
        seq = Sequence.create(prompt, SamplingConfig(max_new_tokens=4), vocab_size=exported.config.vocab_size)
        runner.prefill([seq])
        seq.append(3)
        verified = runner.verify([seq], [[40, 41, 42]])  # [1, 4, V]
        seq.append(44)  # every draft rejected, the target's own token instead
        runner.rollback([seq])  # the cache forgets the drafts: it holds the prompt and 3
        logits[name] = torch.cat((verified[0], runner.decode([seq])), 0)
        assert runner.held(seq) == prompt + [3, 44]
        seqs[name] = seq
    torch.testing.assert_close(logits["onnx"], logits["eager"], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="a chain of tokens, not a tree"):
        runners["onnx"].verify([seqs["onnx"]], [[1, 2]], Tree.from_parents([-1, 0, 0]))
    with pytest.raises(ValueError, match="exported for batch 1"):
        generate(exported, [prompt, prompt], max_new_tokens=2)
    for options in ({"compile": True}, {"cache": "dynamic"}):
        with pytest.raises(ValueError, match="its own graphs over its own static cache"):
            generate(exported, prompt, max_new_tokens=2, **options)


def test_onnx_model_refuses_what_the_export_cannot_run(tiny_export, tmp_path):
    _, folder = tiny_export
    runner = OnnxModel(folder)
    with pytest.raises(ValueError, match=r"exported graphs hold 64: export with --context 70"):
        generate(runner, list(range(40)), max_new_tokens=30)
    with pytest.raises(ExportError, match="no manifest.json"):
        OnnxModel(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in folder.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    (broken / "decode.onnx").unlink()
    with pytest.raises(ExportError, match="decode.onnx is missing: export again"):
        OnnxModel(broken)
    manifest = json.loads((folder / "manifest.json").read_text())
    (broken / "decode.onnx").write_bytes((folder / "decode.onnx").read_bytes())
    (broken / "manifest.json").write_text(json.dumps(manifest | {"export_id": "another"}))
    with pytest.raises(ExportError, match="comes from another export"):
        OnnxModel(broken)


@pytest.mark.slow
def test_export_cli_reports_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "minillm.export", "run", str(tmp_path), "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "not a minillm ONNX export" in result.stderr
    help_text = subprocess.run([sys.executable, "-m", "minillm.export", "onnx", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    for flag in ("--context", "--chunk", "--out", "--dtype"):
        assert flag in help_text


# ------------------------------------------------------------------ the real default model


@SLOW
def test_default_model_compiled_matches_eager(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    expected_tokens, expected = decode_logits(model, prompt, 40, fixed_shape=False)
    compiled = compile_model(model)
    tokens, logits = decode_logits(compiled, prompt, 40, fixed_shape=True)
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)
    assert tokenizer.decode(tokens) == tokenizer.decode(expected_tokens)


@SLOW
def test_default_model_onnx_matches_eager(default_model, tmp_path):
    model, tokenizer = default_model
    from minillm.model.loading import resolve_checkpoint_folder

    folder = export_onnx(model, tmp_path / "smollm2", context=256, chunk=32, model_name="default",
                         checkpoint=resolve_checkpoint_folder("default"))
    runner = OnnxModel(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse "
                                           "keeper who finds a message in a bottle on the beach one morning."}],
                                         add_generation_prompt=True)
    prompt = tokenizer.encode(text)
    assert len(prompt) > 32  # longer than one prefill chunk
    expected = generate(model, prompt, max_new_tokens=64, eos_token_id=[])
    out = generate(runner, prompt, max_new_tokens=64, eos_token_id=[])
    assert out.token_ids[0] == expected.token_ids[0]
    logits, _ = runner.prefill(prompt)
    with torch.inference_mode():
        reference = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0, -1]
    torch.testing.assert_close(torch.from_numpy(logits), reference, rtol=1e-3, atol=1e-3)


def test_notebook_runs(run_notebook):
    run_notebook("15_compile_and_export.ipynb", timeout=600)
