"""Starting a server: the engine and app built together, the listening socket, and a server on a background thread.

`python -m minillm.serve` (the command) and `BackgroundServer` (what notebooks and tests
start) share these, so a server started either way checks the same limits and binds the
same way: the socket before the model loads, so a taken port fails in a second, in one line.
"""

from __future__ import annotations

import socket
import time

from fastapi import FastAPI

from ..runtime.engine import Engine, kv_bytes_per_token
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .server import create_app


def build_server(model, tokenizer, *, model_name: str, max_model_len: int | None = None, max_waiting: int = 64,
                 request_timeout: float = 600.0, max_body_bytes: int = 2**20, explain=str,
                 **engine_options) -> tuple[AsyncEngine, FastAPI, int]:
    """The engine, its thread (not started yet) and the app serving it; returns them and the context limit.

    engine_options go to `Engine` (max_num_seqs, kv_cache_mb, ...); explain: `AsyncEngine`'s. Refuses, in one
    line, a model the engine cannot serve.
    """
    if tokenizer is None:
        raise ValueError(f"model {model_name!r} ships no tokenizer (tokenizer.json): a server needs one")
    engine = Engine(model, tokenizer, **engine_options)
    limit = context_limit(model, engine, max_model_len)
    metrics = ServerMetrics(model_name)
    runner = AsyncEngine(engine, max_waiting, on_finish=metrics.request_finished, explain=explain)
    app = create_app(runner, tokenizer, model_name=model_name, max_model_len=limit, metrics=metrics,
                     request_timeout=request_timeout, max_body_bytes=max_body_bytes)
    return runner, app, limit


class BackgroundServer:
    """A server on a thread of this process, on a free port: what notebooks and tests start.

        with BackgroundServer(model, tokenizer) as server:
            client = OpenAI(base_url=server.base_url, api_key="unused")
            ...
        # on exit: the HTTP server and the engine thread have stopped

    server_options go to `build_server` (max_model_len, max_waiting, request_timeout, ...,
    and the `Engine`'s own: max_num_seqs, kv_cache_mb, ...).
    """

    def __init__(self, model, tokenizer, *, model_name: str = "default", host: str = "127.0.0.1", port: int = 0,
                 **server_options):
        self.runner, self.app, self.max_model_len = build_server(model, tokenizer, model_name=model_name,
                                                                 **server_options)
        self.engine = self.runner.engine
        self.host, self.port = host, port

    def __enter__(self) -> "BackgroundServer":
        import threading

        import uvicorn

        sock = bind(self.host, self.port)
        self.url = "http://{}:{}".format(*sock.getsockname()[:2])
        self.base_url = self.url + "/v1"
        self.runner.start()
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} stopped while starting")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.runner.stop()


def context_limit(model, engine: Engine, requested: int | None) -> int:
    """--max-model-len checked against the model's context and the pool (one request at its longest must fit)."""
    context, pool = model.config.context_length, engine.manager.capacity
    if requested is None:
        return min(context, pool)
    if requested > context:
        raise ValueError(f"--max-model-len {requested} is over the model's context of {context} tokens: lower it")
    if requested > pool:
        needed = requested * kv_bytes_per_token(model) / 2**20
        raise ValueError(f"--max-model-len {requested} does not fit the KV pool ({pool} tokens): raise --kv-cache-mb "
                         f"to at least {needed:.0f} or lower --max-model-len")
    return requested


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a taken port fails in a second, in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # listening holds the port: another server cannot bind it meanwhile
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): is another server running there? "
                         f"Pick another --port") from None
    return sock
