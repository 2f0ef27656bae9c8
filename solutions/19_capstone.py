"""Worked answers for lesson 19 (checked by `pytest lessons/19-capstone --solutions`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons" / "19-capstone"))
from engine import BlockPool


def penalize_repeats(logits: torch.Tensor, tokens: list[int], penalty: float) -> torch.Tensor:
    """Exercise 1: A repetition penalty"""
    seen = torch.zeros(logits.shape, dtype=torch.bool)
    seen[torch.tensor(tokens, dtype=torch.long)] = True  # each token once, however often it occurs
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)  # always towards "less likely"
    # With a processor the chosen token depends on the tokens before it, so a draft could not be
    # checked against one forward's logits: the engine decodes such a request one token at a time.
    return torch.where(seen, penalised, logits)


def stop_at(text: str, stops: list[str]) -> str | None:
    """Exercise 2: Stop strings"""
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    # Checked after every token: a verified draft may run past the stop string, and the request must
    # end at the token that completed it (its generated tokens, not just its text, are the answer).
    return text[:min(found)] if found else None


class PrefixCachingPool(BlockPool):
    """The free list with a holder count per block and a cache of full blocks by the prefix they end."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.holders = [0] * num_blocks
        self.cached: dict[tuple[int, ...], int] = {}  # tokens[:end] -> the block holding tokens[end - bs:end]
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    def allocate(self) -> int:
        block = super().allocate()
        self.holders[block] = 1
        return block

    def free(self, block: int) -> None:
        self.holders[block] -= 1
        if self.holders[block] == 0:
            self.cached.pop(self.prefix_of.pop(block, None), None)
            super().free(block)

    def admit(self, tokens: list[int]) -> tuple[list[int], int]:
        # A key depends on every token before it, not only on its block's: the prefix is the key.
        table, cached = [], 0
        for end in range(self.block_size, len(tokens), self.block_size):  # full blocks before the last token
            prefix = tuple(tokens[:end])
            block = self.cached.get(prefix) if cached == end - self.block_size else None  # a prefix ends at a miss
            if block is not None:
                self.holders[block] += 1
                cached = end
            else:
                block = self.allocate()
                self.cached[prefix], self.prefix_of[block] = block, prefix
            table.append(block)
        return table, cached


def prefix_caching_pool(num_blocks: int, block_size: int) -> PrefixCachingPool:
    """Exercise 3: Prefix caching"""
    return PrefixCachingPool(num_blocks, block_size)
