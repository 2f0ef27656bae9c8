"""`python -m minillm.bench.cost`: the cost model's machine constants, measured by its probes, into results/cost.json.

The model and the probes live in `minillm.costmodel` (lessons and benchmarks both import them); this runner
stamps the constants like every suite's results, and `results_machine` reads back the constants of the
machine that wrote results/.
"""

from __future__ import annotations

import argparse

from ..costmodel.model import SMOLLM2_135M, Machine, forward_flops
from ..costmodel.probes import measure_machine
from ..model.config import ModelConfig
from .cli import provenance, write_results
from .common import RESULTS, machine_info


def results_machine(decode: dict, cost: dict, bandwidth_gb_s: float | None = None,
                    config: ModelConfig = SMOLLM2_135M) -> Machine:
    """The constants of the machine that wrote results/: what its suites stored.

    Bandwidth: the suite's own probe (`bandwidth_gb_s`, else the decode suite's). Peak flops: the
    rate of the decode suite's prefill, a compute-bound step (no suite stores a matmul probe).
    Op and sync costs: `results/cost.json` (`python -m minillm.bench.cost`).
    """
    prefill = decode["prefill"]
    peak = forward_flops(config, prefill["tokens"], prefill["tokens"]) / prefill["seconds"]["minillm"]
    constants = cost["machine_constants"]
    return Machine((bandwidth_gb_s or decode["memory_bandwidth_gb_s"]) * 1e9, peak, constants["op_us"] * 1e-6,
                   constants["sync_us"] * 1e-6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.cost",
                                     description="Measure the cost model's machine constants into results/cost.json")
    parser.add_argument("--quick", action="store_true", help="shorter probes (noisier)")
    args = parser.parse_args(argv)
    machine = measure_machine(args.quick)
    constants = {"bandwidth_gb_s": machine.bandwidth / 1e9, "peak_gflops": machine.peak_flops / 1e9,
                 "op_us": machine.op_seconds * 1e6, "sync_us": machine.sync_seconds * 1e6}
    stamp = provenance(["cost", *(["--quick"] if args.quick else [])])
    stamp["command"] = stamp["command"].replace("minillm.bench cost", "minillm.bench.cost")
    path = write_results("cost", {"suite": "cost", "machine": machine_info(), **stamp,
                                  "machine_constants": constants}, RESULTS)
    print(", ".join(f"{name} {value:.3g}" for name, value in constants.items()), f"-> {path}")
    return 0


__all__ = ["results_machine", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
