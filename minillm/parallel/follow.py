"""Rank 0 leads, the other ranks follow: every step of a sharded model's runner, sent to each rank before it runs.

A sharded forward needs every rank inside it at once (each all-reduce waits for all of
them), but only rank 0 knows what to run: it holds the requests, the scheduler and the
sampler. So, as nano-vllm does, rank 0 tells the others each call before it makes it:
the runner a command or the engine makes (`announce_runner`), then each call it makes
on that runner's cache session (prefill, extend, rollback, select ...) or, for the
engine's paged cache, each packed step. A follower (`follow`) builds the same runner
over its own shard and makes the same calls on it, so its cache holds the same
positions of its own heads, and its forwards meet rank 0's in each collective. The
messages are small (token ids, positions, block tables): they travel through
torch.distributed's own `broadcast_object_list` over the same group, never a channel of
our own. Followers keep one runner, the latest: a command's runners come one after another.
"""

from __future__ import annotations

import torch.distributed as dist

STOP = "stop"
NEW_RUNNER = "new runner"  # any other message names its target: "session" or "runner"


def leads(model) -> bool:
    """Whether this process is rank 0 of the group `model` is a shard of (a whole model: False)."""
    return getattr(model, "split", None) is not None and dist.is_initialized() and dist.get_rank() == 0


class RanksLost(RuntimeError):
    """A follower stopped answering (it died, or its machine did): the group cannot compute another step."""


def announce(message) -> None:
    """Rank 0: send `message` to every follower (each is inside `follow`, waiting for it). A follower that is gone
    fails the send: `RanksLost`, which a server turns into 503s rather than retrying a group that cannot step."""
    try:
        dist.broadcast_object_list([message], src=0)
    except RuntimeError as error:  # gloo: "Connection closed by peer", or a timeout
        raise RanksLost(f"a rank of the tensor-parallel group stopped answering ({str(error).splitlines()[0]})") \
            from error


def received():
    message = [None]
    dist.broadcast_object_list(message, src=0)
    return message[0]


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
