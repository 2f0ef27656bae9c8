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
