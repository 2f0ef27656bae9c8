"""Rank 0 leads, the other ranks follow: every step of a sharded model's runner, sent to each rank before it runs.

A sharded forward needs every rank inside it at once (each all-reduce waits for all of
them), but only rank 0 knows what to run: it holds the requests, the scheduler and the
sampler. So, as nano-vllm does, rank 0 tells the others each call before it makes it:
the runner a command or the engine makes (`announce_runner`), then each call it makes
on that runner's cache session (prefill, extend, rollback, select ...) or, for the
engine's paged cache, each packed step. A follower (`follow`) builds the same runner
over its own shard and makes the same calls on it, so its cache holds the same
positions of its own heads, and its forwards meet rank 0's in each collective. The
messages are small (token ids, positions, block tables): each travels pickled in one
torch.distributed broadcast of `MESSAGE_BYTES` over the same group, its length first, never a
channel of our own. So an announced step waits in one collective more, as the cost model
counts it (`torch.distributed.broadcast_object_list` sends the length and the pickle in two);
only a longer message (a long prompt's ids) takes a second broadcast. Followers keep one
runner, the latest: a command's runners come one after another.
"""

from __future__ import annotations

import contextlib
import pickle

import torch
import torch.distributed as dist

STOP = "stop"
NEW_RUNNER = "new runner"  # any other message names its target: "session" or "runner"
MESSAGE_BYTES = 4096  # one broadcast's bytes: the pickle's length, then the pickle if it fits
LENGTH_BYTES = 8


def leads(model) -> bool:
    """Whether this process is rank 0 of the group `model` is a shard of (a whole model: False)."""
    return getattr(model, "split", None) is not None and dist.is_initialized() and dist.get_rank() == 0


class RanksLost(RuntimeError):
    """A follower stopped answering (it died, or its machine did): the group cannot compute another step."""


def announce(message) -> None:
    """Rank 0: send `message` to every follower (each is inside `follow`, waiting for it). A follower that is gone
    fails the send: `RanksLost`, which a server turns into 503s rather than retrying a group that cannot step."""
    data = pickle.dumps(message)
    head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    head[:LENGTH_BYTES] = as_bytes(len(data).to_bytes(LENGTH_BYTES, "little"))
    fits = len(data) <= MESSAGE_BYTES - LENGTH_BYTES
    if fits:
        head[LENGTH_BYTES:LENGTH_BYTES + len(data)] = as_bytes(data)
    with group_answering():
        dist.broadcast(head.to(group_device()), src=0)
        if not fits:
            dist.broadcast(as_bytes(data).to(group_device()), src=0)


@contextlib.contextmanager
def group_answering():
    """Rank 0, around its collectives: one that fails because a rank is gone (gloo: "Connection closed by peer", or
    a timeout; NCCL's own words) raises `RanksLost`. A broadcast may leave before a dead rank is noticed, so the
    step's first all-reduce can be the collective that finds out."""
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if "gloo" not in text and "NCCL" not in text and "Connection closed" not in text:
            raise  # not the group's failure: a bug, reported as it is
        raise RanksLost(f"a rank of the tensor-parallel group stopped answering ({text.splitlines()[0]})") from error


def received():
    """A follower: the next message rank 0 `announce`s (waits for it)."""
    head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=group_device())
    dist.broadcast(head, src=0)
    head = head.cpu()
    length = int.from_bytes(head[:LENGTH_BYTES].numpy().tobytes(), "little")
    if length <= MESSAGE_BYTES - LENGTH_BYTES:
        return pickle.loads(head[LENGTH_BYTES:LENGTH_BYTES + length].numpy().tobytes())
    body = torch.empty(length, dtype=torch.uint8, device=group_device())
    dist.broadcast(body, src=0)
    return pickle.loads(body.cpu().numpy().tobytes())


def as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def group_device() -> torch.device:
    """Where the group's collectives take their tensors: NCCL's on this rank's GPU, gloo's on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def announce_runner(settings: dict) -> None:
    """Rank 0: a new runner over the sharded model, made with `settings` (ModelRunner's keywords)."""
    announce((NEW_RUNNER, settings))


class Announced:
    """Rank 0's view of an object the followers hold a twin of: calling one of `calls` sends the call first."""

    def __init__(self, target, name: str, calls: frozenset[str]):
        self.target, self.name, self.calls = target, name, calls

    def __getattr__(self, attribute):
        value = getattr(self.target, attribute)
        if attribute not in self.calls:
            return value

        def call(*args, **kwargs):
            announce((self.name, attribute, args, kwargs))
            return value(*args, **kwargs)

        return call


def stop_followers() -> None:
    """Rank 0, at the end: the followers leave `follow` (and their command ends); followers already gone need no
    telling."""
    if dist.is_initialized() and dist.get_rank() == 0:
        try:
            announce(STOP)
        except RanksLost:
            pass


def follow(model, make_runner) -> int:
    """A follower's whole work: make the runners rank 0 makes over this rank's shard (`make_runner(model,
    **settings)`), make the calls it makes, until it says stop. Returns the number of calls made."""
    runner, calls = None, 0
    while (message := received()) != STOP:
        if message[0] == NEW_RUNNER:
            runner = None  # the last runner's cache freed before the next one's is allocated
            runner = make_runner(model, **message[1])
            continue
        target, attribute, args, kwargs = message
        getattr(runner.session if target == "session" else runner, attribute)(*args, **kwargs)
        calls += 1
    return calls


__all__ = ["Announced", "RanksLost", "STOP", "announce_runner", "follow", "leads", "stop_followers"]
