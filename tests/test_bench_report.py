"""The README's measured figures against results/*.json, the benchmark plots, and the strict JSON writer.

A figure in the README must be what the JSON says: regenerating the generated
section from the committed JSON must give the committed README byte for byte, so
a hand edit or a stale figure fails here. The report and the plots are then
checked on small synthetic results, where the right answer is known.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest

from minillm.base.jsonio import dumps, read_json, write_json
from minillm.bench import batch, cache_scaling, decode, lookahead, parallel, processes, report, speculative
from minillm.bench.cli import OPTION_COMMANDS, RESULTS, build_parser, git_stamp, write_results

PLOTS = {"decode": decode.plot, "cache-scaling": cache_scaling.plot, "batch": batch.plot,
         "speculative": speculative.plot, "lookahead": lookahead.plot, "cli": processes.plot, "parallel": parallel.plot}


def strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, as every parser outside Python does."""
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=reject)


# --- The committed README and results. -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", report.readmes_with_blocks(RESULTS / "README.md"), ids=lambda path: str(path.parent.name))
def test_readme_figures_are_generated_from_results(path):
    """The course README and every lesson README with a generated block."""
    readme = path.read_text()
    regenerated = report.regenerate(readme, RESULTS, path.parent)
    assert regenerated == readme, f"{path} differs from results/*.json: run `python -m minillm.bench report`"


def test_results_readme_has_no_hand_typed_figures():
    """Outside its generated blocks, results/README.md may hold prose but no number: numbers come from the JSON."""
    by_hand = report.BLOCK.sub("", (RESULTS / "README.md").read_text())
    assert not re.findall(r"\d", by_hand), by_hand


@pytest.mark.parametrize("path", sorted(RESULTS.glob("**/*.json")), ids=lambda path: path.name)
def test_results_are_strict_json(path):
    strict_loads(path.read_text())


# --- The report on synthetic results. -------------------------------------------------------------------------------

MACHINE = {"cpu": "Test CPU", "cores": 4, "memory_gib": 16.0, "cpu_flags": ["avx2"], "torch_threads": 4,
           "torch": "2.13.0+cpu", "python": "3.11.7", "device": "cpu", "transformers": "5.23.0"}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEMPLATE = f"# x\n\n## Measured speedups\n\nProse.\n\n{report.BEGIN}\nstale\n{report.END}\n\n## Next\n\nMore.\n"


def stamped(suite: str, **data) -> dict:
    return {"suite": suite, "machine": MACHINE, "command": f"python -m minillm.bench {suite}",
            "git": {"commit": COMMIT, "dirty": False}, "date": "2025-01-02T03:04:05+00:00", "model": "default",
            "repeats": 3, **data}


def around(value: float) -> list[float]:
    """Three repeats whose median is `value`."""
    return [0.9 * value, value, 1.2 * value]


def decode_result(fp32_minillm: float = 44.0) -> dict:
    def contender(tokens_per_second):
        return {"tokens_per_second": tokens_per_second, "ms_per_token": 1000 / tokens_per_second,
                "roofline_fraction": tokens_per_second / 80,
                "decode_seconds_per_repeat": around(15 / tokens_per_second)}

    def precision(minillm, transformers):
        return {"weight_bytes": 538_060_032, "roofline_tokens_per_second": 80.0,
                "contenders": {"minillm static": contender(minillm), "transformers": contender(transformers)},
                "same_tokens_as_minillm_static": {"minillm static": True, "transformers": True}}

    return stamped("decode", quick=False, prompt_tokens=32, new_tokens=16, memory_bandwidth_gb_s=43.0,
                   results={"float32": precision(fp32_minillm, 20.0), "bfloat16": precision(50.0, 36.0)},
                   prefill={"tokens": 128, "seconds": {"minillm": 0.1, "transformers": 0.2},
                            "speedup_vs_transformers": 2.0})


def cache_scaling_result() -> dict:
    costs = {32: (20.0, 20.5, 40.0), 64: (21.0, 22.0, 75.0)}
    names = ("static cache", "dynamic cache", "no cache")
    rows = [{"length": length, **dict(zip(names, ms)), "ms_per_repeat": {n: around(v) for n, v in zip(names, ms)}}
            for length, ms in costs.items()]
    return stamped("cache-scaling", quick=True, dtype="float32", unit="ms per generated token", rows=rows,
                   growth={n: costs[64][i] / costs[32][i] for i, n in enumerate(names)})


def batch_result() -> dict:
    def summary(batch_size, seconds, first=0.05, new_tokens=8):
        return {"seconds": seconds, "seconds_per_repeat": around(seconds), "time_to_first_token": first,
                "time_to_first_token_per_repeat": [first] * 3, "tokens_per_second": batch_size * new_tokens / seconds,
                "decode_per_second": batch_size * (new_tokens - 1) / (seconds - first),
                "ms_per_token": 1000 * (seconds - first) / (new_tokens - 1)}

    rows = []
    for batch_size, minillm, transformers in ((1, 0.2, 0.4), (2, 0.25, 0.5)):
        rows.append({"batch": batch_size, "prompt_lengths": [9, 57][:batch_size], "padding_share": 0.1 * batch_size,
                     "prefill_padding_share": 0.2 * batch_size, "same_tokens": True,
                     "minillm": summary(batch_size, minillm), "transformers": summary(batch_size, transformers),
                     "speedup_vs_transformers": transformers / minillm,
                     "minillm_scaling_vs_batch_1": 0.2 / minillm * batch_size})
    return stamped("batch", dtype="float32", new_tokens=8, rows=rows)


def speculative_result() -> dict:
    def timed(tokens_per_second):
        return {"tokens_per_second": tokens_per_second, "tokens": 40,
                "seconds_per_repeat": around(40 / tokens_per_second)}

    def transformers(tokens_per_second):
        return {**timed(tokens_per_second), "speedup": tokens_per_second / 20.0, "matches_plain": True}

    def minillm(tokens_per_second, acceptance=math.nan):  # NaN: nothing was drafted
        return {**timed(tokens_per_second), "speedup": tokens_per_second / 30.0, "matches_plain": True,
                "acceptance_rate": acceptance, "tokens_per_target_forward": 1.5,
                "predicted_speedup": math.nan if math.isnan(acceptance) else 1.2}

    task = {"prompt_tokens": 50, "minillm plain": timed(30.0),
            "transformers plain": {**timed(20.0), "matches_minillm": True},
            "contenders": {"minillm prompt-lookup": {1: minillm(45.0, 0.9), 2: minillm(60.0)},
                           "minillm draft dtype:bfloat16": {1: minillm(28.0, 0.95), 2: minillm(31.0, 0.97)},
                           "transformers prompt-lookup": {1: transformers(24.0), 2: transformers(30.0)}}}
    return stamped("speculative", dtype="float32", max_new_tokens=40, ks=[1, 2], verify_cost={1: 1.4, 2: 1.6},
                   draft_cost_ratio={"dtype:bfloat16": 0.7}, tasks={"edit": task})


def lookahead_result() -> dict:
    def entry(tokens_per_second, plain, forward=None):
        row = {"tokens_per_second": tokens_per_second, "tokens_per_second_per_repeat": around(tokens_per_second),
               "matches_plain": True, "speedup": tokens_per_second / plain}
        if forward is not None:
            row.update({"tokens_per_forward": forward, "fed_per_forward": 2 * forward, "draft_share": 0.02,
                        "acceptance_by_depth": {"1": 0.9, "2": 0.5}})
        return row

    settings = {f"{n}x{d}": {"decoding_length": n, "branch_length": d, "speedup": 1.0 + n / 10 + d / 100,
                             "tokens_per_forward": 2.0, "fed_per_forward": 4.0, "draft_share": 0.02,
                             "acceptance_by_depth": {"1": 0.9}} for n in (8, 16) for d in (4, 8)}
    task = {"prompt_tokens": [60, 70], "warm_prompts": 2, "prompts": [],
            "sweep": {"plain_seconds": 2.0, "settings": settings},
            "contenders": {"minillm plain": entry(20.0, 20.0), "minillm prompt-lookup": entry(40.0, 20.0, 2.0),
                           "minillm lookahead (prompt)": entry(50.0, 20.0, 2.6),
                           "minillm lookahead (warm)": entry(60.0, 20.0, 3.3),
                           "transformers plain": entry(25.0, 25.0),
                           "transformers prompt-lookup": entry(35.0, 25.0)}}
    return stamped("lookahead", dtype="float32", max_new_tokens=40, prompt_lookup_k=4, decoding_length=16,
                   branch_length=8, tasks={"grounded": task, "open-ended": task})


def cli_result() -> dict:
    def process(rate, path, first=1.0, seconds=8.0, prefill=0.05):
        return {"seconds": seconds, "seconds_per_repeat": around(seconds), "first_text_seconds": first,
                "prefill_seconds": prefill, "decode_tokens_per_second": rate,
                "decode_tokens_per_second_per_repeat": around(rate), "decode_tokens": 127, "path": path,
                "text": "She opened it."}

    contenders = {"minillm eager": process(30.0, "eager"), "minillm compiled": process(60.0, "compiled"),
                  "minillm gguf eager": process(50.0, "eager"), "minillm gguf compiled": process(110.0, "compiled"),
                  "llama.cpp F32": process(50.0, None), "llama.cpp Q4_1": process(100.0, None),
                  "minillm long-prompt compiled": process(70.0, "compiled", first=1.6, prefill=0.6),
                  "llama.cpp long-prompt F32": process(50.0, None, first=1.1, prefill=0.9)}
    for name in ("minillm compiled", "minillm gguf compiled"):
        contenders[name]["same_text_as_eager"] = True
    for task, plain, lookup in (("open-ended", 40.0, 39.0), ("copy-heavy", 40.0, 100.0)):
        contenders[f"speculative {task} plain"] = process(plain, "compiled")
        contenders[f"speculative {task} prompt-lookup"] = {
            **process(lookup, "compiled"), "tokens_per_target_forward": lookup / 40.0 * 1.5,
            "verified_eagerly": False, "same_text_as_plain": task == "open-ended", "decode_vs_plain": lookup / plain}
    return stamped("cli", quick=False, prompt="The lighthouse keeper had not spoken to anyone", new_tokens=128,
                   threads=2, llama_cpp=None, first_build_seconds={"none": 80.0, "gguf": 70.0}, contenders=contenders,
                   speculative_prompts={"open-ended": "Write a story.", "copy-heavy": "Repeat this text exactly: A."},
                   torch_import_seconds=0.7, torch_import_seconds_per_repeat=[0.6, 0.7, 0.9])


def parallel_result() -> dict:
    def row(predicted, measured, own, collectives):
        return {"tokens_per_second": predicted, "tokens_per_second_own_buses": own,
                "collective_ms_per_step": collectives, "measured_tokens_per_second": measured,
                "measured_tokens_per_second_per_repeat": around(measured), "seconds": 3.0, "text": "It was."}

    alone, split = row(40.0, 38.0, 40.0, 0.0), row(6.0, 4.75, 12.0, 150.0)
    split.update(same_text_as_one_process=True, vs_one_process=4.75 / 38.0)
    return stamped("parallel", quick=False, prompt="The history", new_tokens=64, threads=2,
                   allreduce_us={"3": {"256": 1500.0, "1048576": 2500.0}},
                   contenders={"default --tp 1": alone, "default --tp 3": split})


SYNTHETIC = {"decode": decode_result, "cache-scaling": cache_scaling_result, "batch": batch_result,
             "speculative": speculative_result, "lookahead": lookahead_result, "cli": cli_result,
             "parallel": parallel_result}


@pytest.fixture
def results_dir(tmp_path):
    """A results folder with every suite's synthetic JSON, written as the runner writes it."""
    for suite, make in SYNTHETIC.items():
        write_results(suite, make(), tmp_path)
    return tmp_path


def generated(readme: str) -> str:
    return readme[readme.index(report.BEGIN):readme.index(report.END)]


def flat(text: str) -> str:
    """Prose with its line breaks undone: the report wraps sentences wherever they reach the line length."""
    return " ".join(text.split())


def test_report_quotes_the_json_and_changes_with_it(results_dir):
    first = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert "| FP32 | 44.0 | 20.0 | **2.20x** |" in first
    write_results("decode", decode_result(fp32_minillm=51.2), results_dir)
    second = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert "| FP32 | 51.2 | 20.0 | **2.56x** |" in second
    assert "44.0" not in generated(second)


def test_cli_report_sets_each_process_against_its_llama_cpp_format(results_dir):
    section = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert "| minillm compiled | compiled | 1.00 | 0.05 | 8.00 | 60.0 (54.0-72.0) | 1.20x |" in section
    assert "| minillm gguf compiled | compiled | 1.00 | 0.05 | 8.00 | 110.0 (99.0-132.0) | 1.10x |" in section
    # the long prompt against llama.cpp's on the same prompt, its prefill the processes' own report
    assert "| minillm long-prompt compiled | compiled | 1.60 | 0.60 | 8.00 | 70.0 (63.0-84.0) | 1.40x |" in section
    assert ("start to first text 1.60 s compiled against llama.cpp F32's 1.10 s; its prefill (each process's own "
            "time from the prompt to the first token, the model loaded) 0.60 s against 0.90 s, 1.50x llama.cpp's "
            "rate." in flat(section))
    assert "float32 80 s, gguf 70 s" in section
    assert ("A process that only imports torch took 0.70 s (0.60-0.90 s) in the same rounds: the floor under every "
            "minillm start. The first text came that much later in the compiled runs: compiled 0.30 s, gguf compiled "
            "0.30 s, long-prompt compiled 0.90 s. llama.cpp's processes import no torch." in flat(section))
    # Speculative rows: their own table, each strategy against plain decoding on its prompt, not against llama.cpp.
    assert "| speculative" not in section
    assert "| open-ended | prompt-lookup | 39.0 (35.1-46.8) | 8.00 | 0.97x | 1.46 | yes |" in section
    assert "| copy-heavy | prompt-lookup | 100.0 (90.0-120.0) | 8.00 | 2.50x | 3.75 | NO |" in section
    assert "| copy-heavy | plain | 40.0 (36.0-48.0) | 8.00 | — | 1 | — |" in section


def test_parallel_report_puts_each_prediction_beside_its_measurement(results_dir):
    section = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert "| `--model default --tp 3` | 6.0 | 4.8 (4.3-5.7) | 0.12x | 150.0 | 12.0 | yes |" in section
    assert "| `--model default --tp 1` | 40.0 | 38.0 (34.2-45.6) | — | 0.0 | 40.0 | — |" in section
    assert "One gloo all-reduce on this machine, 256 bytes to 1 MiB: 3 ranks 1.50-2.50 ms." in flat(section)


def test_lookahead_report_quotes_speedups_forwards_and_the_best_setting(results_dir):
    text = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert ("| grounded | 20.0 | 2.00x (2.00) | 2.50x (2.60) | **3.00x (3.30)** | 1.40x |" in text)
    prose = flat(text)
    assert ("grounded: warm lookahead 3.00x plain greedy and 1.50x prompt lookup (prompt-only trie: 2.50x); it feeds "
            "6.6 tokens per forward to gain 3.30, and retrieving drafts takes 2.0% of the time. Best in the sweep (the "
            "first held-out prompt only, one run each): decoding length 16, branch length 8 (2.68x, the default)."
            in prose)
    assert "Every run produced exactly the plain greedy tokens." in prose


def test_report_names_command_machine_and_commit(results_dir):
    text = flat(report.regenerate(TEMPLATE, results_dir, results_dir))
    assert "_`python -m minillm.bench decode` on Test CPU, 4 cores, AVX2, 16 GiB (cpu), torch 2.13.0+cpu" in text
    assert "commit 0123456, 2025-01-02; medians of 3 timed repeats" in text
    dirty = {**decode_result(), "git": {"commit": COMMIT, "dirty": True}}
    write_results("decode", dirty, results_dir)
    assert "commit 0123456 (dirty)" in flat(report.regenerate(TEMPLATE, results_dir, results_dir))
    old = {key: value for key, value in decode_result().items() if key not in ("git", "date")}
    write_results("decode", old, results_dir)
    assert "5.23.0; unknown commit; medians" in flat(report.regenerate(TEMPLATE, results_dir, results_dir))


def test_report_says_which_suite_is_missing(results_dir):
    (results_dir / "batch.json").unlink()
    text = flat(report.regenerate(TEMPLATE, results_dir, results_dir))
    assert ("**Batching**: no results yet. Run `python -m minillm.bench batch`, then "
            "`python -m minillm.bench report`.") in text
    assert "**Decoding at batch 1** (" in text


def test_report_rewrites_only_between_the_markers(results_dir):
    text = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert text.startswith("# x\n\n## Measured speedups\n\nProse.\n\n" + report.BEGIN)
    assert text.endswith(report.END + "\n\n## Next\n\nMore.\n")
    assert "stale" not in text
    assert report.regenerate(text, results_dir, results_dir) == text  # a second run changes nothing


def test_a_lesson_block_holds_only_its_suites(results_dir):
    lesson = ("# Lesson\n\n<!-- generated by python -m minillm.bench report: batch, decode -->\nSTALE TABLE\n"
              + report.END + "\n\nProse.\n")
    text = report.regenerate(lesson, results_dir, results_dir)
    assert "STALE TABLE" not in text and text.endswith(report.END + "\n\nProse.\n")
    assert text.index("**Batching**") < text.index("**Decoding at batch 1**")
    assert "**Speculative decoding**" not in text and "**Cost per token" not in text
    with pytest.raises(ValueError, match="unknown suite 'bacth'"):
        report.regenerate(lesson.replace("batch,", "bacth,"), results_dir, results_dir)


def test_a_gpu_block_quotes_the_device_folder_and_names_the_gpu_and_its_host(results_dir):
    """`--device cuda` results live in results/cuda/ and never replace the CPU's; a block names them 'cuda/decode'."""
    lesson = ("# Lesson\n\n<!-- generated by python -m minillm.bench report: cuda/decode -->\n" + report.END + "\n")
    assert "no results yet. Run `python -m minillm.bench decode --device cuda`" in flat(
        report.regenerate(lesson, results_dir, results_dir))
    gpu = {**decode_result(fp32_minillm=480.0), "machine": {**MACHINE, "device": "cuda", "gpu": "NVIDIA H200"}}
    gpu["prefill"]["seconds"] = {"minillm": 0.0136, "transformers": 0.025}
    write_results("decode", gpu, results_dir / "cuda")
    text = flat(report.regenerate(lesson, results_dir, results_dir))
    assert "**Decoding at batch 1 on cuda** ([plot](cuda/decode.png), [JSON](cuda/decode.json))" in text
    assert "on NVIDIA H200 (host: Test CPU, 4 cores, AVX2, 16 GiB), torch 2.13.0+cpu" in text
    assert "| FP32 | 480.0 | 20.0 |" in text and "minillm 0.014 s, transformers 0.025 s" in text
    assert "kernel launches and the host, not by the bytes" in text  # not the CPU's BF16 sentence
    assert "| FP32 | 44.0 | 20.0 |" in report.regenerate(TEMPLATE, results_dir, results_dir)  # the CPU's stay


def test_a_table_from_another_machine_than_the_decoding_tables_says_so(results_dir):
    assert "Measured on" not in report.regenerate(TEMPLATE, results_dir, results_dir)
    elsewhere = {**batch_result(), "machine": {**MACHINE, "cpu": "Other CPU", "cpu_flags": ["avx512f"]}}
    write_results("batch", elsewhere, results_dir)
    text = flat(report.regenerate(TEMPLATE, results_dir, results_dir))
    assert ("_Measured on Other CPU, 4 cores, AVX-512, not on Test CPU, 4 cores, AVX2 like the decoding tables: "
            "compare its ratios within this table only, until `python -m minillm.bench batch` runs there._") in text
    assert text.count("_Measured on") == 1


def test_the_roofline_share_names_the_spread_of_the_machines_bandwidth_probes(results_dir):
    """One probe on a shared VM swings by half: the decode section's roofline share says what the other suites'
    probes on the same machine measured, and the share at theirs; probes that agree add nothing."""
    alone = flat(report.regenerate(TEMPLATE, results_dir, results_dir))
    assert "The probe swings" not in alone
    probe = decode_result()["memory_bandwidth_gb_s"]
    write_results("cache-scaling", {**cache_scaling_result(), "memory_bandwidth_gb_s": 2 * probe}, results_dir)
    text = flat(report.regenerate(TEMPLATE, results_dir, results_dir))
    share = re.search(r"minillm reaches \*\*(\d+)% of the roofline", text).group(1)
    assert (f"this machine's other suites measured {2 * probe:.0f} GB/s, at which the same speed is "
            f"{round(int(share) / 2)}% of the roofline") in text
    write_results("cache-scaling", {**cache_scaling_result(), "memory_bandwidth_gb_s": 1.05 * probe}, results_dir)
    assert "The probe swings" not in flat(report.regenerate(TEMPLATE, results_dir, results_dir))


def test_a_lesson_readme_does_not_point_at_itself(results_dir):
    """Generated prose names the lesson that explains a point ("(lesson 05)"); inside lesson 05's own README that
    pointer is dropped, and lesson 07's "lesson 07's exercise" reads "this lesson's"."""
    lesson = "# L\n\n<!-- generated by python -m minillm.bench report: decode -->\n" + report.END + "\n"
    elsewhere = report.regenerate(lesson, results_dir, results_dir / "06-kv-cache")
    own = report.regenerate(lesson, results_dir, results_dir / "05-precision")
    assert "(lesson 05)" in flat(elsewhere) and "(lesson 05)" not in flat(own)
    assert flat(own) == flat(elsewhere).replace(" (lesson 05)", "")


def test_report_without_markers_says_how_to_add_them(results_dir):
    with pytest.raises(ValueError, match="no generated section"):
        report.regenerate("# x\n\n## Measured speedups\n\nProse.\n", results_dir, results_dir)


def test_report_handles_undefined_acceptance(results_dir):
    """A NaN acceptance rate (nothing drafted) is null in the JSON and left out of the table, not printed."""
    assert read_json(results_dir / "speculative.json")["tasks"]["edit"]["contenders"]["minillm prompt-lookup"]["2"][
        "acceptance_rate"] is None
    text = report.regenerate(TEMPLATE, results_dir, results_dir)
    assert "| edit | minillm prompt-lookup | 30.0 | 1.50x (0.90) | **2.00x** |" in text
    assert "nan" not in text.lower()


def test_report_check_exits_1_when_stale(results_dir, tmp_path, capsys):
    from minillm.bench.cli import main

    readme = tmp_path / "README.md"
    readme.write_text(TEMPLATE)
    assert main(["report", "--out", str(results_dir), "--readme", str(readme), "--check"]) == 1
    assert readme.read_text() == TEMPLATE
    assert main(["report", "--out", str(results_dir), "--readme", str(readme)]) == 0
    assert main(["report", "--out", str(results_dir), "--readme", str(readme), "--check"]) == 0
    assert "[plot](decode.png)" in readme.read_text()  # links relative to the README


def test_readme_and_lesson_tables_say_what_the_results_say(capsys):
    """The committed README and lesson tables are the committed results, regenerated: none typed, none stale."""
    from minillm.bench.cli import main

    assert main(["report", "--check"]) == 0, capsys.readouterr().out[-2000:]


# --- Plots. ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suite", PLOTS)
def test_plots_draw_committed_and_synthetic_results(suite, tmp_path):
    """Each plot draws results with per-repeat times (spread shown) and older ones without, as a small PNG."""
    sources = {"synthetic": read_json(write_results(suite, SYNTHETIC[suite](), tmp_path))}
    if (RESULTS / f"{suite}.json").exists():
        sources["committed"] = read_json(RESULTS / f"{suite}.json")
    for name, data in sources.items():
        path = tmp_path / f"{suite}-{name}.png"
        PLOTS[suite](data, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size < 200_000, f"{path.name}: {path.stat().st_size} bytes"


def test_speculative_plot_takes_a_notebook_measurement():
    """Notebook 08 plots one task measured in memory: int keys, minillm only, no machine info."""
    data = speculative_result()
    task = data["tasks"]["edit"]
    task["contenders"] = {"minillm prompt-lookup": task["contenders"]["minillm prompt-lookup"]}
    del task["transformers plain"]
    fig = speculative.plot({key: data[key] for key in ("tasks", "model", "dtype", "max_new_tokens")})
    assert len(fig.axes) >= 2


# --- The runner's command line and stamp. ---------------------------------------------------------------------------

def test_help_explains_every_option():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
    assert "report" in parser.format_help()


def test_draft_lengths_parse_and_reject_bad_values(capsys):
    parser = build_parser()
    assert parser.parse_args(["speculative", "--ks", "1,2,4"]).ks == (1, 2, 4)
    for bad in ("0,1", "a", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["speculative", "--ks", bad])
    assert "expected positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["decode", "--ks", "1,2"], ["batch", "--check"], ["report", "--quick"],
                                  ["cache-scaling", "--drafts", "layers:24"]])
def test_options_for_another_command_are_refused(argv, capsys):
    from minillm.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "applies to" in capsys.readouterr().err


def test_a_failing_suite_is_one_line_not_a_traceback(monkeypatch, capsys):
    """A suite that fails (a contender crashing, a missing file) ends the runner with one line and exit 2."""
    from minillm.bench import processes
    from minillm.bench.cli import main

    def fail(args):
        raise RuntimeError("llama.cpp crashed on the Q8_0 file")

    monkeypatch.setattr(processes, "run", fail)
    assert main(["cli", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "minillm: error: llama.cpp crashed on the Q8_0 file"
    assert "Traceback" not in err


def test_a_crashing_llama_cpp_is_caught_before_the_builds(monkeypatch, tmp_path):
    """llama.cpp killed by a signal (its AMX matmul on some Xeons) is named with the fix before minutes of builds."""
    from minillm.bench import processes

    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(processes, "llama_command", lambda path, new_tokens: crash)
    with pytest.raises(RuntimeError, match=r"crashed on the Q4_1 file model\.gguf \(signal 11\).*without AMX"):
        processes.check_llama_runs({"Q4_1": tmp_path / "model.gguf"})
    monkeypatch.setattr(processes, "llama_command", lambda path, new_tokens: [sys.executable, "-c", "pass"])
    processes.check_llama_runs({"Q4_1": tmp_path / "model.gguf"})  # a contender that runs passes


def test_the_llama_cpp_contender_imports_no_torch(tmp_path):
    """llama.cpp's process is charged no torch import: started exactly as the suite starts it (by path), with a
    stand-in llama_cpp package, it streams the tokens, reports its rate in the line the suite parses, and imports
    neither torch nor minillm (nor minillm's own bench/llama_cpp.py, which sits beside it under the same name)."""
    from minillm.bench import processes

    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(
        "class Llama:\n"
        "    def __init__(self, **settings): self.settings = settings\n"
        "    def create_completion(self, prompt, max_tokens, temperature, stream):\n"
        "        return ({'choices': [{'text': f' t{i}'}]} for i in range(max_tokens))\n")
    command = processes.llama_command(tmp_path / "model.gguf", 5, "Hello")
    child = subprocess.run([command[0], "-X", "importtime", *command[1:]], capture_output=True, text=True,
                           check=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert child.stdout == " t0 t1 t2 t3 t4"
    assert processes.STATS.search(child.stderr).group(1) == "4"
    imported = [line.rsplit("|", 1)[-1].strip() for line in child.stderr.splitlines() if line.startswith("import time")]
    assert "llama_cpp" in imported  # the stand-in package
    assert not [name for name in imported if name.split(".")[0] in ("torch", "minillm")]


def test_every_option_is_assigned_to_commands():
    parser = build_parser()
    optional = {action.dest for action in parser._actions if action.option_strings} - {"help", "out"}
    assert optional == set(OPTION_COMMANDS)


def test_git_stamp(tmp_path):
    assert git_stamp(tmp_path) is None  # not a checkout: the results record null
    stamp = git_stamp()
    if stamp is None:
        pytest.skip("the course is not a git checkout here")
    assert re.fullmatch(r"[0-9a-f]{40}", stamp["commit"]) and isinstance(stamp["dirty"], bool)


# --- The strict JSON writer. ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Measurement:
    rate: float
    samples: list


def test_dumps_writes_non_finite_floats_as_null():
    data = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (math.nan, 2),
            "e": Measurement(math.nan, [math.inf, 3.0]), "f": "NaN"}
    parsed = strict_loads(dumps(data))
    assert parsed == {"a": None, "b": [1.5, None, {"c": None}], "d": [None, 2],
                      "e": {"rate": None, "samples": [None, 3.0]}, "f": "NaN"}
    assert strict_loads(dumps(data, allow_nan=True, indent=2)) == parsed  # allow_nan cannot be switched back on


def test_write_json_is_strict_and_atomic(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"x": math.nan, "y": 1})
    assert strict_loads(path.read_text()) == {"x": None, "y": 1}
    with pytest.raises(TypeError):
        write_json(path, {"x": object()})  # not serialisable: the old file stays whole
    assert strict_loads(path.read_text()) == {"x": None, "y": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind


def test_read_json_refuses_nan(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"x": NaN}')
    with pytest.raises(ValueError, match="NaN is not JSON"):
        read_json(path)
