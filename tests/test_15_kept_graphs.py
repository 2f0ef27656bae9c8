"""Lesson 15: compiled decode graphs kept on disk as AOTInductor packages, built once and loaded by later runs.

References: the eager model's greedy tokens (a kept graph decodes the same tokens in
float32); the package cache's own rules (a damaged package is rebuilt, never loaded; two
processes building one graph at once both finish, one of them building it); the key
(weights, shape and settings each change it; an identical copy of the model does not).
Every build here is real: a tiny model's graph takes 10-40 s to build on two cores.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch._inductor.cpp_builder import CppBuilder

from minillm.model.attention import set_attention_backend
from minillm.model.tiny import tiny_pair
from minillm.runtime.runner import ModelRunner
from minillm.speed import cpp_build, graph_store, weights_digest
from minillm.speed.attention_kernels import make_backend
from minillm.speed.compile import compile_model
from minillm.speed.step_shapes import StepShape
from minillm.strategies.generate import generate

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kept_home(tmp_path_factory):
    """A fresh $MINILLM_HOME for this module's packages."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINILLM_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def compiler_runs():
    """Each g++ run of the module's first build: (its command line, when it started, when it ended)."""
    return []


@pytest.fixture(scope="module")
def built(kept_home, compiler_runs):
    """A tiny Llama whose decode graph for two rows (of any length) was built by `generate(compile=True)`."""
    from torch._inductor import cpp_builder

    _, model = tiny_pair("llama", context_length=1024)
    eager = generate(model, PROMPTS, max_new_tokens=12, compile=False)
    run_compile_cmd = cpp_builder.run_compile_cmd

    def recorded(command, cwd):
        start = time.monotonic()
        run_compile_cmd(command, cwd)
        compiler_runs.append((command, start, time.monotonic()))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpp_builder, "run_compile_cmd", recorded)
        compiled = generate(model, PROMPTS, max_new_tokens=12, compile=True)
    return model, eager, compiled


@pytest.mark.slow
def test_compile_true_builds_a_graph_that_decodes_the_eager_tokens(built, kept_home):
    model, eager, compiled = built
    assert compiled.stats.extra["graph"] == "compiled" and eager.stats.extra["graph"] == "eager"
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats.build_seconds > 0
    (entry,) = (kept_home / "graphs").iterdir()
    assert entry.name.startswith("decode-b2-t1-sany-")
    key = json.loads((entry / graph_store.KEY_FILE).read_text())
    assert key["weights_sha256"] == graph_store.weights_digest(model) and key["torch"] == torch.__version__
    # The model's own tensors are not written again: given from the model at load (`package_layout`).
    shared = json.loads((entry / graph_store.SHARED).read_text())
    files = json.loads((entry / graph_store.CONSTANTS).read_text())
    assert shared and all(not (entry / graph_store.WEIGHTS / files[name][0]).exists() for name in shared)
    assert shared["model.tok_emb.weight"] == "tok_emb.weight" and not list(entry.rglob("*.pt2"))


@pytest.mark.slow
def test_a_one_shot_run_reads_the_package_constants_where_they_are_mapped(built, kept_home, monkeypatch):
    """Copying the package's own constants into huge pages pays only over many tokens: a model the loader deferred
    (the command line's) skips it, and decodes the same tokens; any other model's package makes it."""
    from minillm.speed.huge_pages import defer_placement

    model, eager, _ = built
    (entry,) = (kept_home / "graphs").iterdir()
    copied = []
    monkeypatch.setattr(graph_store, "into_huge_pages", lambda tensors: copied.append(len(tensors)) or list(tensors))
    graph_store.PackagedStep(entry, model)
    assert len(copied) == 1
    one_shot = defer_placement(copy.deepcopy(model))
    graph_store.PackagedStep(entry, one_shot)
    assert len(copied) == 1
    assert generate(one_shot, PROMPTS, max_new_tokens=12).token_ids == eager.token_ids


@pytest.mark.slow
def test_the_default_uses_a_built_graph_and_only_then(built):
    model, eager, _ = built
    again = generate(model, PROMPTS, max_new_tokens=12)  # compile=None: the graph if it is built
    assert again.stats.extra["graph"] == "compiled" and again.token_ids == eager.token_ids
    long = [[i % 90 + 1 for i in range(700)], [i % 80 + 2 for i in range(600)]]  # 64 cache columns before, 768 now
    fast = generate(model, long, max_new_tokens=12)
    assert fast.stats.extra["graph"] == "compiled"
    assert fast.token_ids == generate(model, long, max_new_tokens=12, compile=False).token_ids
    assert len(list((graph_store.minillm_home() / "graphs").iterdir())) == 1
    one_row = generate(model, PROMPTS[:1], max_new_tokens=12)  # no graph for one row was built
    assert one_row.stats.extra["graph"] == "eager"
    assert ModelRunner(model, cache="dynamic", graph="auto").graph == "eager"
    set_attention_backend(model, make_backend("flash"))  # asked for by name: the graph writes its own attention
    try:
        flash = generate(model, PROMPTS, max_new_tokens=12)
        assert flash.stats.extra["graph"] == "eager" and flash.token_ids == eager.token_ids
    finally:
        set_attention_backend(model, make_backend("sdpa"))


@pytest.mark.slow
def test_a_damaged_package_is_rebuilt_not_loaded(built, kept_home, monkeypatch, capsys):
    model = built[0]
    compiled = compile_model(model, kept=True)
    shape = StepShape.decode(model.config, 2, None).any_length()
    (entry,) = (kept_home / "graphs").iterdir()
    package = max((p for p in (entry / graph_store.PACKAGE).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    good = package.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped

    def put(content: bytes):  # a new file renamed over it: this process has the library and weights mapped
        package.with_suffix(".new").write_bytes(content)
        os.replace(package.with_suffix(".new"), package)

    put(bytes(data))
    assert "does not match its recorded sha256" in graph_store.entry_problem(entry)
    # The default path (compile=None) does not load it, and says why rather than calling the graph unbuilt
    eager = generate(model, PROMPTS, max_new_tokens=2)
    assert eager.stats.extra["graph"] == "eager"
    assert eager.stats.extra["kept_problem"].startswith(entry.name) and "sha256" in eager.stats.extra["kept_problem"]
    assert "kept_problem" not in generate(model, PROMPTS[:1], max_new_tokens=2).stats.extra  # none built: missing

    rebuilt = []

    def build_entry(model, step_module, shape, key, folder, settings, progress=None):  # the real build, minus the wait
        rebuilt.append(shape)
        put(good)
        graph_store.write_manifest(folder, graph_store.file_record(folder / graph_store.KEY_FILE))

    monkeypatch.setattr(graph_store, "build_entry", build_entry)
    compiled.packages.clear()
    compiled.prepare([shape], progress=False)
    assert rebuilt == [shape] and "unusable" in capsys.readouterr().err
    assert graph_store.entry_problem(entry) is None
    (entry / "manifest.json").write_text("{")  # a manifest cut short: the entry is not trusted
    assert "manifest" in graph_store.entry_problem(entry)


def test_a_new_package_removes_those_built_from_other_code(tmp_path):
    """Every edit of the package's source (or another torch) makes new keys: the packages of the old ones are never
    loaded again and are removed once a new one is kept; packages of this code for other models or shapes stay, and
    so does one still being built."""
    from minillm.base.files import TEMP_MARK

    here = {"source_sha256": graph_store.source_digest(), **graph_store.machine_code()}
    building = f"building{TEMP_MARK}1"
    keys = {"new": here, "other-model": {**here, "weights_sha256": "1" * 64},
            "older-source": {**here, "source_sha256": "0" * 64}, "older-torch": {**here, "torch": "2.0.0"},
            "unreadable": None, building: {**here, "source_sha256": "0" * 64}}
    for name, key in keys.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / graph_store.KEY_FILE).write_text("{" if key is None else json.dumps(key))
    graph_store.remove_entries_of_other_code(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["new", "other-model", building])


@pytest.mark.slow
def test_a_deferred_model_moves_to_huge_pages_only_when_its_decode_reads_it(tmp_path, monkeypatch):
    """`load_model(defer_huge_pages=True)`, as the command line loads: the runner of a kept graph leaves the model
    where it is, even where the graph's matmuls call the library on the model's own weights (a tiny model's do); an
    eager runner moves it into huge pages; the kept graph still decodes the eager tokens after the model moved (the
    package holds what it shares). The one-shot run's prefill multiplies each weight once: by oneDNN on the weight as
    it lies, nothing packed. (The same built graph then serves a speculative run's plain steps: see below.)"""
    from minillm.speed.huge_pages import defer_placement
    from minillm.speed.onednn import OneDNNLinear, use_onednn, uses_onednn

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    _, model = tiny_pair("llama", context_length=256)
    weight = model.blocks[0].mlp.fc.weight
    defer_placement(use_onednn(model))
    address = weight.data_ptr()
    compiled = generate(model, PROMPTS[:1], max_new_tokens=12, compile=True)
    assert compiled.stats.extra["graph"] == "compiled" and weight.data_ptr() == address
    assert not any(type(m) is OneDNNLinear for m in model.modules())  # the prefill's: oneDNN on the weights as
    assert uses_onednn(model) and not any("_packed" in m.__dict__ for m in model.modules())  # they lie, none packed
    eager = generate(model, PROMPTS[:1], max_new_tokens=12, compile=False)
    assert weight.data_ptr() != address  # placed: the eager decode reads the model's own weights
    again = generate(model, PROMPTS[:1], max_new_tokens=12, compile=True)
    assert again.stats.extra["graph"] == "compiled" and compiled.token_ids == eager.token_ids == again.token_ids
    # A speculative run by default (compile=None) finds the decode graph but no verify graph: its plain steps run
    # compiled and its drafts verify eagerly over the same cache (the whole run no longer falls back to eager).
    from minillm.strategies.drafters import PromptLookup
    from minillm.strategies.speculative import speculative_generate

    before = compile_model(model, kept=True).eager_calls
    spec = speculative_generate(model, PROMPTS[:1], PromptLookup(), max_new_tokens=12, num_draft_tokens=4)
    assert spec.stats.extra["graph"] == "compiled" and spec.stats.extra["verify_graph"] == "eager"
    assert spec.token_ids == eager.token_ids and spec.stats.extra["drafted"] > 0
    assert compile_model(model, kept=True).eager_calls > before + 1  # the prompt, and each verify
    assert not any("verify" in folder.name for folder in (tmp_path / "graphs").iterdir())


@pytest.mark.slow
def test_the_wrapper_compiled_beside_the_kernels_without_its_input_checks(built, kept_home, compiler_runs):
    """The build's g++ runs: the wrapper's and the kernels' overlap, the link starts after both end; the package's
    wrapper source has no per-input check functions, only the empty check its `run_impl` calls."""
    def run(part):
        (found,) = [r for r in compiler_runs if part in r[0] and " -c " in f" {r[0]} "]
        return found

    _, wrapper_start, wrapper_end = run("wrapper.cpp")
    _, kernel_start, kernel_end = run("kernel.cpp")
    assert wrapper_start < kernel_end and kernel_start < wrapper_end  # both compiling at once
    links = [start for command, start, _ in compiler_runs if " -shared " in f" {command} "]
    assert links and min(links) >= max(wrapper_end, kernel_end)
    (entry,) = (kept_home / "graphs").iterdir()
    (source,) = (entry / graph_store.PACKAGE).rglob("*.wrapper.cpp")
    code = source.read_text()
    assert "check_input_0" not in code and "__check_inputs_outputs(input_handles, output_handles);" in code
    assert built[1].token_ids == built[2].token_ids  # and the package still decodes the eager tokens


class FakeBuilder:
    """What `cpp_build` reads of torch's `CppBuilder`: whether it only compiles, and the file it makes."""

    def __init__(self, target: str, compile_only: bool = True):
        self._target_file, self._compile_only = target, compile_only


def test_the_pinned_torch_takes_both_build_patches():
    """Both patches take on the pinned torch while the context is open, and are undone when it closes."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    build, checks = CppBuilder.build, CppWrapperCpu.generate_input_output_runtime_checks
    with cpp_build.faster_package_build():
        assert CppBuilder.build is not build and CppWrapperCpu.generate_input_output_runtime_checks is not checks
    assert CppBuilder.build is build and CppWrapperCpu.generate_input_output_runtime_checks is checks


def test_a_link_waits_for_the_wrapper_that_compiles_beside_the_kernels(monkeypatch):
    """The wrapper's compile returns at once and runs on; the kernels' compile runs while it does (the fake wrapper
    compile finishes only once the kernels' has started); the link runs after the wrapper's ends; outside the
    context the builds run as torch runs them."""
    events, kernels_started = [], threading.Event()

    def build(builder):
        name = Path(builder._target_file).name
        if name.endswith(".wrapper.o"):
            events.append(("wrapper waited for the kernels", kernels_started.wait(timeout=30)))
        if name.endswith(".kernel.o"):
            kernels_started.set()
        events.append(name)

    monkeypatch.setattr(CppBuilder, "build", build)  # torch's, as the context finds it
    with cpp_build.faster_package_build():
        CppBuilder.build(FakeBuilder("/b/c1.wrapper.o"))
        CppBuilder.build(FakeBuilder("/b/c2.kernel.o"))
        CppBuilder.build(FakeBuilder("/b/c1.wrapper.so", compile_only=False))
    assert events == ["c2.kernel.o", ("wrapper waited for the kernels", True), "c1.wrapper.o", "c1.wrapper.so"]
    events.clear()
    kernels_started.clear()
    CppBuilder.build(FakeBuilder("/b/c3.kernel.o"))  # outside: in order, in this thread
    assert events == ["c3.kernel.o"]


def test_a_failed_wrapper_compile_fails_the_build(monkeypatch):
    """g++'s error on the wrapper reaches the builder at the link; a build that failed on its own error still waits for
    the wrapper's compile before leaving, and reports its own error."""
    stopped = []

    def build(builder):
        if builder._target_file.endswith(".wrapper.o"):
            time.sleep(0.2)
            stopped.append(builder._target_file)
            raise RuntimeError("g++: wrapper.cpp:1: error")

    monkeypatch.setattr(CppBuilder, "build", build)  # torch's, as the context finds it
    with pytest.raises(RuntimeError, match="wrapper.cpp:1"):
        with cpp_build.faster_package_build():
            CppBuilder.build(FakeBuilder("/b/c1.wrapper.o"))
            CppBuilder.build(FakeBuilder("/b/c1.wrapper.so", compile_only=False))
    with pytest.raises(ValueError, match="the kernels' own"):
        with cpp_build.faster_package_build():
            CppBuilder.build(FakeBuilder("/b/c2.wrapper.o"))
            raise ValueError("the kernels' own error")
    assert stopped == ["/b/c1.wrapper.o", "/b/c2.wrapper.o"]  # the second too had finished when the context left


def test_the_key_follows_weights_shape_and_settings():
    _, model = tiny_pair("llama", context_length=256)
    shape = StepShape.decode(model.config, 1, 100)
    key = graph_store.graph_key(model, shape, {"matmuls": "generated"})
    assert graph_store.graph_key(copy.deepcopy(model), shape, {"matmuls": "generated"}) == key  # same weights, same key
    assert graph_store.graph_key(model, StepShape.decode(model.config, 2, 100), {"matmuls": "generated"}) != key
    assert graph_store.graph_key(model, shape, {"matmuls": "library"}) != key
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, 0] += 1  # an in-place write bumps the tensor's version: hashed again
    assert graph_store.graph_key(model, shape, {"matmuls": "generated"})["weights_sha256"] != key["weights_sha256"]
    with torch.inference_mode():  # weights made in inference mode have no version counter, and still get a key
        frozen = copy.deepcopy(model)
    assert graph_store.weights_digest(frozen) == graph_store.weights_digest(model)


def test_the_weights_digest_reads_every_piece_of_every_tensor(monkeypatch):
    """Hashed in pieces on every core: a byte changed in any piece, or the pieces' order, changes the digest, and it
    does not depend on how many threads hashed it."""
    monkeypatch.setattr(weights_digest, "HASH_PIECE", 64)  # bytes: a 40x3 float32 weight is 480 bytes, 8 pieces
    module = torch.nn.Linear(3, 40, bias=False).requires_grad_(False)
    digest = graph_store.weights_digest(module)
    for index in (0, 17, 119):  # the first piece, a middle one, the last
        changed = copy.deepcopy(module)
        changed.weight.view(-1)[index] += 1
        assert graph_store.weights_digest(changed) != digest
    swapped, flat = copy.deepcopy(module), module.weight.view(-1)
    swapped.weight.view(-1)[:32] = torch.cat([flat[16:32], flat[:16]])
    assert graph_store.weights_digest(swapped) != digest  # two pieces swapped
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert graph_store.weights_digest(copy.deepcopy(module)) == digest


BUILDER = """
import json, sys, torch
from minillm.model.attention import set_attention_backend
from minillm.model.tiny import tiny_pair
from minillm.runtime.session import DecodeSession
from minillm.speed.compile import compile_model
from minillm.speed.attention_kernels import make_backend
from minillm.speed.step_shapes import StepShape
_, model = tiny_pair("llama", context_length=256)
compiled = compile_model(model, matmuls="library", kept=True)
seconds = compiled.prepare([StepShape.decode(model.config, 1, 256)], progress=False)
session = DecodeSession(compiled, "static", max_len=256, fixed_shape=True)
with torch.inference_mode():
    logits, tokens = session.prefill([[5, 6, 7]]), []
    for _ in range(8):
        tokens.append(int(logits[0].argmax()))
        logits = session.extend([[tokens[-1]]])[:, -1]
print(json.dumps({"tokens": tokens, "seconds": seconds, "eager_calls": compiled.eager_calls}))
"""


@pytest.mark.slow
def test_two_processes_building_one_graph_both_succeed(tmp_path):
    env = {**os.environ, "MINILLM_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    runs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(BUILDER)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(run.communicate(timeout=600)[0].strip().splitlines()[-1]) for run in runs]
    assert all(run.returncode == 0 for run in runs)
    _, model = tiny_pair("llama", context_length=256)
    with torch.inference_mode():
        from minillm.runtime.session import DecodeSession

        session, tokens = DecodeSession(model, "static", max_len=256), []
        logits = session.prefill([[5, 6, 7]])
        for _ in range(8):
            tokens.append(int(logits[0].argmax()))
            logits = session.extend([[tokens[-1]]])[:, -1]
    assert [r["tokens"] for r in results] == [tokens, tokens] and all(r["eager_calls"] == 1 for r in results)  # the prompt
    assert len(list((tmp_path / "home" / "graphs").iterdir())) == 1  # one entry, no leftovers


def test_the_command_lines_explain_and_check_the_graph_flags(capsys):
    from minillm.compile import main as compile_main
    from minillm.infer import main as infer_main

    infer_help = subprocess.run([sys.executable, "-m", "minillm.infer", "--help"], capture_output=True, text=True,
                                timeout=120, cwd=REPO).stdout
    assert "--eager" in infer_help and "python -m minillm.compile" in infer_help
    assert infer_main(["--prompt", "hi", "--compile", "--eager"]) == 2
    assert infer_main(["--prompt", "hi", "--compile", "--attention", "flash"]) == 2
    assert "--attention flash picks an eager kernel" in capsys.readouterr().err
    assert compile_main(["--batch-size", "0"]) == 2
    assert "--batch-size 0 is invalid" in capsys.readouterr().err
    assert compile_main(["--serve", "--batch-size", "2"]) == 2  # the server's one graph has no fixed batch
    assert "--serve builds the one server step" in capsys.readouterr().err
    assert compile_main(["--serve", "--block-size", "0"]) == 2
    assert "--block-size 0 is invalid" in capsys.readouterr().err
    from minillm.serve import main as serve_main

    assert serve_main(["--compile", "--eager"]) == 2


def test_the_build_command_leaves_every_module_byte_compiled(tmp_path):
    """`python -m minillm.compile` writes the bytecode a later start reads, even where PYTHONDONTWRITEBYTECODE is
    set; an edited module's stale bytecode is compiled afresh."""
    import importlib.util

    from minillm.compile import write_bytecode

    modules = sorted((REPO / "minillm").rglob("*.py"))
    edited = REPO / "minillm" / "base" / "jsonio.py"
    stale = Path(importlib.util.cache_from_source(str(edited)))
    if stale.exists():
        stale.unlink()
    write_bytecode()
    missing = [m for m in modules if not Path(importlib.util.cache_from_source(str(m))).exists()]
    assert not missing, missing
    source_stamp = int(edited.stat().st_mtime) & 0xFFFFFFFF
    assert int.from_bytes(stale.read_bytes()[8:12], "little") == source_stamp  # the pyc names its source's stamp


@pytest.mark.parametrize("collecting", [True, False])
def test_importing_the_package_freezes_what_torch_made_and_leaves_collection_as_it_was(collecting):
    script = ("import gc\n" + ("" if collecting else "gc.disable()\n") +
              "import minillm\nprint(gc.isenabled(), gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=REPO).stdout.split()
    assert out[0] == str(collecting)
    assert int(out[1]) > 100_000  # what importing torch and the package made (about 260,000 objects)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["prompt-lookup", "lookahead"])
def test_speculative_rounds_verify_through_a_kept_graph_with_the_eager_tokens(kept_home, drafter):
    from minillm.strategies.drafters import PromptLookup
    from minillm.strategies.lookahead import Lookahead
    from minillm.strategies.speculative import speculative_generate

    _, model = tiny_pair("llama", context_length=256)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # repeats: the drafts find matches
    runs = {}
    for compile in (False, True):  # both drafters draft at most 4 tokens: one verify graph of 5 serves both
        draft = PromptLookup() if drafter == "prompt-lookup" else Lookahead(decoding_length=4, branch_length=3)
        budget = {"num_draft_tokens": 4} if drafter == "prompt-lookup" else {}  # lookahead's: its decoding length
        runs[compile] = speculative_generate(model, prompt, draft, max_new_tokens=24, compile=compile, **budget)
    eager, compiled = runs[False], runs[True]
    assert compiled.stats.extra["graph"] == "compiled" and compiled.token_ids == eager.token_ids
    assert compiled.stats.extra["drafted"] > 0 and compiled.stats.extra["verify_forwards"] > 0
    assert compile_model(model, kept=True).eager_calls == 1  # the prompt: every round ran a graph
    names = sorted(p.name.rsplit("-", 1)[0] for p in (kept_home / "graphs").iterdir())
    assert "decode-b1-t1-sany" in names and "verify-b1-t5-sany" in names
    # A shorter draft, by default (compile=None), verifies through the longer kept graph (padded), not eagerly.
    before = compile_model(model, kept=True).eager_calls
    shorter = speculative_generate(model, prompt, PromptLookup(), max_new_tokens=24, num_draft_tokens=2)
    assert shorter.stats.extra["graph"] == "compiled" and "verify_graph" not in shorter.stats.extra
    assert shorter.token_ids == eager.token_ids and shorter.stats.extra["drafted"] > 0
    assert compile_model(model, kept=True).eager_calls == before + 1  # the prompt only


def test_the_files_left_out_of_the_source_digest_exist_and_hold_no_forward():
    root = REPO / "minillm"
    for name in graph_store.TEXT_ONLY:  # a renamed file would silently re-enter every key
        text = (root / name).read_text()
        assert "torch.nn" not in text and "import torch\n" not in text, name


def test_the_paged_decode_step_computes_the_engine_eager_step():
    """The function the server's graph is exported from, run as plain PyTorch: each row's key written at its slot,
    its keys read back through its block table (two rows spanning 2 and 3 blocks, tables in no order), the same
    logits and the same pools as the engine's eager packed step."""
    from minillm.cache.paged import PackedSequences
    from minillm.speed.step_shapes import PagedShape

    _, model = tiny_pair("llama", context_length=256)
    runner = ModelRunner(model, cache="paged", graph="eager", num_blocks=12, block_size=4)
    tables, prompts = [[3, 7, 1], [0, 5, 9]], [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    with torch.inference_mode():
        packed = PackedSequences.build(tables, [0, 0], [6, 9], 4)
        runner.step(packed, torch.tensor(prompts[0] + prompts[1]), packed.last_tokens)
        keys, values = (list(map(torch.clone, pools)) for pools in runner.cache.block_pools())
        packed = PackedSequences.build(tables, [6, 9], [1, 1], 4)  # one new token each: key 7 and key 10
        tokens = torch.tensor([21, 22])
        expected = runner.step(packed, tokens, packed.last_tokens)  # [2, V], eager
        step = PagedShape(4).module(compile_model(model, kept=True).step_module)
        got = step(tokens[:, None], packed.positions[:, None], packed.slots, packed.decode_blocks, keys, values)
    torch.testing.assert_close(got[:, 0], expected, rtol=1e-5, atol=1e-5)
    for mine, engine in zip(keys + values, sum(map(list, runner.cache.block_pools()), [])):
        torch.testing.assert_close(mine, engine, rtol=1e-6, atol=1e-6)  # written in place, at the same slots


@pytest.mark.slow
def test_the_engine_decodes_through_one_kept_paged_graph_with_the_eager_tokens(tmp_path, monkeypatch):
    """One package (rows, blocks and pool size symbolic) runs every step in which each request decodes: one
    request and three, keys in one block and in many; the tokens equal the eager engine's, greedy and sampled."""
    from minillm.decoding.sampling import SamplingConfig
    from minillm.runtime.continuous import generate_continuous
    from minillm.runtime.engine import Engine

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    _, model = tiny_pair("llama", context_length=256)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2, 3, 7, 3]]
    configs = [SamplingConfig(max_new_tokens=n, do_sample=i == 1, seed=i, temperature=0.8)
               for i, n in enumerate((30, 20, 9, 16))]
    options = {"block_size": 4, "num_blocks": 64, "max_num_seqs": 3}
    assert Engine(model, **options).runner.graph == "eager"  # "auto", the default: nothing is built yet
    runs = {graph: generate_continuous(model, prompts, configs, arrivals=[0, 2, 2, 12],
                                       engine_options={**options, "graph": graph}) for graph in ("eager", "compiled")}
    eager, compiled = runs["eager"], runs["compiled"]
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats.extra["graph"] == "compiled" and compiled.stats.build_seconds > 0
    # Prompts arrive at steps 0, 2 and 12: those three steps prefill and run eagerly, every other one compiled.
    assert compiled.stats.extra["compiled_steps"] == compiled.stats.forward_passes - 3
    (entry,) = (tmp_path / "graphs").iterdir()
    assert entry.name.startswith("paged-decode-bs4-")
    again = Engine(model, **options)  # "auto" now finds it, and loads it
    assert again.runner.graph == "compiled" and Engine(model, **options, graph="eager").runner.graph == "eager"
    assert Engine(model, **{**options, "block_size": 8}).runner.graph == "eager"  # another block size: not built


@pytest.mark.slow
def test_a_quantized_model_runs_its_kernels_inside_the_kept_graphs(tmp_path, monkeypatch):
    """`--quant` with `--compile`, on the CLI's path and the server's: the int4 kernel (every block's linears) and
    the int8 kernel (the LM head, as the GGUF's Q8_0 head becomes) traced into the static decode graph and into the
    engine's paged step; each decodes the same tokens as the same quantized model run eagerly."""
    from minillm.runtime.continuous import generate_continuous
    from minillm.speed.quant import Int4WeightLinear, Int8WeightLinear
    from minillm.speed.quantize_model import quantize_model, quantized_modules

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    _, model = tiny_pair("llama", context_length=256)
    quantize_model(model, "int4", head="int8")
    assert set(quantized_modules(model)) == {Int4WeightLinear.__name__, Int8WeightLinear.__name__}
    eager = generate(model, PROMPTS, max_new_tokens=12, compile=False)
    compiled = generate(model, PROMPTS, max_new_tokens=12, compile=True)
    assert compiled.stats.extra["graph"] == "compiled" and compiled.token_ids == eager.token_ids
    options = {"block_size": 4, "num_blocks": 64, "max_num_seqs": 2}
    runs = {graph: generate_continuous(model, PROMPTS, max_new_tokens=12, arrivals=[0, 3],
                                       engine_options={**options, "graph": graph}) for graph in ("eager", "compiled")}
    assert runs["compiled"].token_ids == runs["eager"].token_ids == eager.token_ids
    assert runs["compiled"].stats.extra["compiled_steps"] == runs["compiled"].stats.forward_passes - 2


@pytest.mark.slow
def test_a_kept_verify_step_on_onednn_packed_weights_gives_the_eager_logits(tmp_path, monkeypatch):
    """Matmuls "onednn" (a float32 model's choice for the server's step, over any number of rows), here in a verify
    package: the package calls `onednn_linear` from its C++ driver, each weight is packed once, at the first call,
    and a 5-token verify gives the eager forward's logits (the two libraries round differently)."""
    from minillm.runtime.session import DecodeSession

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    _, model = tiny_pair("llama", context_length=256)
    compiled = compile_model(model, matmuls="onednn", kept=True)
    verify = StepShape.verify(model.config, 1, 5, None).any_length()
    compiled.prepare([verify], progress=False)
    calls = next((tmp_path / "graphs").glob("verify-*/package/**/*.wrapper.json"), None)  # what the driver calls back
    assert calls is not None and '"target": "minillm::onednn_linear"' in calls.read_text()
    packs = []
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda *args, original=torch.ops.mkldnn._reorder_linear_weight: packs.append(1) or
                        original(*args))
    with torch.inference_mode():
        got, expected = [], []
        for twin, out in ((compiled, got), (model, expected)):
            session = DecodeSession(twin, "static", max_len=256, fixed_shape=True)
            session.prefill([[5, 6, 7]])
            out += [session.extend([[8, 9, 10, 11, 12]]), session.extend([[13, 14, 15, 16, 17]])]
    assert compiled.eager_calls == 1  # the prompt: both verifies ran the package
    linears = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(packs) == len(linears)  # once per weight, not per call
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
