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
    (["--quant", "gguf", "--device", "cuda"], "--quant gguf runs CPU kernels (lesson 14), not on cuda"),
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
    from minillm.infer import read_prompts_file

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


def test_an_unreachable_max_new_tokens_is_refused_unless_sliding_is_asked(capsys):
    """Without --slide, a prompt plus --max-new-tokens longer than the context is one line naming the most that fits
    (it used to run on, sliding, for as long as it was allowed); with --slide it runs."""
    from minillm.speed.load import load_model

    _, tokenizer = load_model("default")
    prompt_tokens = len(tokenizer.encode("Hi"))
    line = one_error_line(capsys, ["--prompt", "Hi", "--no-chat", "--json", "--max-new-tokens", "100000000"])
    assert (f"prompt 0 ({prompt_tokens} tokens) plus --max-new-tokens 100000000 outgrows the model's context of 8192 "
            f"tokens: lower --max-new-tokens to at most {8192 - prompt_tokens}, or pass --slide") in line
    assert main(["--prompt", "Hi", "--no-chat", "--json", "--max-new-tokens", "2", "--slide"]) == 0


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


def test_serve_and_compile_refuse_quantization_off_the_cpu_before_loading(capsys):
    """Every command that loads a model says which quantizations run where, in one line, before any weight moves."""
    from minillm.compile import main as compile_main
    from minillm.serve import main as serve_main

    assert serve_main(["--port", "0", "--quant", "int8", "--device", "cuda"]) == 2
    assert compile_main(["--quant", "gguf", "--device", "cuda:0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("runs CPU kernels (lesson 14), not on cuda" in line for line in lines), lines
