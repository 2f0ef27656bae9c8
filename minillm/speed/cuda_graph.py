"""One step recorded as a CUDA graph and replayed: a decode step in one launch on a GPU (lesson 15).

An eager decode step on a GPU is some 850 kernel launches, each a few microseconds of
Python and driver work for a kernel that runs for about as long: the GPU sits idle
most of the step waiting for the next launch. A CUDA graph records the kernels one
call launches, with the memory they read and write, and replays all of them with one
launch. Nothing on the host runs during a replay, so a recorded step may not depend
on host values, and every tensor it touches must stay where it was when it was
recorded: the inputs are copied into buffers the graph owns, the KV cache is the
runner's own storage (written in place, `ColumnWrites`), and the logits come back in
the graph's output buffer, copied out before the next replay overwrites them.

This is the recipe of nano-vllm's model runner (one graph per batch size, recorded
once at start), written out by hand rather than through torch.compile's
mode="reduce-overhead", whose graph trees re-record or fall back to launching kernels
one by one when an input that the step writes (the cache) is not a module buffer.
"""

from __future__ import annotations

import torch


class CapturedStep:
    """`step(*inputs, keys, values)` recorded once over this cache; call it with new inputs of the same shapes.

    inputs: the step's tensors before the cache (tokens, positions, columns, mask, logits_at
    or None), each [B, T, ...]; keys, values: the cache's per-layer storage, which the graph
    reads and writes where it lies (a new cache needs a new recording). pool: a memory pool
    shared with other recordings (`torch.cuda.graph_pool_handle()`), as the engine's buckets
    share one: safe because one step runs at a time and its output is copied out at once.
    """

    WARMUP = 2  # calls before recording: the first compiles, both settle the allocator and the kernels' caches

    def __init__(self, step, inputs, keys, values, pool=None):
        self.step, self.keys, self.values = step, keys, values
        self.inputs = [None if t is None else t.clone() for t in inputs]  # the graph reads these buffers
        # output: [B, K, V], rewritten by every replay
        self.graph, self.output = recorded(lambda: step(*self.inputs, keys, values), self.WARMUP, pool)

    def __call__(self, *args) -> torch.Tensor:
        """args: `CacheStep.forward`'s; logits [B, K, V], a copy the next replay leaves alone."""
        *inputs, keys, values = args
        if keys[0].data_ptr() != self.keys[0].data_ptr():
            raise RuntimeError("this CUDA graph was recorded over another cache: prepare the step again for this one")
        for buffer, new in zip(self.inputs, inputs):
            if buffer is not None:
                buffer.copy_(new)
        self.graph.replay()
        return self.output.clone()


def recorded(call, warmup: int, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(the CUDA graph of what `call()` launches, its output): run `warmup` times first off the main stream, as
    capture requires (the first call compiles or loads kernels, the rest settle the allocator), then recorded."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = call()
    return graph, output


__all__ = ["CapturedStep", "recorded"]
