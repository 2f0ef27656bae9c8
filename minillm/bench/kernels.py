"""The kernels one compiled decode step runs on a GPU, counted by the profiler (lessons 15 and the decode suite).

A captured batch-1 step of the default model is a few hundred small kernels replayed in
series, so its time is about (kernels) x (time each takes, plus the gap before the next):
counting them, and how long the GPU spends inside them, says whether a step is bound by
the bytes it reads, by the kernels' count, or by the host. `captured_kernels` profiles
one step through the model runner (the path `--compile --device cuda` runs) after the
decode suite's timed rounds: how many kernels, how many copies (the inputs written into
the graph's buffers), the GPU's busy time against the step's wall time, and the kinds of
kernel that take longest.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from ..costmodel.probes import synchronize
from ..decoding.sampling import SamplingConfig
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from .common import quiet_profile

COPIES = ("Memcpy", "Memset")  # the profiler's names for the GPU's copies and fills, which are not kernels


def captured_kernels(model, prompt: list[int], longest: int = 10) -> dict:
    """One compiled decode step after `prompt`, profiled: {"kernels", "copies", "kernel_us" (the GPU busy in
    kernels), "step_us" (the step's wall time, host included), "longest": [[name, count, us], ...]}.

    `model` is what the runner compiles (a model, or its compiled twin with chosen matmuls). On a CPU
    nothing runs on a device: the counts are 0 and only the wall time is filled.
    """
    runner = ModelRunner(model, graph="compiled", max_len=len(prompt) + 8)
    seq = Sequence.create(prompt, SamplingConfig(max_new_tokens=4), vocab_size=model.config.vocab_size,
                          device=model.device)
    runner.prefill([seq])
    seq.tokens.append(1)
    runner.decode([seq])  # warm: the first replay
    runner.rollback([seq])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with quiet_profile(activities=activities) as prof:
        start = time.perf_counter()
        runner.decode([seq])
        synchronize(model.device)
        step_us = (time.perf_counter() - start) * 1e6
    on_device = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [event for event in on_device if not event.name.startswith(COPIES)]
    spent, seen = Counter(), Counter()
    for event in kernels:
        spent[event.name] += event.time_range.elapsed_us()
        seen[event.name] += 1
    return {"kernels": len(kernels), "copies": len(on_device) - len(kernels), "kernel_us": sum(spent.values()),
            "step_us": step_us, "longest": [[name, seen[name], us] for name, us in spent.most_common(longest)]}


def predicted_step(counted: dict, floor_seconds: float, weight_bytes: int, bandwidth: float) -> dict:
    """`counted` (from `captured_kernels`) with the step's predicted milliseconds, from probed constants alone:
    every kernel pays the floor a kernel costs inside a CUDA graph (`measure_graph_kernel_seconds`), and the
    weights stream once at the measured bandwidth, the two in series (an upper estimate: a matmul's stream
    also covers its own floor). The kernels' own profiled durations are not used."""
    launches = counted["kernels"] * floor_seconds
    return {**counted, "floor_us": floor_seconds * 1e6,
            "predicted_ms": 1000 * (launches + weight_bytes / bandwidth),
            "predicted_launch_share": launches / (launches + weight_bytes / bandwidth)}


def counted_and_predicted(model, prompt: list[int], floor_seconds: float, weight_bytes: int, bandwidth: float) -> dict:
    """`captured_kernels` with `predicted_step`'s prediction; where counting fails (a profiler that sees no
    kernels inside graphs, say), {"error": the one-line reason}: the count must not cost the suite its timings."""
    try:
        return predicted_step(captured_kernels(model, prompt), floor_seconds, weight_bytes, bandwidth)
    except Exception as error:  # any failure of the profile: reported in the results, the timed rounds still run
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}


__all__ = ["captured_kernels", "counted_and_predicted", "predicted_step"]
