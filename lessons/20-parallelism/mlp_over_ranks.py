"""Lesson 20 by hand: every MLP of the real model split over the ranks torchrun starts, attention left whole.

    torchrun --nproc-per-node 2 lessons/20-parallelism/mlp_over_ranks.py OUT.pt "a prompt"

Each rank keeps its share of every block's hidden units (gate's and up's rows, down's columns:
Megatron's column-then-row pair) and completes each block's MLP with one all-reduce of the
partial sums. The default model's 9 attention heads do not split over 2 ranks, so every rank
computes attention whole here (the package's `--tp 3` splits the heads too). Rank 0 writes the
prompt's last logits and 12 greedy tokens to OUT.pt, for the notebook to compare with one process.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minillm import load_model


class MLPShare(nn.Module):
    """This rank's hidden units of a SwiGLU MLP: its output is a partial sum until the all-reduce adds the rest."""

    def __init__(self, mlp, rank: int, world: int):
        super().__init__()
        hidden = mlp.proj.in_features
        units = slice(rank * hidden // world, (rank + 1) * hidden // world)
        self.gate = mlp.fc.weight[:hidden][units].clone()  # column-parallel: whole hidden units,
        self.up = mlp.fc.weight[hidden:][units].clone()  # the same ones in both halves
        self.down = mlp.proj.weight[:, units].clone()  # row-parallel: those units' columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(x @ self.gate.T) * (x @ self.up.T)  # [B, T, hidden / world], no message needed
        y = h @ self.down.T  # [B, T, d_model]: this rank's part of the sum over hidden units
        dist.all_reduce(y)  # every rank sends its part and gets the total
        return y


def main(out: str, prompt: str, new_tokens: int = 12) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
    model, tokenizer = load_model("default", fast=False)  # the plain model: its weights as nn.Linear
    for block in model.blocks:
        block.mlp = MLPShare(block.mlp, rank, world)
    ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        tokens = list(ids)
        for _ in range(new_tokens):  # greedy, recomputing the whole row each time: the split is the point here
            step = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], last_only=True)
            tokens.append(int(step[0, -1].argmax()))  # every rank holds the same logits: the same choice
    if rank == 0:
        torch.save({"world": world, "last_logits": logits, "tokens": tokens[len(ids):]}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
