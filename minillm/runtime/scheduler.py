"""Which requests share the next forward: the continuous-batching scheduler.

Static batching (lesson 07) admits a batch, runs it until its slowest row ends, then
admits the next. Continuous batching (Orca, Yu et al. 2022; vLLM) decides again at every
step, one forward at a time:

1. **Keep the running requests going**, oldest first. A decoding request feeds one token;
   a request still in its prefill feeds as much of its prompt as the step's token budget
   allows (a long prompt is cut into chunks, so it never stalls the decoders for long).
   Each new token needs a slot in the paged cache; when the pool is out of blocks, the
   **most recently admitted** request is preempted: its blocks are freed and it goes back
   to the front of the queue, to be recomputed from its prompt and the tokens it already
   produced (recomputing is cheap next to decoding, and nothing is swapped anywhere).
2. **Admit waiting requests**, first come first served, while the token budget, the
   number of sequences and the free blocks allow. A request that does not fit waits, and
   so does everyone behind it (no overtaking, so nothing starves). Nothing is admitted in
   a step that had to preempt. With a `watermark` (a share of the pool, vLLM keeps 1%),
   admission also leaves that many blocks free while anything runs, so the running
   requests' next tokens do not preempt the request just admitted.

The scheduler only does bookkeeping: which request feeds how many tokens, which blocks
it holds (`minillm.cache.paged.BlockManager`). It reads four things of a request: `id`,
`tokens` (prompt + generated so far), `computed` (leading tokens whose keys are in
the pool) and `wants_prompt_logits` (its prompt is computed whole, never read from the
prefix cache, while its prompt's logprobs are owed); the engine (`minillm.runtime.engine`)
owns everything else.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache.blocks import BlockManager


@dataclass
class ScheduledStep:
    """One step's plan."""

    work: list[tuple[object, int]] = field(default_factory=list)  # (request, new tokens it feeds), admission order
    admitted: list = field(default_factory=list)  # requests that joined the batch in this step
    preempted: list = field(default_factory=list)  # requests sent back to the queue in this step

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class Scheduler:
    """Waiting queue, running list, token budget and preemption over a `BlockManager`."""

    def __init__(self, manager: BlockManager, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 watermark: float = 0.0):
        if not (isinstance(max_num_seqs, int) and max_num_seqs >= 1):
            raise ValueError(f"max_num_seqs={max_num_seqs!r} is invalid: must be an integer >= 1")
        if not (isinstance(max_num_batched_tokens, int) and max_num_batched_tokens >= max_num_seqs):
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r} is invalid: must be an integer >= "
                             f"max_num_seqs={max_num_seqs}, so that every running request can decode in each step")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark!r} is invalid: a share of the pool in [0, 1) kept free at "
                             f"admission (vLLM keeps 0.01)")
        self.manager = manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.watermark_blocks = int(watermark * manager.num_blocks)
        self.waiting: deque = deque()  # first in line at the left
        self.running: list = []  # admission order: the last one is preempted first

    def add(self, request) -> None:
        self.waiting.append(request)

    def adopt(self, request) -> None:
        """A request that already holds blocks (a fork) joins the running ones; with no room for another
        sequence it gives them back and waits first in line (to be recomputed, prefix hits and all)."""
        if len(self.running) < self.max_num_seqs:
            self.running.append(request)
        else:
            self._requeue(request)

    def remove(self, request, keep_blocks: bool = False) -> None:
        """Take a request out of the queues (finished or aborted) and free its blocks, unless `keep_blocks` (a
        request others will fork from: `Engine.continue_request`)."""
        if request in self.running:
            self.running.remove(request)
            if not keep_blocks:
                self.manager.free(request.id)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop to make room
                continue
            if not self._reserve_slots(request, step):
                continue  # it was preempted itself
            n = min(len(request.tokens) - request.computed, budget)
            if n > 0:
                self._feed(request, n, step)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not step.preempted:
            request = self.waiting[0]
            reuse = not request.wants_prompt_logits
            reserve = self.watermark_blocks if self.running else 0  # alone, a request may use the whole pool
            if not self.manager.can_allocate(request.tokens, reuse, keep_free=reserve):
                break
            self.waiting.popleft()
            self.manager.allocate(request.id, request.tokens, reuse)
            request.computed = self.manager.cached_tokens(request.id)
            self.running.append(request)
            step.admitted.append(request)
            n = min(len(request.tokens) - request.computed, budget)
            self._feed(request, n, step)
            budget -= n
        return step

    def _feed(self, request, n: int, step: ScheduledStep) -> None:
        """Put n more of the request's tokens in this step's forward.

        Their full blocks join the prefix cache now, before the forward, so a request
        admitted later in this same step can share them: within one forward each layer
        writes every new key before any sequence's attention reads one.
        """
        step.work.append((request, n))
        self.manager.mark_computed(request.id, request.computed + n)

    def _reserve_slots(self, request, step: ScheduledStep) -> bool:
        """Give the request's newest tokens slots, preempting the newest requests while the pool is full.

        False if the request itself had to be preempted.
        """
        manager = self.manager
        while manager.num_tokens(request.id) < len(request.tokens):
            if manager.can_append(request.id):
                manager.append(request.id, request.tokens[manager.num_tokens(request.id)])
                continue
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _preempt(self, request, step: ScheduledStep) -> None:
        self.running.remove(request)
        self._requeue(request)
        request.preemptions += 1
        step.preempted.append(request)  # never one already in step.work: those are older than the victim

    def _requeue(self, request) -> None:
        """Give its blocks back and put it first in line (it came before everyone waiting), to be recomputed."""
        self.manager.free(request.id)
        request.computed = 0
        self.waiting.appendleft(request)


__all__ = ["Scheduler", "ScheduledStep"]
