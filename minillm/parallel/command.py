"""A command run split over `--tp N` processes: started by torchrun, or starting its own other ranks.

Every rank loads the model and keeps its shard; rank 0 then runs the command (prompts,
strategy, sampling, printing) and the others follow its runner step by step
(`minillm.parallel.follow`): each all-reduce and all-gather meets all of them. Two ways in:

    torchrun --nproc-per-node 3 -m minillm.infer --tp 3 --prompt ...   torchrun starts the ranks
    python -m minillm.infer --tp 3 --prompt ...                         this process is rank 0 and
                                                                        starts ranks 1 .. N-1 itself

The second is torchrun's job done in a few lines: the same command again with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment, its output discarded (its errors
kept in a file). If a rank dies, the collective the others are in fails (gloo sees the closed
connection), and rank 0 names the rank and its error in one line; when rank 0 ends, for any
reason, it stops the ranks it started.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time

import torch

from ..base.ports import free_port
from .follow import follow, stop_followers
from .group import Group, join, launched_world, leave
from .shard import shard_model


class Workers:
    """The ranks 1 .. world-1 this process started, each a copy of its own command."""

    def __init__(self, world: int, argv: list[str]):
        port = free_port()
        self.logs = [tempfile.TemporaryFile() for _ in range(1, world)]
        base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        self.processes = [subprocess.Popen([sys.executable, *argv], env={**base, "RANK": str(rank),
                                                                          "LOCAL_RANK": str(rank)},
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
                          for rank, log in enumerate(self.logs, start=1)]
        os.environ.update(base, RANK="0", LOCAL_RANK="0")
        atexit.register(self.stop)

    def failure(self) -> str | None:
        """'rank R exited (status S): its last line', for the first rank that has ended with an error."""
        for rank, (process, log) in enumerate(zip(self.processes, self.logs), start=1):
            if process.poll() not in (None, 0):
                log.seek(0)
                lines = log.read().decode(errors="replace").strip().splitlines()
                return f"rank {rank} exited (status {process.returncode}): {lines[-1] if lines else 'no message'}"
        return None

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()


def check_ranks(world: int, device: str) -> None:
    if world < 1:
        raise ValueError(f"--tp {world}: give 1 or more processes")
    if device.startswith("cuda") and world > torch.cuda.device_count():
        raise ValueError(f"--tp {world} needs {world} GPUs, one per rank; this machine has "
                         f"{torch.cuda.device_count()}")
    given = launched_world()
    if given is not None and given != world:
        raise ValueError(f"--tp {world}, but the launcher started {given} processes: give torchrun "
                         f"--nproc-per-node {world}, or drop torchrun and let --tp start them")


def command_group(world: int, device: str) -> tuple[Group, Workers | None]:
    """Join the group of a command run with `--tp world`: torchrun's, or one whose other ranks this process starts
    now (then it is rank 0). Each CPU rank computes with its share of the cores (at least one thread)."""
    check_ranks(world, device)
    workers = None if launched_world() else Workers(world, ["-m", main_module(), *sys.argv[1:]])
    group = join(device)  # a server's idle rank 0 says it is there every minute (`AsyncEngine`): 600 s is ample
    if device.startswith("cuda"):
        torch.cuda.set_device(group.rank)
    return group, workers


def main_module() -> str:
    """The `-m` module this process runs (`python -m minillm.infer` -> 'minillm.infer')."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        raise ValueError("--tp starts its ranks as `python -m MODULE`: run the command that way, or under torchrun")
    return spec.name


def shard_loaded(model, group: Group, fast: bool):
    """Keep `group.rank`'s shard of a model loaded whole without fast paths, then give the shard the CPU's fast
    paths (oneDNN linears, huge pages) as `load_model` gives a whole model. The whole model is read through a
    mapping of its file that every rank shares: a rank's own memory holds only its shard (the default model on
    rank 1 of 3: 181 MB before sharding, 356 MB after, the shard's weights being 179 MB)."""
    from ..speed.huge_pages import model_into_huge_pages
    from ..speed.onednn import use_onednn

    shard_model(model, group.rank, group.world)  # a split the model does not allow is refused here, in one line
    cores = os.cpu_count() or 1
    if model.device.type == "cpu" and group.world > cores and group.leader:  # it runs, but the ranks take turns
        print(f"minillm: note: {group.world} ranks share {cores} cores: each rank computes on a core some of the time, "
              f"and every all-reduce waits for the slowest (one process is faster here; lesson 20)", file=sys.stderr)
    if fast and model.device.type == "cpu":
        if model.dtype == torch.float32:
            use_onednn(model)
        model_into_huge_pages(model)
    return model


def check_sharded_flags(world: int, compile: bool, quant: str) -> None:
    """--compile and --quant with --tp are refused in one line: the compiled graphs and the quantized linears are
    built for one process, and a sharded run is eager, in float."""
    if world != 1 and (compile or quant != "none"):
        flag = "--compile" if compile else f"--quant {quant}"
        raise ValueError(f"{flag} with --tp: the compiled graphs and quantized linears are built for one process; "
                         f"a sharded run is eager, in float: drop {flag.split()[0]} or --tp")


def run_ranked(world: int, device: str, lead, load, make_runner) -> int:
    """A command split over `world` processes, start to end: join its group (starting the other ranks, or under
    torchrun); rank 0 runs `lead(group, workers)` and then stops the followers, every other rank makes rank 0's
    runner calls (`follow`) over its shard, `load(group)`. A collective that fails names the rank that died."""
    group, workers = command_group(world, device)
    try:
        if not group.leader:
            follow(load(group), make_runner)
            return 0
        status = lead(group, workers)
        stop_followers()
        return status
    except RuntimeError as error:
        raise failed_rank(workers, error) from None
    finally:
        leave()


def rank_of_this_command() -> int:
    """The rank this process will have in its command's group: the launcher's RANK, or 0 (a command started by hand
    becomes rank 0 and starts the others). Known before the group forms: rank 0 alone binds a server's port."""
    return int(os.environ.get("RANK", "0"))


def failed_rank(workers: Workers | None, error: BaseException) -> BaseException:
    """What rank 0 reports when a collective failed: the rank that died and its own error, where one did."""
    if workers is None:
        return error
    deadline = time.monotonic() + 3  # the peer's socket closed as it died: give its exit a moment to be seen
    while (reason := workers.failure()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return RuntimeError(reason) if reason else error


__all__ = ["Workers", "check_sharded_flags", "command_group", "failed_rank", "rank_of_this_command", "run_ranked",
           "shard_loaded"]
