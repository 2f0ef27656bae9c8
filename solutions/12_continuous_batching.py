"""Worked solutions to lesson 12's exercises (`pytest lessons/12-continuous-batching --solutions` checks them)."""

from __future__ import annotations

import torch


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    index = position // block_size
    if index >= len(block_table):
        raise ValueError(f"position {position} needs block {index}, but the table has {len(block_table)} blocks")
    return block_table[index] * block_size + position % block_size


def gather_keys(pool: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    block_size = pool.shape[1]
    flat = pool.flatten(0, 1)  # [num_blocks * block_size, KV, hd]: row = slot
    slots = torch.tensor([slot_of(block_table, p, block_size) for p in range(length)], dtype=torch.long)
    return flat[slots].transpose(0, 1)  # [KV, length, hd]


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


def packed_mask(lengths: list[int]) -> torch.Tensor:
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [N]: sequence of each token
    N = len(owner)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    return causal & (owner[:, None] == owner[None, :])


def packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


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
