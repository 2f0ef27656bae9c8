"""The process group tensor parallelism runs in: who this process is, and the collective calls' backend.

Every rank is an ordinary Python process running the same program; `torch.distributed`
connects them (gloo over local sockets on a CPU, NCCL on GPUs) and carries the
all-reduces and all-gathers the sharded layers need. A launcher (`torchrun`, or the
command line's own `--tp`) starts the processes and tells each its place through the
environment: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun sets them.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """This process's place: `rank` of `world` processes, over `backend` ("gloo" or "nccl")."""

    rank: int
    world: int
    backend: str

    @property
    def leader(self) -> bool:
        """Rank 0: the one that prints, writes files and answers requests; the others compute beside it."""
        return self.rank == 0


def launched_world() -> int | None:
    """The WORLD_SIZE a launcher (torchrun, or `--tp`'s own) gave this process, or None when started alone."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def join(device: str = "cpu", threads: int | None = None, timeout: float = 600) -> Group:
    """Join the group the launcher described in the environment (idempotent), and compute with this rank's share of
    the cores: ranks on one machine split its cores, as llama.cpp's and vLLM's CPU workers do, so that `world`
    processes do not each start one thread per core and fight over them. A collective that waits `timeout` seconds
    for a rank fails rather than waiting forever (torch's default: 30 minutes)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=timeout))
    group = Group(dist.get_rank(), dist.get_world_size(), dist.get_backend())
    if device == "cpu":
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // group.world))
    return group


def leave() -> None:
    """Leave the group (every rank calls it once its last collective is done)."""
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["Group", "join", "launched_world", "leave"]
