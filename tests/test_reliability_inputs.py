"""Reliability of the command line and the Python API: bad input is one line, numbers never break.

The model-cache side of reliability (verified fetches, self-checking cache entries,
concurrency) is in test_reliability.py. Here: flags that argparse would misread or
silently ignore, prompt files in every shape, JSON that a strict parser must accept,
extreme temperatures, NaN logits, a closed stdout, Ctrl-C while starting.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from minillm.decoding.sampling import SamplingConfig
from minillm.infer import main
from minillm.model.tiny import tiny_pair
from minillm.strategies.generate import generate


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every parser but Python's does."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillm: error: ") and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ flags


@pytest.mark.parametrize("value", ["-inf", "-1e-5", "-nan"])
def test_negative_numbers_reach_the_validation(capsys, value):
    line = one_error_line(capsys, ["--prompt", "hi", "--temperature", value])
    assert f"--temperature {float(value)!r} is invalid" in line  # not argparse's "expected one argument"


@pytest.mark.parametrize("flags, named", [
    (["--draft-model", "layers:2"], "--draft-model applies to speculative decoding only"),
    (["--num-draft-tokens", "3"], "--num-draft-tokens applies to speculative decoding only"),
    (["--system", "Be brief", "--no-chat"], "--system goes into the chat template"),
    (["--speculative", "prompt-lookup", "--num-draft-tokens", "0"], "--num-draft-tokens=0 is invalid"),
    (["--decoding-length", "8"], "--decoding-length applies to speculative decoding only"),
    (["--speculative", "prompt-lookup", "--branch-length", "4"], "--branch-length applies to --speculative lookahead"),
    (["--speculative", "lookahead", "--decoding-length", "0"], "--decoding-length 0 is invalid"),
    (["--speculative", "lookahead", "--branch-length", "-1"], "--branch-length -1 is invalid"),
    (["--speculative", "lookahead", "--num-draft-tokens", "4"], "lookahead's budget is --decoding-length"),
    (["--quant", "dynamic-int8", "--device", "cuda"],
     "--quant dynamic-int8 runs CPU kernels (lesson 14), not on cuda: on a GPU use --quant int8, int4 or gguf"),
])
def test_flags_that_need_another_flag_are_refused_not_ignored(capsys, flags, named):
    assert named in one_error_line(capsys, ["--prompt", "hi", *flags])


# ------------------------------------------------------------------ prompt files


@pytest.mark.parametrize("name, content, prompts", [
    ("p.txt", "\ufeffHello\n\nWorld\n", ["Hello", "World"]),  # a byte-order mark is not part of the prompt
    ("p.JSONL", '{"prompt": "a"}\n{"prompt": "b"}\n', ["a", "b"]),
    ("p.json", '["a", {"prompt": "b"}]', ["a", "b"]),
])
def test_prompt_files_are_read_by_their_ending(tmp_path, name, content, prompts):
    from minillm.base.cli_inputs import read_prompts_file

    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert read_prompts_file(str(path)) == prompts


@pytest.mark.parametrize("name, content, named", [
    ("p.txt", b"caf\xe9\n", "is not UTF-8 text"),
    ("p.json", b'{"prompt": "a"}', "must hold a JSON list of prompts"),
    ("p.json", b"[1, 2]", "item 0 is not a JSON object"),
    ("p.jsonl", b'{"prompt": "a"\n', "line 1 is not valid JSON"),
])
def test_bad_prompt_files_are_one_line_naming_the_file(tmp_path, capsys, name, content, named):
    path = tmp_path / name
    path.write_bytes(content)
    line = one_error_line(capsys, ["--prompts-file", str(path)])
    assert str(path) in line and named in line


def test_a_missing_prompt_file_is_one_line(tmp_path, capsys):
    assert "cannot read --prompts-file" in one_error_line(capsys, ["--prompts-file", str(tmp_path / "nope.txt")])


# ------------------------------------------------------------------ numbers


def test_the_smallest_temperatures_sample_the_argmax():
    _, model = tiny_pair("llama", seed=4)
    prompt = [5, 6, 7, 8]
    greedy = generate(model, [prompt], max_new_tokens=12, eos_token_id=()).token_ids
    for temperature in (1e-30, 1e-38, 1e-45, 5e-324):
        sampled = generate(model, [prompt], SamplingConfig(do_sample=True, temperature=temperature, seed=0,
                                                           max_new_tokens=12, eos_token_id=())).token_ids
        assert sampled == greedy, temperature


def test_nan_logits_are_refused_not_sampled():
    _, model = tiny_pair("gpt2")
    with torch.no_grad():
        model.lm_head.weight[3] = float("nan")
    for config in (SamplingConfig(), SamplingConfig(do_sample=True, seed=0)):
        with pytest.raises(FloatingPointError, match="NaN logits"):
            generate(model, [[1, 2, 3]], config, max_new_tokens=3)


@pytest.mark.parametrize("flags, unless", [
    ([], ", or pass --slide to let the window slide"),
    (["--speculative", "prompt-lookup"], " (speculative decoding does not slide the window)"),
    (["--num-beams", "2"], " (beam search does not slide the window)"),
])
def test_an_unreachable_max_new_tokens_is_refused_unless_sliding_is_asked(capsys, default_model, flags, unless):
    """Without --slide, a prompt plus --max-new-tokens longer than the context is one line naming the most that fits,
    in the words the server uses for the same request (one check, `check_fits_context`); it used to run on, sliding,
    for as long as it was allowed. Speculative decoding and beam search, which never slide, are refused alike."""
    _, tokenizer = default_model
    prompt_tokens = len(tokenizer.encode("Hi"))
    line = one_error_line(capsys, ["--prompt", "Hi", "--no-chat", "--json", "--max-new-tokens", "100000000", *flags])
    assert line == (f"minillm: error: this model's maximum context length is 8192 tokens, but prompt 0 has "
                    f"{prompt_tokens} tokens and --max-new-tokens asks for 100000000 more: lower --max-new-tokens to "
                    f"at most {8192 - prompt_tokens} or shorten prompt 0{unless}")
    if not flags:
        assert main(["--prompt", "Hi", "--no-chat", "--json", "--max-new-tokens", "2", "--slide"]) == 0


def test_the_cli_and_the_server_refuse_an_unreachable_budget_in_the_same_words():
    """The server's 400 and the CLI's line come from one check: the same sentence but for the knob's name."""
    from minillm.serving.openai_api import APIError, CompletionRequest, max_new_tokens

    with pytest.raises(APIError) as refused:
        max_new_tokens(CompletionRequest(prompt="x", max_tokens=60), 50, 100)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert str(refused.value) == ("this model's maximum context length is 100 tokens, but the prompt has 50 tokens and "
                                  "max_tokens asks for 60 more: lower max_tokens to at most 50 or shorten the prompt")


@pytest.mark.parametrize("flags", [["--speculative", "prompt-lookup"], ["--num-beams", "2"]])
def test_slide_is_refused_where_the_window_never_slides(capsys, flags):
    assert "--slide applies to plain generation" in one_error_line(capsys, ["--prompt", "hi", "--slide", *flags])


@pytest.mark.parametrize("flags", [["--max-new-tokens", "0"],
                                   ["--max-new-tokens", "1", "--speculative", "prompt-lookup"]])
def test_every_json_output_is_strict_json(capsys, flags):
    assert main(["--prompt", "Hi", "--json", *flags]) == 0
    records = [strict_json(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(records) == 1 and records[0]["stats"]["decode_tokens_per_second"] is None


# ------------------------------------------------------------------ the process around the CLI


def cli_process(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "minillm.infer", *args], capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_a_closed_stdout_is_one_line():
    result = subprocess.run(["bash", "-c", f"{sys.executable} -m minillm.infer --prompt hi >&-"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == "minillm: error: standard output is closed: redirect it to a file or a pipe"


def test_ctrl_c_while_starting_is_one_line():
    process = subprocess.Popen([sys.executable, "-m", "minillm.infer", "--prompt", "hi"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # inside the package's imports (torch alone takes longer)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err and err.strip() == "minillm: interrupted"


@pytest.mark.slow
def test_leaving_a_stream_early_then_exiting_is_clean():
    script = ("from minillm.strategies.streaming import stream\nfrom minillm.model.tiny import tiny_pair\n"
              "from minillm.model.tokenizer import gpt2_tokenizer\n"
              "model = tiny_pair('llama')[1]\n"
              "for piece in stream(model, [39, 68, 75], tokenizer=gpt2_tokenizer(), max_new_tokens=500):\n"
              "    break\nprint('left')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "left"
    assert "terminate called" not in result.stderr and "Traceback" not in result.stderr


QUANTS = ("none", "int8", "int4", "gguf", "dynamic-int8", "mxfp4")  # every --quant choice (add_quant_flag)
GPUS = torch.cuda.device_count()


def refusal(device: str, quant: str) -> str | None:
    """What each command must say, in one line, for --device `device` --quant `quant` here; None where it runs."""
    if device == "banana":
        return "unknown device 'banana': use cpu or cuda"
    if quant in ("dynamic-int8", "mxfp4") and device != "banana" or quant != "none" and device == "mps":
        return f"--quant {quant} runs CPU kernels (lesson 14), not on {device}"  # true on every machine
    if device == "mps":
        return "unsupported device 'mps': use cpu or cuda"
    if not GPUS:
        return f"device {device} was asked for but no CUDA GPU is available here; use --device cpu"
    if device == "cuda:7" and GPUS <= 7:
        return f"device cuda:7 was asked for but this machine has {GPUS} CUDA GPU"
    return None


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("device", ["cuda", "cuda:7", "mps", "banana"])
@pytest.mark.parametrize("command", ["infer", "serve", "compile"])
def test_every_quant_and_device_is_refused_in_one_line_before_any_weight_moves(capsys, monkeypatch, command, device,
                                                                                quant):
    """infer, serve and compile share load_model's checks: a quantization with no kernel on the device (a GPU runs
    int8, int4 and gguf), a GPU this machine lacks, a device torch cannot run the model on or does not know, each
    one line and exit 2 before the checkpoint is even located (the CPU runs every quantization: the suites and
    test_14 run them)."""
    import importlib

    expected = refusal(device, quant)
    if expected is None:
        pytest.skip(f"--device {device} --quant {quant} runs on this machine")

    def located(*args, **kwargs):
        raise AssertionError("the checkpoint was located: the refusal came too late")

    monkeypatch.setattr("minillm.model.loading.resolve_checkpoint_folder", located)
    first = {"infer": ["--prompt", "hi"], "serve": ["--port", "0"], "compile": []}[command]
    assert importlib.import_module(f"minillm.{command}").main([*first, "--device", device, "--quant", quant]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("minillm: error: ") and expected in err, err


def test_a_gpu_index_past_the_machine_is_refused_before_loading(monkeypatch):
    """On a one-GPU machine (simulated here) cuda:7 is refused by name; moving the weights there would fail only after
    the whole checkpoint was read."""
    from minillm.model.loading import ModelLoadError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ModelLoadError, match=r"device cuda:7 was asked for but this machine has 1 CUDA GPU \(cuda:0\); "
                                             r"use one of them"):
        resolve_device("cuda:7")
