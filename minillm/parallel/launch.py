"""Start `world` processes that join one group, as torchrun does, from inside Python.

`spawn_ranks(world, target, *args)` runs `target(group, *args)` in `world` fresh processes
(torch.multiprocessing's spawn), each told its rank and the rendezvous (a free local port)
through the same environment variables torchrun sets, so code written for torchrun runs
here unchanged. If any rank fails, the others are stopped and the failure is raised here
with its traceback; nothing waits forever on a rank that died.
"""

from __future__ import annotations

import os

import torch.multiprocessing as mp

from ..base.ports import free_port
from .group import join, leave


def rank_entry(rank: int, world: int, port: int, device: str, threads: int | None, timeout: float, target,
               args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    group = join(device, threads, timeout)
    try:
        target(group, *args)
    finally:
        leave()


def spawn_ranks(world: int, target, *args, device: str = "cpu", threads: int | None = None,
                timeout: float = 600) -> None:
    """Run `target(group, *args)` on ranks 0 .. world-1 and wait for all of them (`target` must be importable by
    name: a module-level function). A collective left waiting `timeout` seconds fails, and with it the run."""
    mp.spawn(rank_entry, args=(world, free_port(), device, threads, timeout, target, args), nprocs=world, join=True)


__all__ = ["spawn_ranks"]
