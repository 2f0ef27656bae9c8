"""The engine's decode step on a GPU: compiled once in the process, recorded per bucket of rows and blocks (lesson 15).

On a CPU the engine's step over the paged pool is one kept package whose sizes stay
symbolic (`PagedShape`): its C++ loops read the rows and blocks at each call. A CUDA graph
cannot: it replays the launches it recorded, sizes and addresses included. So a GPU
serves as nano-vllm does: the step is compiled once with its sizes symbolic, then recorded
once per bucket, each bucket a fixed number of rows (2, 4, 8, ... up to the engine's most
sequences) and of blocks per row (2, 4, ... up to a sequence's longest table). A step is
padded up to its bucket and replayed:

    rows past the step's      token 0 at position 0, its key written to the scratch block (a block
                              the pool holds beyond those the block manager hands out), its table
                              all scratch: whatever it computes is dropped
    blocks past a row's       the scratch block: past the row's position, so the mask hides it
    table

so a replay's real rows are the unpadded step's. Buckets start at 2: a size of 1 would be
compiled apart (torch.compile specializes sizes 0 and 1), and padding a lone row to two
costs a GPU nothing it would notice. Every bucket is recorded before the first request
(`record_all`), so nothing is compiled or recorded while serving.

Off a GPU the same padding runs the compiled step directly (nothing is recorded): what the
CPU's tests check, against the eager engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def buckets_up_to(most: int) -> list[int]:
    """2, 4, 8, ... up to the first power of two that holds `most`."""
    sizes = [2]
    while sizes[-1] < most:
        sizes.append(sizes[-1] * 2)
    return sizes


def bucket(size: int, sizes: list[int]) -> int:
    """The smallest bucket that holds `size`."""
    fits = [s for s in sizes if s >= size]
    if not fits:
        raise ValueError(f"a step of {size} exceeds the largest bucket recorded ({sizes[-1]}): the engine's limits "
                         f"and the runner's buckets disagree")
    return fits[0]


class BucketedPagedStep:
    """`step(tokens, positions, slots, tables, keys, values)` (`PagedDecodeStep.forward`'s inputs) padded to its
    bucket and run through the step recorded for that bucket; logits [B, 1, V] of the real rows.

    step: the compiled paged step (symbolic sizes); record(step, inputs, keys, values) -> a callable taking
    (*inputs, keys, values): `CapturedStep` on a GPU, None to run `step` directly; keys, values: the pool's
    per-layer blocks the recordings are made over; scratch_block: the pool's block no sequence owns.
    """

    def __init__(self, step, keys, values, scratch_block: int, block_size: int, most_rows: int, most_blocks: int,
                 record=None):
        self.step, self.keys, self.values, self.record = step, keys, values, record
        self.scratch_block, self.block_size = scratch_block, block_size
        self.row_buckets, self.block_buckets = buckets_up_to(most_rows), buckets_up_to(most_blocks)
        self.recorded = {}  # (rows, blocks) -> what runs a step of that bucket

    def padded(self, tokens, positions, slots, tables, rows: int, blocks: int) -> tuple:
        """The step's inputs grown to `rows` x `blocks`: extra rows and extra table entries on the scratch block."""
        extra_rows, extra_blocks = rows - tables.shape[0], blocks - tables.shape[1]
        scratch_slot = self.scratch_block * self.block_size
        return (F.pad(tokens, (0, 0, 0, extra_rows)), F.pad(positions, (0, 0, 0, extra_rows)),
                F.pad(slots, (0, extra_rows), value=scratch_slot),
                F.pad(tables, (0, extra_blocks, 0, extra_rows), value=self.scratch_block))

    def example(self, rows: int, blocks: int) -> tuple:
        """Inputs of a bucket's recording: every row on the scratch block (what a recording writes is dropped)."""
        device = self.keys[0].device
        empty = torch.zeros(0, 1, dtype=torch.long, device=device)
        return self.padded(empty, empty, empty.view(0), empty.view(0, 0), rows, blocks)

    def runs(self, rows: int, blocks: int):
        if (rows, blocks) not in self.recorded:
            if self.record is None:
                self.recorded[rows, blocks] = self.step
            else:
                self.recorded[rows, blocks] = self.record(self.step, self.example(rows, blocks), self.keys,
                                                          self.values)
        return self.recorded[rows, blocks]

    def record_all(self, progress: bool = True) -> None:
        """Record every bucket now (largest first, as nano-vllm does, so the big ones set the memory aside first)."""
        pairs = [(r, b) for r in reversed(self.row_buckets) for b in reversed(self.block_buckets)]
        for rows, blocks in tqdm(pairs, desc="captured steps", unit="graph", disable=not progress, leave=False):
            self.runs(rows, blocks)

    def __call__(self, tokens, positions, slots, tables, keys, values) -> torch.Tensor:
        rows, blocks = bucket(tables.shape[0], self.row_buckets), bucket(tables.shape[1], self.block_buckets)
        inputs = self.padded(tokens, positions, slots, tables, rows, blocks)
        return self.runs(rows, blocks)(*inputs, keys, values)[: tables.shape[0]]


__all__ = ["BucketedPagedStep", "bucket", "buckets_up_to"]
