"""A free TCP port on this machine: for a server the tests start, or the rendezvous of a process group."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no one listens on now (the OS picks it; another process could take it before the caller binds it, so
    callers that start a listener on it should expect to retry)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["free_port"]
