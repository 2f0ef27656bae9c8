"""The engine on its own thread, fed by asyncio: what lets one engine serve many HTTP clients.

`Engine.step()` is a blocking forward of the model. An HTTP server is an asyncio event
loop that must keep accepting connections and writing streamed chunks while the model
computes, so the engine runs on a thread of its own, and only that thread ever touches
it (the engine is not thread-safe, and needs not be):

    handler (event loop)                     engine thread
    ids, events = await submit(prompts) ──►  add_request() between two steps
    async for event in events               step(), step(), ...: each event is put on
        ... write a chunk ...          ◄──    the queue of the request it belongs to
    abort(ids) (client went away)      ──►  abort() + release(): its blocks are free

Commands (add, abort) wait in a queue and run between two steps, so a new request
joins the batch at the next step: the continuous in continuous batching. A finished
request is released from the engine as soon as its last event is handed over, so a
server that runs for days holds only the requests in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from itertools import groupby
from dataclasses import dataclass

from ..decoding.outputs import GenerationEvent
from ..parallel.follow import RanksLost
from ..runtime.engine import Engine

log = logging.getLogger("minillm.serving.server")


class QueueFull(RuntimeError):
    """More requests are waiting than the server admits: the client should retry later."""


# Seconds without a step after which an idle engine tells a tensor-parallel group's other ranks it is still there
# (they wait for each call under the group's timeout, `minillm.parallel.group.join`).
KEEP_ALIVE = 60.0


class EngineFailed(RuntimeError):
    """The engine raised while stepping: every request in flight ends with this error. `lasting`: the engine cannot
    step again (a tensor-parallel rank is gone), so later requests are refused with it too (503)."""

    def __init__(self, message: str, lasting: bool = False):
        super().__init__(message)
        self.lasting = lasting


@dataclass
class Submitted:
    """What `submit` hands back: the engine's request ids and one event queue for all."""

    ids: list[int]
    events: asyncio.Queue  # GenerationEvent (event.row is the request id) or an EngineFailed


class AsyncEngine:
    """Runs `engine` on a background thread; `submit` and `abort` may be called from any event loop.

    max_waiting: how many requests may wait for a place in the batch; `submit` raises
    `QueueFull` beyond that (the server answers 503 with Retry-After), so a burst cannot
    pile up unbounded work and memory.
    """

    def __init__(self, engine: Engine, max_waiting: int = 64, on_finish=None, explain=str):
        """on_finish(sequence): called on the engine thread for each request that ends (finished or aborted),
        before the engine forgets it (the server's metrics read its timings there). explain(error): the line a
        lost tensor-parallel rank is reported with (the command that started the ranks knows which one died)."""
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} is invalid: must be >= 0")
        self.engine, self.max_waiting, self.on_finish = engine, max_waiting, on_finish
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._routes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # request id -> its queue
        self._stopping = False
        self.aborted = 0  # requests stopped before they finished (clients gone, time limits)
        self.explain, self.broken = explain, None  # broken: an EngineFailed every request gets once no step can run
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    def start(self) -> "AsyncEngine":
        """Run the engine on a thread of its own: for a process whose main thread is busy (a notebook, a test)."""
        self._thread.start()
        return self

    def run_here(self, keep_going=lambda: True, poll: float = 0.5) -> None:
        """Run the engine on the calling thread until `stop_soon` (or until keep_going() turns false, checked
        every `poll` seconds while idle): what `python -m minillm.serve` does on its main thread.

        Why the main thread: PyTorch's CPU kernels split their work with OpenMP (libgomp), which
        keeps a pool of worker threads per thread that starts parallel work. The main thread
        starts one while the model loads; a second thread running the engine starts another,
        and with more OpenMP threads than cores libgomp stops spinning between parallel regions
        and puts its workers to sleep after each. A decode step is hundreds of small regions,
        each then waiting for a worker to wake: measured on two cores, a compiled decode step
        took 49 ms on a second thread against 25 ms on the main thread (and a 3072x576
        matrix-vector product 207 us against 125 us). The HTTP thread runs no torch work.
        """
        self._run(keep_going, poll)

    def stop_soon(self) -> None:
        """Let the engine's loop end after the current step (safe from a signal handler on its own thread)."""
        self._stopping = True
        self._wake.set()

    def stop(self) -> None:
        """Finish the current step, then end the thread (requests still in flight are dropped)."""
        self.stop_soon()
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------ called from the event loop

    async def submit(self, prompts: list, configs: list, **request_options) -> Submitted:
        """Add one request per (prompt, config); all or none are added. request_options: `Engine.add_request`'s
        keywords (top_logprobs, prompt_top_logprobs), the same for every one of them.

        Raises what `Engine.add_request` raises for a bad prompt or setting (ValueError),
        or QueueFull.
        """
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        return await self._call(lambda: self._add(prompts, configs, request_options, loop, events))

    async def continue_from(self, parents: list[int], tokens: list[int], config, **request_options) -> Submitted:
        """One request per (finished, held parent, token): `Engine.continue_request`'s, all or none. Its
        request_options: top_logprobs, hold."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        return await self._call(lambda: self._continue(parents, tokens, config, request_options, loop, events))

    async def call(self, fn):
        """Run `fn(engine)` on the engine thread between two steps and return its result (for reading counters)."""
        return await self._call(lambda: fn(self.engine))

    def abort(self, ids) -> None:
        """Stop these requests and free their blocks; ids that already finished are released (a held one's
        blocks go then), ids already released skipped.

        Does not wait: it is called from `finally` blocks while a handler is being
        cancelled (a client disconnected), where nothing may be awaited.
        """
        ids = list(ids)
        self._post(lambda: self._abort(ids), None)

    # ------------------------------------------------------------------ the engine thread

    def _call(self, fn) -> asyncio.Future:
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._post(fn, result)
        return asyncio.wrap_future(result)

    def _post(self, fn, result) -> None:
        self._commands.put((fn, result))
        self._wake.set()

    def _add(self, prompts, configs, request_options, loop, events) -> Submitted:
        if self.broken is not None:
            raise self.broken
        waiting = len(self.engine.scheduler.waiting)
        if waiting + len(prompts) > self.max_waiting:
            raise QueueFull(f"{waiting} requests are already waiting (the limit is {self.max_waiting}): "
                            f"retry in a moment")
        def add(ids):
            for prompt, group in groupby(zip(prompts, configs), key=lambda pair: pair[0]):  # n choices: one prompt
                ids += self.engine.add_requests(prompt, [config for _, config in group], **request_options)

        return self._routed(add, loop, events)

    def _continue(self, parents, tokens, config, request_options, loop, events) -> Submitted:
        if self.broken is not None:
            raise self.broken

        def add(ids):
            for parent, token in zip(parents, tokens):
                ids.append(self.engine.continue_request(parent, token, config, **request_options))

        return self._routed(add, loop, events)

    def _routed(self, add, loop, events) -> Submitted:
        """`add(ids)` adds requests, appending their ids: all of them or none (a failure aborts those added);
        their events go to `events` on `loop`."""
        ids = []
        try:
            add(ids)
        except Exception:
            self._abort(ids)
            raise
        for request_id in ids:
            self._routes[request_id] = (loop, events)
        return Submitted(ids, events)

    def _abort(self, ids) -> None:
        for request_id in ids:
            request = self.engine.requests.get(request_id)
            if request is None:  # finished and released already
                continue
            if not request.finished:
                self.engine.abort(request_id)
                self.aborted += 1
            self._release(request_id)
            self._routes.pop(request_id, None)

    def _run(self, keep_going=lambda: True, poll: float | None = None) -> None:
        last_step = time.monotonic()
        while not self._stopping and keep_going():
            self._run_commands()
            try:
                if not self.engine.has_unfinished():
                    self._wake.wait(min(poll or KEEP_ALIVE, KEEP_ALIVE))
                    self._wake.clear()
                    if self.broken is None and time.monotonic() - last_step > KEEP_ALIVE:
                        self.engine.keep_alive()
                        last_step = time.monotonic()
                    continue
                events = self.engine.step()
                last_step = time.monotonic()
            except RanksLost as error:  # the group cannot step again: fail what is in flight and what comes
                self.broken = EngineFailed(self.explain(error), lasting=True)
                self._fail_all(self.broken)
                continue
            except Exception as error:  # a bug, not a bad request: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(EngineFailed(f"the engine failed: {type(error).__name__}: {error}"))
                continue
            for event in events:
                self._deliver(event)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, result = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                value = fn()
            except Exception as error:
                if result is None:
                    log.exception("engine command failed")
                else:
                    result.set_exception(error)
            else:
                if result is not None:
                    result.set_result(value)

    def _deliver(self, event: GenerationEvent) -> None:
        route = self._routes.get(event.row)
        if route is None:  # aborted in this step's commands
            return
        if event.finish_reason is not None:
            if not self.engine.holds(event.row):  # a held one is released by whoever forks from it (`abort`)
                self._release(event.row)
            del self._routes[event.row]
        hand_over(route, event)

    def _release(self, request_id) -> None:
        if self.on_finish is not None:
            self.on_finish(self.engine.requests[request_id])
        self.engine.release(request_id)

    def _fail_all(self, error: EngineFailed) -> None:
        for route in self._routes.values():
            hand_over(route, error)
        self._abort(list(self._routes))


def hand_over(route: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    """Put `item` on a queue owned by another thread's event loop (a loop that has closed gets nothing)."""
    loop, events = route
    try:
        loop.call_soon_threadsafe(events.put_nowait, item)
    except RuntimeError:  # the loop is closed: its handler is gone, and nobody is waiting
        pass


__all__ = ["AsyncEngine", "EngineFailed", "QueueFull", "Submitted"]
