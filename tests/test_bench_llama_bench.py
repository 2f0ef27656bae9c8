"""llama.cpp's own benchmark program as the decode suite's peer (`minillm.bench.llama_bench`; issue 64's first step).

References: llama-bench's own command line and JSON report (a stand-in program here prints a
report of the shape the real one prints, and records the command it was given); the decode
report's table, rendered from a result holding a llama.cpp row. The real program, built from
llama-cpp-python's vendored source, is checked where `MINILLM_LLAMA_BENCH` names one.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from minillm.bench import markdown as md
from minillm.bench.cli import build_parser
from minillm.bench.llama_bench import LlamaBench, generation_rate, llama_bench_command, llama_bench_problem
from minillm.bench.sections_decoding import decode_section
from test_bench_report import decode_result, flat

LINKS = {"png": "decode.png", "json": "decode.json"}
# What llama-bench -o json prints for one test (fields trimmed to those read, plus two it always has)
GENERATION = {"model_type": "llama ?B F32", "n_prompt": 0, "n_gen": 16, "n_depth": 32, "avg_ts": 80.0,
              "stddev_ts": 0.5}


@pytest.fixture
def stand_in(tmp_path) -> Path:
    """An executable that answers --help as llama-bench does and otherwise prints a one-test JSON report at 80 tok/s
    for the -n it was given, writing its command line beside itself."""
    program = tmp_path / "llama-bench"
    program.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        if "--help" in sys.argv:
            print("usage: llama-bench [options]\\n  -n, --n-gen <n>  (default: 128)")
            sys.exit(0)
        open(sys.argv[0] + ".argv", "w").write(json.dumps(sys.argv[1:]))
        n = int(sys.argv[sys.argv.index("-n") + 1])
        print(json.dumps([{{**{GENERATION!r}, "n_gen": n}}]))
        """))
    program.chmod(0o755)
    return program


def test_a_program_is_taken_for_llama_bench_only_when_it_runs_as_one(stand_in, tmp_path):
    assert llama_bench_problem(stand_in) is None
    assert "no --llama-bench PATH given" in llama_bench_problem(None)
    assert llama_bench_problem(tmp_path / "missing") == f"--llama-bench {tmp_path / 'missing'}: no such file"
    assert "is not llama.cpp's llama-bench" in llama_bench_problem(Path("/bin/true"))


def test_one_round_is_one_generation_at_the_suites_depth_with_every_layer_on_a_gpu(stand_in, tmp_path):
    gguf = tmp_path / "model.F32.gguf"
    for device, layers in (("cpu", "0"), ("cuda", "99")):
        command = llama_bench_command(stand_in, gguf, context=32, new_tokens=16, device=device, threads=2)
        flags = dict(zip(command[1::2], command[2::2]))
        assert flags == {"-m": str(gguf), "-p": "0", "-n": "16", "-d": "32", "-r": "1", "-ngl": layers, "-t": "2",
                         "-o": "json"}
    seconds = LlamaBench(stand_in, gguf, context=32, new_tokens=16, device="cuda", threads=2)()
    assert seconds == pytest.approx(15 / 80.0)  # the 15 steps after the first token, at the reported rate
    assert json.loads(Path(str(stand_in) + ".argv").read_text())[:2] == ["-m", str(gguf)]


def test_the_rate_is_read_from_the_generation_test_alone():
    prompt = {**GENERATION, "n_prompt": 512, "n_gen": 0, "avg_ts": 5000.0}
    assert generation_rate(json.dumps([prompt, GENERATION]), 16) == 80.0
    with pytest.raises(ValueError, match="reported 0 generation tests of 32 tokens"):
        generation_rate(json.dumps([prompt, GENERATION]), 32)
    with pytest.raises(ValueError, match="reported 2 generation tests"):
        generation_rate(json.dumps([GENERATION, GENERATION]), 16)


def test_a_failing_run_is_one_line(tmp_path):
    program = tmp_path / "llama-bench"
    program.write_text(f"#!{sys.executable}\nimport sys\nprint('error: failed to load model', file=sys.stderr)\n"
                       "sys.exit(1)\n")
    program.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"^llama-bench exited with status 1: error: failed to load model$"):
        LlamaBench(program, tmp_path / "m.gguf", 32, 16, "cpu", 2)()


def test_the_flag_belongs_to_the_decode_suite():
    parser = build_parser()
    assert parser.parse_args(["decode", "--llama-bench", "/x/llama-bench"]).llama_bench == Path("/x/llama-bench")
    from minillm.bench.cli import check_options

    with pytest.raises(SystemExit):
        check_options(parser, parser.parse_args(["batch", "--llama-bench", "/x/llama-bench"]))


def test_quantized_sections_are_chosen_once_each_and_for_the_decode_suite_only(capsys):
    """`--quant int8,gguf` adds those sections to the decode suite; an unknown or repeated one is refused by the
    parser, and the option on another suite is refused rather than ignored."""
    from minillm.bench.cli import check_options

    parser = build_parser()
    assert parser.parse_args(["decode", "--quant", "int8,gguf"]).quant == ("int8", "gguf")
    for bad in ("int9", "int8,int8", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["decode", "--quant", bad])
        assert "expected some of int8, int4, gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_options(parser, parser.parse_args(["batch", "--quant", "int8"]))


def test_a_quantized_section_names_the_llama_cpp_file_it_was_set_against():
    """A quantized row's llama.cpp ran the GGUF as Q8_0 (int8) or as stored (int4, gguf): the column says so."""
    data = decode_result()
    data["results"]["int8"] = {**data["results"]["float32"], "contenders": {
        "minillm static": {"tokens_per_second": 90.0, "roofline_fraction": 0.1},
        "minillm compiled": {"tokens_per_second": 180.0, "roofline_fraction": 0.2},
        "llama.cpp": {"tokens_per_second": 150.0, "roofline_fraction": 0.2}}}
    data["results"]["gguf"] = data["results"]["int8"]
    text = flat(decode_section("Decoding at batch 1", data, LINKS))
    assert "| llama.cpp (F32 / BF16 / Q8_0 / as stored file) |" in text
    assert "| int8 | 90.0 | " in text and f"**{md.times(180.0 / 150.0)}** |" in text


def test_the_decode_table_sets_minillm_against_llama_cpp_when_it_ran():
    data = decode_result()
    for dtype, rate in (("float32", 22.0), ("bfloat16", 25.0)):
        data["results"][dtype]["contenders"]["llama.cpp"] = {"tokens_per_second": rate, "roofline_fraction": 0.3,
                                                              "decode_seconds_per_repeat": [15 / rate] * 3}
    text = flat(decode_section("Decoding at batch 1", data, LINKS))
    assert "| precision | minillm static cache | transformers dynamic cache | llama.cpp (F32 / BF16 file) |" in text
    assert "best minillm / best transformers | best minillm / llama.cpp |" in text
    assert f"| 44.0 | 20.0 | 22.0 | **{md.times(44.0 / 20.0)}** | **{md.times(44.0 / 22.0)}** |" in text
    plain = flat(decode_section("Decoding at batch 1", decode_result(), LINKS))
    assert "llama.cpp" not in plain  # without --llama-bench the table is as it was


@pytest.mark.skipif(not os.environ.get("MINILLM_LLAMA_BENCH"), reason="MINILLM_LLAMA_BENCH names no built llama-bench")
def test_the_real_llama_bench_times_the_default_models_f32_file():
    from minillm.bench.llama_cpp import gguf_as
    from minillm.speed.quant_gguf import gguf_path_for

    program = Path(os.environ["MINILLM_LLAMA_BENCH"])
    assert llama_bench_problem(program) is None
    seconds = LlamaBench(program, gguf_as(gguf_path_for("default"), "F32"), 32, 16, "cpu", os.cpu_count())()
    assert 0 < seconds < 60
