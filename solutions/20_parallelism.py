"""Worked answers to lesson 20's exercises (`pytest lessons/20-parallelism --solutions` checks them)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def megatron_mlp_partials(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, world: int) -> list:
    """Exercise 1: Column then row"""
    f = down.shape[1]
    per = f // world
    partials = []
    for r in range(world):
        units = slice(r * per, (r + 1) * per)
        gate, up = gate_up[:f][units], gate_up[f:][units]  # column-parallel: this rank's rows of both halves
        h = F.silu(x @ gate.T) * (x @ up.T)  # [..., f/w]: whole hidden units, no message needed
        partials.append(h @ down[:, units].T)  # row-parallel: a partial sum over this rank's units
    return partials
    # Splitting gate and up by the same units is what makes the pair message-free: silu(gate)·up multiplies a
    # unit's gate by the same unit's up, so both must live on one rank. Split down by its rows instead and each
    # rank would need every unit's h: an all-gather in the middle of the MLP.


def kv_heads_for(n_head: int, kv_heads: int, world: int, rank: int) -> range:
    """Exercise 2: Heads to ranks"""
    if n_head % world:
        raise ValueError(f"{world} ranks do not divide {n_head} query heads")
    if kv_heads % world == 0:  # as many key/value heads as ranks or more: split them like the queries
        per = kv_heads // world
        return range(rank * per, (rank + 1) * per)
    if world % kv_heads == 0:  # fewer: the one head this rank's query heads read, kept on each rank that reads it
        first = rank * (n_head // world) // (n_head // kv_heads)
        return range(first, first + 1)
    raise ValueError(f"{kv_heads} key/value heads neither split evenly over {world} ranks nor repeat evenly")


def embedding_partials(tokens: torch.Tensor, weight: torch.Tensor, world: int) -> list:
    """Exercise 3: The vocabulary split"""
    V = weight.shape[0]
    per = math.ceil(V / world)
    partials = []
    for r in range(world):
        start, stop = r * per, min(V, (r + 1) * per)
        mine = (tokens >= start) & (tokens < stop)
        rows = F.embedding(torch.where(mine, tokens - start, 0), weight[start:stop])  # index 0 stands in, masked
        partials.append(rows * mine[..., None].to(rows.dtype))
    return partials


def ring_allreduce(tensors: list, send) -> list:
    """Exercise 4: A ring all-reduce"""
    p = len(tensors)
    chunks = [list(t.clone().chunk(p)) for t in tensors]  # chunks[r][c]: rank r's copy of chunk c
    for step in range(p - 1):  # reduce-scatter: rank r sends chunk (r - step) and adds chunk (r - step - 1)
        arriving = [send(r, chunks[r][(r - step) % p]) for r in range(p)]
        for r in range(p):
            c = (r - 1 - step) % p
            chunks[r][c] = chunks[r][c] + arriving[(r - 1) % p]
    # now rank r holds the whole sum of chunk (r + 1) % p
    for step in range(p - 1):  # all-gather: pass the finished chunks on around the ring
        arriving = [send(r, chunks[r][(r + 1 - step) % p]) for r in range(p)]
        for r in range(p):
            chunks[r][(r - step) % p] = arriving[(r - 1) % p]
    return [torch.cat(parts) for parts in chunks]


def breakeven_latency(alone_seconds: float, ranks: int, buses: int, collectives: int) -> float:
    """Exercise 5: When splitting pays"""
    split_reading = alone_seconds / min(ranks, buses)  # 1/ranks of the bytes at min(ranks, buses)/ranks the rate
    return (alone_seconds - split_reading) / collectives
    # On one bus min(ranks, buses) = 1: the split reads as long as one process does, so any latency above zero
    # makes it slower. Two cores sharing one memory bus cannot gain from tensor parallelism; it pays where each
    # rank brings memory bandwidth (and capacity) of its own: GPUs, or sockets.
