"""Lesson 20 exercises: write your answers here; `pytest lessons/20-parallelism` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/20_parallelism.py (try first!).

Exercises 1-4 simulate the ranks inside one process (a list holds what each rank computes, a sum stands for
the all-reduce), so that every piece can be checked on its own; the notebook runs the same split in real
processes over gloo.
"""

from __future__ import annotations

import torch  # noqa: F401


def megatron_mlp_partials(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, world: int) -> list:
    """Exercise 1: Column then row

    A SwiGLU MLP: h = silu(x @ gate^T) * (x @ up^T), y = h @ down^T, with gate_up [2f, d] holding gate's f rows
    then up's, and down [d, f]. Split it over `world` ranks as Megatron does: rank r keeps hidden units
    r·f/w .. (r+1)·f/w, i.e. those rows of gate AND of up (column-parallel) and those columns of down
    (row-parallel), and computes its product with no message. Return the `world` partial outputs, rank by rank,
    each [..., d]: the all-reduce would add them into y.

    The check adds them against minillm's `MLP` (within 1e-5), and changes every weight rank r does not hold to
    see that rank r's partial does not move.
    """
    raise NotImplementedError


def kv_heads_for(n_head: int, kv_heads: int, world: int, rank: int) -> range:
    """Exercise 2: Heads to ranks

    Rank `rank` of `world` holds query heads rank·n/w .. (rank+1)·n/w (n = n_head); with grouped-query attention
    query head q reads key/value head q // (n_head // kv_heads). Return the key/value heads rank `rank` must
    hold: its share when kv_heads splits evenly, the one head its query heads read when the ranks are a multiple
    of kv_heads (each rank then keeps a copy). Raise ValueError where the split is not allowed: the query heads
    do not divide, or the key/value heads neither split evenly nor repeat evenly.

    The check compares with a brute force (the heads each rank's query heads read) and with the package's
    `minillm.parallel.shard.check_split` over every small shape.
    """
    raise NotImplementedError


def embedding_partials(tokens: torch.Tensor, weight: torch.Tensor, world: int) -> list:
    """Exercise 3: The vocabulary split

    The embedding table weight [V, d] split by rows: rank r holds rows r·c .. min(V, (r+1)·c), c = ceil(V / w)
    (the last rank's share may be short). Each rank looks up the tokens (long, any shape) it holds and gives a
    zero row for the others. Return the `world` partial lookups, rank by rank, each [..., d]: the all-reduce adds
    them, and since one rank holds each token the sum is exact.

    The check adds them against `F.embedding` bit for bit, and changes the rows rank r does not hold to see that
    its partial does not move.
    """
    raise NotImplementedError


def ring_allreduce(tensors: list, send) -> list:
    """Exercise 4: A ring all-reduce

    `tensors`: one 1-D tensor per rank, all of length n, n divisible by p = len(tensors). Compute every rank's
    copy of their sum the way gloo's and NCCL's ring does, passing chunks of n/p values to the next rank only
    through `send(src, chunk)`, which delivers `chunk` from rank src to rank (src + 1) % p and returns what
    arrives. First a reduce-scatter (p - 1 steps: each rank sends one chunk and adds the one it receives, until
    rank r holds the whole sum of one chunk), then an all-gather (p - 1 steps passing the summed chunks on).
    Return the p resulting tensors. Do not modify the inputs.

    The check uses integer-valued floats (so any order of additions is exact), and counts what each rank sent:
    2·(p - 1)/p·n values, in chunks of n/p, whatever p. That count is why an all-reduce's time barely grows with
    the ranks while its number of steps, each a latency, does.
    """
    raise NotImplementedError


def breakeven_latency(alone_seconds: float, ranks: int, buses: int, collectives: int) -> float:
    """Exercise 5: When splitting pays

    A decode step bound by memory takes `alone_seconds` in one process. Split over `ranks` processes on `buses`
    memory buses, each rank reads 1/ranks of the bytes at min(ranks, buses)/ranks of the bandwidth (ranks on one
    bus share it), and then waits in `collectives` all-reduces of latency L each. Return the L at which the split
    step takes exactly as long as one process's: below it the split pays. What is it on one bus?

    The check asks the course's cost model (`sharded_decode_step`, `predict`) for the default model's step at your
    L, on a machine priced by bandwidth alone: it must come out as long as one process's step, shorter at 0.8 L and
    longer at 1.25 L.
    """
    raise NotImplementedError
