"""llama.cpp's own benchmark program, `llama-bench`, as a decode contender where llama-cpp-python is not built.

The suites that compare against llama.cpp on a CPU load it through llama-cpp-python
(`minillm.bench.llama_cpp`). A GPU machine of the course has no network and takes 64 MiB
per upload, so llama-cpp-python is not built there; its vendored llama.cpp builds
`llama-bench` with CUDA in minutes instead (`../shared/gpu/llama_src.sh` stages it; `.ci/gpu`
builds it and runs the suite there). Given that program (`python -m minillm.bench decode
--llama-bench PATH`), the decode suite times llama.cpp on the same weights (the GGUF as F32 for
the float32 rows, as BF16 for bfloat16, as Q8_0 for int8: `gguf_as`; as stored for int4 and the
GGUF's own blocks) in the same alternated rounds as minillm and transformers. Each round is one
`llama-bench` process that generates the suite's new tokens once after a context of the
suite's prompt length (`-n N -d P -p 0 -r 1`; every layer on the GPU there, `-ngl 99`), and
its report's tokens per second (`avg_ts`, which times generation alone) becomes the seconds
of the N - 1 steps after the first token, the span the other contenders' clocks time.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

GGUF_TYPE = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0"}  # the llama.cpp file a section is compared against
QUANTIZED = ("int8", "int4", "gguf")  # the decode suite's quantized sections; int4 and gguf against the GGUF as stored


def llama_bench_problem(program: Path | None) -> str | None:
    """None when `program` runs as llama-bench; otherwise, in one line, why it cannot be used."""
    if program is None:
        return "no --llama-bench PATH given (llama.cpp's benchmark program; ../shared/gpu/llama_src.sh builds it)"
    if not Path(program).is_file():
        return f"--llama-bench {program}: no such file"
    try:
        shown = subprocess.run([str(program), "--help"], capture_output=True, text=True, timeout=60)
    except OSError as error:
        return f"--llama-bench {program} does not run: {error}"
    if "--n-gen" not in shown.stdout + shown.stderr:
        return f"--llama-bench {program} is not llama.cpp's llama-bench (its --help names no --n-gen)"
    return None


def llama_bench_command(program: Path, gguf: Path, context: int, new_tokens: int, device: str,
                        threads: int) -> list[str]:
    """One generation of `new_tokens` after `context` tokens, reported as JSON; every layer on the GPU on one."""
    layers = "99" if str(device).startswith("cuda") else "0"
    return [str(program), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", str(context), "-r", "1",
            "-ngl", layers, "-t", str(threads), "-o", "json"]


def generation_rate(report: str, new_tokens: int) -> float:
    """Tokens per second of the generation test in a llama-bench JSON report (a list of tests)."""
    tests = [test for test in json.loads(report) if test.get("n_gen") == new_tokens and not test.get("n_prompt")]
    if len(tests) != 1:
        raise ValueError(f"llama-bench reported {len(tests)} generation tests of {new_tokens} tokens, not one")
    return float(tests[0]["avg_ts"])


class LlamaBench:
    """llama-bench on one GGUF, as a contender of `alternate`: each call one process, its decode seconds returned."""

    def __init__(self, program: Path, gguf: Path, context: int, new_tokens: int, device: str, threads: int):
        self.command = llama_bench_command(program, gguf, context, new_tokens, device, threads)
        self.new_tokens = new_tokens

    def __call__(self) -> float:
        """Seconds for the new_tokens - 1 steps after the first token, at llama-bench's measured rate."""
        done = subprocess.run(self.command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"llama-bench exited with status {done.returncode}: {last}")
        return (self.new_tokens - 1) / generation_rate(done.stdout, self.new_tokens)


__all__ = ["GGUF_TYPE", "QUANTIZED", "LlamaBench", "generation_rate", "llama_bench_command", "llama_bench_problem"]
