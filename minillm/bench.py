"""`python -m minillm.bench SUITE`: the course's benchmark runner.

The protocol every suite follows (DESIGN.md): the same model, prompts and settings
for minillm and the reference (transformers, or minillm's unoptimised path);
contenders alternate within one run so that drift in the machine's speed hits
them equally; a warm-up call first; medians of several repeats; results reported
as ratios, with the machine named. Each suite writes `results/<suite>.json` and
`results/<suite>.png`.

A suite is a module in `minillm.benchmarks` with
    run(args) -> dict        # the measurements (JSON-serialisable)
    plot(data, path) -> None # one PNG
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SUITES = {
    "decode": "minillm.benchmarks.decode",
    "cache-scaling": "minillm.benchmarks.cache_scaling",
    "batch": "minillm.benchmarks.batch",
    "speculative": "minillm.benchmarks.speculative",
}
RESULTS = Path(__file__).resolve().parent.parent / "results"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def machine_label(info: dict) -> str:
    """Short machine name for plot titles."""
    if "gpu" in info:
        return info["gpu"]
    return f"{info['cpu'].replace('(R)', '').replace('Intel Xeon', 'Xeon')}, {info['cores']} cores"


def synchronize(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measure_memory_bandwidth(gib: float = 1.0, repeats: int = 10, device: str = "cpu") -> float:
    """Peak read bandwidth in bytes/s: the fastest of `repeats` torch.sum calls over `gib` GiB.

    A roofline asks what the memory system can deliver at best, so this takes the
    fastest pass rather than the median: on a shared VM the median swings with the
    neighbours' load (we saw 38-69 GB/s), while the best pass is far steadier.
    """
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t = time.perf_counter()
        x.sum()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / min(times[1:])


def alternate(contenders: dict, repeats: int = 3, warmup: int = 1) -> dict[str, list[float]]:
    """Call each contender (a no-argument function returning seconds or None) in turn.

    Round-robin over `repeats` rounds after `warmup` rounds, so slow drift in the
    machine's speed affects every contender alike. A contender that returns a number
    reports its own time (e.g. decode time without prefill); otherwise wall time is used.
    """
    times = {name: [] for name in contenders}
    for round_ in range(warmup + repeats):
        for name, fn in contenders.items():
            t = time.perf_counter()
            reported = fn()
            elapsed = time.perf_counter() - t
            if round_ >= warmup:
                times[name].append(reported if isinstance(reported, (int, float)) else elapsed)
    return times


def median(values) -> float:
    return statistics.median(values)


def write_results(suite: str, data: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES), help="which benchmark to run")
    p.add_argument("--model", default="default", help="model name or path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="a small, fast version (what the notebooks and tests run)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per contender (median reported)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG (default: results/)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUITES[args.suite])
    try:
        data = module.run(args)
    except KeyboardInterrupt:
        print("\nminillm.bench: interrupted", file=sys.stderr)
        return 130
    data = {"suite": args.suite, "machine": machine_info(args.device), "command": " ".join(["python -m minillm.bench"] + (argv or sys.argv[1:])), **data}
    json_path = write_results(args.suite, data, args.out)
    png_path = args.out / f"{args.suite}.png"
    module.plot(data, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
