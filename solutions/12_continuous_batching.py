"""Worked solutions to lesson 12's exercises (`pytest lessons/12-continuous-batching --solutions` checks them)."""

from __future__ import annotations

import math


class FreeList:
    """Blocks and their holders: a stack of free block ids and a reference count per block."""

    def __init__(self, num_blocks: int):
        self.counts = [0] * num_blocks
        self.free_stack = list(range(num_blocks - 1, -1, -1))  # the top is the end of the list: 0 first

    def allocate(self) -> int:
        if not self.free_stack:
            raise RuntimeError(f"all {len(self.counts)} blocks are held: free or preempt a sequence first")
        block = self.free_stack.pop()
        self.counts[block] = 1
        return block

    def fork(self, block: int) -> None:
        if self.counts[block] == 0:
            raise ValueError(f"block {block} is free: only a held block can be shared")
        self.counts[block] += 1

    def free(self, block: int) -> None:
        if self.counts[block] == 0:
            raise ValueError(f"block {block} is already free (a double free)")
        self.counts[block] -= 1
        if self.counts[block] == 0:
            self.free_stack.append(block)

    def ref_count(self, block: int) -> int:
        return self.counts[block]

    def num_free(self) -> int:
        return len(self.free_stack)


def make_free_list(num_blocks: int) -> FreeList:
    """Exercise 1: A free list with reference counts"""
    return FreeList(num_blocks)
    # Why a count and not a flag: a block two sequences share (a prefix hit, a beam fork) must outlive the first
    # holder's free; it is free only when the last holder lets go. A double free is a bug upstream (a sequence
    # freed twice would hand its blocks to two others), so it raises instead of pushing the block twice.
    # Why a stack: the block freed last is reused first. BlockManager does the same for blocks that hold nothing
    # reusable (it moves them to the front of its free list), and keeps blocks that still hold a cached prefix at
    # the back, reused oldest first, so the prefix cache loses its least recently used prefixes first. Freeing a
    # sequence's blocks last block first means its first block ends on top: the next sequence gets the same
    # table in the same order.


def blocks_held(prompts: list[list[int]], block_size: int) -> int:
    cached = set()  # the prefixes (as tuples) that end at a full block already in the pool
    held = 0
    for prompt in prompts:
        n_blocks = -(-len(prompt) // block_size)
        shareable = (len(prompt) - 1) // block_size  # full blocks before the one holding the last token
        hits = 0
        while hits < shareable and tuple(prompt[: (hits + 1) * block_size]) in cached:
            hits += 1
        held += n_blocks - hits
        for i in range(len(prompt) // block_size):  # every full block of this prompt can be hit later
            cached.add(tuple(prompt[: (i + 1) * block_size]))
    return held


def ridge_batch(weight_bytes: float, bytes_per_second: float, flops_per_token: float,
                flops_per_second: float) -> int:
    """Exercise 3: When batching stops paying"""
    reading = weight_bytes / bytes_per_second  # seconds per step, whatever the batch
    per_token = flops_per_token / flops_per_second  # seconds of arithmetic per request in the step
    return max(1, math.ceil(reading / per_token))
    # step(B) = max(reading, B * per_token), so tokens/s = B / step(B) rises B-fold up to B* = reading / per_token
    # and is flat (1 / per_token) after it. B* is the machine's balance (flops per byte) divided by the model's
    # arithmetic intensity at batch 1 (flops_per_token / weight_bytes: 2 flops per parameter, 4 bytes in FP32,
    # so 0.5 flop per byte). A GPU streams ~3 TB/s and multiplies at ~500 TFLOP/s (BF16): B* is in the hundreds.
    # On the course's machine (results/batch.json, eager FP32) the batch-1 step reads at <!-- figure: decode.results.float32.weight_bytes * batch.rows.find(batch=1).minillm.decode_per_second / 1e9 | .1f -->24.8<!-- /figure --> GB/s
    # and batch 32 multiplies at <!-- figure: decode.results.float32.weight_bytes / 2 * batch.rows.find(batch=32).minillm.decode_per_second / 1e9 | .0f -->169<!-- /figure --> GFLOP/s, so
    # B* = <!-- figure: batch.rows.find(batch=32).minillm.decode_per_second / batch.rows.find(batch=1).minillm.decode_per_second | .1f -->13.7<!-- /figure --> (batch 32's decode rate over batch 1's), rounded up.
    # That B* is a lower bound: the arithmetic rate comes from batch 32, where throughput still grows (16 -> 32:
    # <!-- figure: batch.rows.find(batch=32).minillm.decode_per_second / batch.rows.find(batch=16).minillm.decode_per_second | .2f -->1.30<!-- /figure -->x), so the stored curve does not reach this machine's ridge.
    # A serving engine's batch limit (max_num_seqs) pays up to the ridge; beyond it a bigger batch makes every
    # request slower and the machine no faster. Real curves bend smoothly (the step is neither purely one nor the
    # other near the ridge), so the measured throughput gains less than 2x per doubling well before it: one row to
    # two gains <!-- figure: batch.rows.find(batch=2).minillm.decode_per_second / batch.rows.find(batch=1).minillm.decode_per_second | .2f -->1.90<!-- /figure -->x, nearly the full doubling, but two to four only
    # <!-- figure: batch.rows.find(batch=4).minillm.decode_per_second / batch.rows.find(batch=2).minillm.decode_per_second | .2f -->2.06<!-- /figure -->x and four to eight <!-- figure: batch.rows.find(batch=8).minillm.decode_per_second / batch.rows.find(batch=4).minillm.decode_per_second | .2f -->1.66<!-- /figure -->x.


def machine_from_results(rows: list[dict], weight_bytes: float, flops_per_token: float) -> tuple[float, float]:
    """Exercise 3: When batching stops paying"""
    decode = {row["batch"]: row["minillm"]["decode_per_second"] for row in rows}
    bytes_per_second = weight_bytes * decode[1]  # one step a token, one weight read a step
    flops_per_second = flops_per_token * decode[max(decode)]  # every token of the step costs flops_per_token
    return bytes_per_second, flops_per_second
    # Both are effective rates, not the hardware's peaks: the batch-1 step reads at
    # <!-- figure: decode.results.float32.weight_bytes * batch.rows.find(batch=1).minillm.decode_per_second / 1e9 / decode.memory_bandwidth_gb_s | .0% -->30%<!-- /figure --> of the
    # <!-- figure: decode.memory_bandwidth_gb_s | .0f -->83<!-- /figure --> GB/s the decode suite's read probe measured
    # (the step does more than stream weights), and the arithmetic rate is what these skinny matrix products reach
    # at batch 32 on two cores, a lower bound on their peak while throughput still grows there. The ridge they
    # predict is therefore a lower bound on where this code on this machine stops gaining, which is the question a batch limit answers.


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def serving_metrics(arrivals: list[float], token_times: list[list[float]]) -> dict:
    ttft = [times[0] - a for a, times in zip(arrivals, token_times)]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times if len(times) > 1]
    itl = [b - a for times in token_times for a, b in zip(times, times[1:])]
    e2e = [times[-1] - a for a, times in zip(arrivals, token_times)]
    span = max(times[-1] for times in token_times) - min(arrivals)
    out = {name: (_percentile(values, 50), _percentile(values, 99))
           for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e))}
    out["tokens_per_second"] = sum(map(len, token_times)) / span
    return out


def admit(waiting: list[int], running: int, free_blocks: int, num_blocks: int, block_size: int, budget: int,
          max_num_seqs: int, watermark: float) -> list[int]:
    kept_free = int(watermark * num_blocks)
    fed = []
    for length in waiting:
        if budget <= 0 or running >= max_num_seqs:
            break
        needed = math.ceil(length / block_size)
        if needed > free_blocks - (kept_free if running else 0):
            break  # first come, first served: nobody overtakes the head of the queue
        free_blocks, running = free_blocks - needed, running + 1
        fed.append(min(length, budget))
        budget -= fed[-1]
    return fed
