"""The continuous-batching engine: requests come and go while the model keeps stepping.

    engine = Engine(model, tokenizer)
    a = engine.add_request("The capital of France is", max_new_tokens=20)
    b = engine.add_request("Once upon a time", do_sample=True, seed=1)
    while engine.has_unfinished():
        for event in engine.step():          # the same events `generate` yields; event.row is the request id
            print(event.row, event.text, end="")
    engine.output(a).text

One `step()` is one forward of the model over a mixed batch:

    scheduler      which requests feed tokens this step, and how many (`minillm.runtime.scheduler`)
    pack           their new tokens back to back in one row, no padding (`PackedSequences`):
                   a 300-token prompt chunk, then five decoding requests' one token each
    forward        the model's one forward, keys written into a paged cache
                   (`minillm.cache.paged`), attention reading each sequence's keys through its
                   block table (`PagedAttention`); a step in which every request decodes
                   runs as one compiled graph when its package is built (`graph`, lesson 15)
    sample         every request whose prompt is done draws its next token with its own
                   settings and its own random stream (`minillm.decoding.sampling`)
    logprobs       only for the requests that ask: the chosen tokens' (from the distribution
                   they were drawn from), and the prompt tokens' at every prompt position fed
                   (`minillm.decoding.logprobs`)
    events         new tokens, newly final text, finish reasons (`minillm.decoding.stopping`)

A request's tokens depend only on its prompt, settings and seed, never on what else
shares its forwards: the same logits processors and one uniform number per token from
its own generator, as `generate` draws them. A request that the pool could never hold
is refused when it is added, with the numbers that say why; a pool that fills up
mid-run preempts (see `minillm.runtime.scheduler`) instead of failing.

A request stops as `generate`'s rows do (EOS, stop strings, `max_new_tokens`), and also
when it fills the model's context: the engine does not slide a window over it.

Several requests over one prompt (`add_requests`: a server's n choices) compute it once:
the first prefills it, and when it draws its first token the others fork its blocks
(`BlockManager.fork`), each drawing its own first token from the same logits. They share
every block until one writes into a shared partial block, which is then copied for it
alone (copy-on-write; `StepRecord.blocks_copied` counts the copies). A request added with
`hold=True` keeps its blocks when it finishes, until released: `continue_request` forks it
into a new request that feeds one more token, which is how the server's beam search moves
each beam on without computing its history again (`minillm.serving.beams`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..cache.blocks import BlockManager, blocks_for
from ..cache.paged import PackedSequences
from ..decoding.outputs import (
    GenerationEvent,
    RowOutput,
    check_prompts,
    encode_prompts,
)
from ..decoding.sampling import SamplingConfig, row_configs
from ..decoding.settings import is_int
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, sample_next


@dataclass
class StepRecord:
    """What one step did: the workload benchmark's timeline and pool-occupancy plots read these."""

    start: float  # perf_counter time the step began
    seconds: float
    requests: list[int]  # ids that fed tokens, in batch order
    prefill_tokens: int  # prompt (or recomputed) tokens fed
    decode_tokens: int  # one per decoding request
    blocks_used: int  # blocks held by some request after the step
    slots_filled: int  # slots of those blocks holding keys (a shared block counts once)
    tokens_stored: int  # keys the running requests hold, each request counted alone
    tokens_reserved: int  # what reserving each running request's maximum length contiguously would set aside
    preempted: list[int]
    blocks_copied: int = 0  # copy-on-write copies made before this step's forward


def kv_bytes_per_token(model) -> int:
    """Keys and values one token occupies over all layers."""
    return model.config.cache_values_per_token * model.tok_emb.weight.element_size()


class Engine:
    """Continuous batching over a paged KV cache; see the module docstring.

    block_size: token slots per block. num_blocks: the pool's size; None sizes it to
    `kv_cache_mb` megabytes. max_num_seqs: the most requests decoding together.
    max_num_batched_tokens: the token budget of one forward (prefill chunks fill what the
    decoders leave). hash_fn: the prefix cache's block hash; prefix_caching=False turns it off. watermark:
    the share of the pool admission keeps free while requests run (`minillm.runtime.scheduler`).
    graph: how the steps in which every request decodes run (`ModelRunner`'s graph modes):
    "auto" (the default) the compiled step when its package is already on disk, "compiled"
    (built first if it is not: two to three minutes on two cores, once per machine), or "eager".
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_mb: float = 256, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 hash_fn=hash, prefix_caching: bool = True, graph: str = "auto", watermark: float = 0.0):
        if num_blocks is None:
            num_blocks = int(kv_cache_mb * 2**20 // (kv_bytes_per_token(model) * block_size))
        self.model, self.tokenizer = model, tokenizer
        self.manager = BlockManager(num_blocks, block_size, hash_fn, prefix_caching)
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens, watermark)
        self.runner = ModelRunner(model, cache="paged", graph=graph, num_blocks=num_blocks, block_size=block_size,
                                  max_batch=max_num_seqs)  # the most rows a decode step holds (a GPU's buckets)
        self.requests: dict[int, Sequence] = {}
        self.timeline: list[StepRecord] = []
        self.forward_passes = 0
        self._next_id = 0
        self._pending: list[GenerationEvent] = []  # events owed before the next forward (requests with nothing to do)
        self._forks: dict[int, list[Sequence]] = {}  # a prefilling request's id -> the requests that fork from it
        self._hold: set[int] = set()  # requests whose blocks outlive them, until `release`

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, config: SamplingConfig | None = None, *, arrival_time: float | None = None,
                    top_logprobs: int | None = None, prompt_top_logprobs: int | None = None,
                    **config_overrides) -> int:
        """Queue a prompt (text or token ids) with its settings; returns the request's id.

        top_logprobs: its events carry each generated token's logprob and this many likeliest
        tokens'; prompt_top_logprobs: its first event carries the same for each prompt token
        after the first (its prompt is then computed whole, never read from the prefix cache).
        None, the default, computes nothing of the kind.

        Checked here, before any model work: the prompt, the settings, and that the pool
        can hold the request at its longest (else it could never finish).
        """
        (request_id,) = self.add_requests(prompt, [row_configs(config, 1, config_overrides)[0]],
                                          arrival_time=arrival_time, top_logprobs=top_logprobs,
                                          prompt_top_logprobs=prompt_top_logprobs)
        return request_id

    def add_requests(self, prompt, configs: list[SamplingConfig], *, arrival_time: float | None = None,
                     top_logprobs: int | None = None, prompt_top_logprobs: int | None = None,
                     hold: bool = False) -> list[int]:
        """Queue one request per config over the same prompt (a server's n choices); returns their ids.

        The prompt is computed once: the first request prefills it and the others fork its blocks when it
        draws its first token (see the module docstring). Requests that score their prompt
        (prompt_top_logprobs) each compute it. All are checked before any is queued. hold: each keeps its
        blocks once finished, for `continue_request`, until `release`.
        """
        if hasattr(prompt, "__len__") and len(prompt) == 0:
            raise ValueError("the prompt is empty: give it at least one token")
        rows = encode_prompts(prompt, self.tokenizer)
        if len(rows) != 1:
            raise ValueError(f"add_request takes one prompt, got {len(rows)}: call it once per prompt")
        (prompt_ids,) = rows
        check_prompts([prompt_ids], self.model.config.context_length, self.model.config.vocab_size)
        requests = [self._checked_request(prompt_ids, config, arrival_time, top_logprobs, prompt_top_logprobs)
                    for config in configs]
        for request in requests:
            self._register(request, hold)
        running = [r for r in requests if not r.finished]
        for request in requests:
            if request.finished:  # max_new_tokens == 0: nothing to compute, one event to report it (as `generate` does)
                request.finish_time = request.arrival_time
                self._pending.append(request.event([]))
        if running and prompt_top_logprobs is None:
            self.scheduler.add(running[0])
            if running[1:]:
                self._forks[running[0].id] = running[1:]
        else:
            for request in running:
                self.scheduler.add(request)
        return [r.id for r in requests]

    def continue_request(self, parent_id: int, token: int, config: SamplingConfig, *, top_logprobs: int | None = None,
                         hold: bool = False) -> int:
        """A new request whose prompt is a finished, held request's computed tokens and then `token`: it forks the
        parent's blocks (shared, copied only where it writes) and feeds just `token` before drawing its own."""
        parent = self._request(parent_id)
        if not (parent.finished and parent_id in self._hold and parent_id in self.manager):
            raise ValueError(f"request {parent_id} cannot be continued: only a finished request added with hold=True "
                             f"and not yet released keeps the blocks to fork")
        check_prompts([[token]], self.model.config.context_length, self.model.config.vocab_size)
        request = self._checked_request(parent.tokens[:parent.computed] + [token], config, None, top_logprobs, None)
        self._register(request, hold)
        self.manager.fork(parent_id, request.id)
        request.computed = parent.computed
        self.scheduler.adopt(request)
        return request.id

    def _register(self, request: Sequence, hold: bool) -> None:
        """Give a new request its id and keep it (and, with `hold`, its blocks once it finishes)."""
        request.id, self._next_id = self._next_id, self._next_id + 1
        self.requests[request.id] = request
        if hold:
            self._hold.add(request.id)

    def _checked_request(self, prompt_ids: list[int], config: SamplingConfig, arrival_time, top_logprobs,
                         prompt_top_logprobs) -> Sequence:
        """A new request's `Sequence` (its id still unset), after every check of its settings."""
        context = self.model.config.context_length
        if config.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass Engine(model, tokenizer)")
        vocab = self.model.config.vocab_size
        for name, top in (("top_logprobs", top_logprobs), ("prompt_top_logprobs", prompt_top_logprobs)):
            if top is not None and not (is_int(top) and 0 <= top <= vocab):
                raise ValueError(f"{name}={top!r} is invalid: must be None (no logprobs) or an integer in [0, {vocab}]")
        max_new = min(config.max_new_tokens, context - len(prompt_ids))  # the context is the limit too
        if prompt_top_logprobs is not None and max_new == 0:
            raise ValueError("prompt_top_logprobs needs max_new_tokens >= 1: the prompt's logits come from the forward "
                             "that draws the first token (to score a prompt alone, drop that token, as vLLM does)")
        longest = len(prompt_ids) + max_new
        if blocks_for(longest, self.manager.block_size) > self.manager.num_blocks:
            raise ValueError(f"request of {len(prompt_ids)} prompt tokens + {max_new} new tokens needs "
                             f"{blocks_for(longest, self.manager.block_size)} blocks of {self.manager.block_size}, "
                             f"but the pool has {self.manager.num_blocks}: lower max_new_tokens or build a larger "
                             f"pool (num_blocks / kv_cache_mb)")
        return Sequence.create(prompt_ids, config.with_(max_new_tokens=max_new), tokenizer=self.tokenizer,
                               vocab_size=vocab, device=self.model.device,
                               top_logprobs=top_logprobs, prompt_top_logprobs=prompt_top_logprobs,
                               **({} if arrival_time is None else {"arrival_time": arrival_time}))

    def abort(self, request_id) -> None:
        """Stop a request now and free its blocks (finish reason "abort"); the others go on."""
        request = self._request(request_id)
        if request.finished:
            raise ValueError(f"request {request_id} already finished ({request.state.finish_reason}): "
                             f"there is nothing to abort")
        for followers in self._forks.values():
            if request in followers:  # waiting to fork: it simply will not
                followers.remove(request)
        for follower in reversed(self._forks.pop(request_id, [])):  # nothing to fork from: each computes its own
            self.scheduler.waiting.appendleft(follower)
        self.scheduler.remove(request)
        request.finish("abort")

    def output(self, request_id) -> RowOutput:
        """The request's tokens and text so far (final once it has finished)."""
        return self._request(request_id).output()

    def release(self, request_id) -> RowOutput:
        """Forget a finished request and return its output.

        The engine keeps finished requests so that `output` can be read after the last
        event; a long-running server releases each one once it has answered, or its
        memory would grow with every request served.
        """
        request = self._request(request_id)
        if not request.finished:
            raise ValueError(f"request {request_id} is still running: abort it first, or release it once it "
                             f"has finished")
        del self.requests[request_id]
        if request_id in self._hold:  # its blocks outlived it: they go now
            self._hold.discard(request_id)
            if request_id in self.manager:
                self.manager.free(request_id)
        return request.output()

    def holds(self, request_id) -> bool:
        """Whether the request keeps its blocks once finished (added with hold=True), until released."""
        return request_id in self._hold

    def has_unfinished(self) -> bool:
        """Whether `step()` has anything left to do or report."""
        return self.scheduler.has_unfinished or bool(self._pending)

    def _request(self, request_id) -> Sequence:
        if request_id not in self.requests:
            raise ValueError(f"unknown request {request_id!r}: add_request returns the ids this engine knows "
                             f"({len(self.requests)} so far)")
        return self.requests[request_id]

    def keep_alive(self) -> None:
        """Called while idle: a tensor-parallel runner's other ranks hear from rank 0 (`ModelRunner.keep_alive`)."""
        self.runner.keep_alive()

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self) -> list[GenerationEvent]:
        """Schedule, run one forward over the mixed batch, sample, and report what happened."""
        start = time.perf_counter()
        events, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if not plan.work:
            return events
        requests = [r for r, _ in plan.work]
        counts = [n for _, n in plan.work]
        device = self.model.device
        packed = PackedSequences.build([self.manager.block_table(r.id) for r in requests],
                                       [r.computed for r in requests], counts, self.manager.block_size, device)
        tokens = torch.tensor([t for r, n in plan.work for t in r.tokens[r.computed : r.computed + n]],
                              device=device)  # [N]
        decode_tokens = sum(1 for r, n in plan.work  # a generated token fed back; anything else is (re)prefill
                            if len(r.tokens) > len(r.prompt_ids) and r.computed == len(r.tokens) - 1)
        # A request whose tokens are all fed after this step has a next token to draw.
        ready = [i for i, (r, n) in enumerate(plan.work) if r.computed + n == len(r.tokens)]
        # Positions whose logits score the prompt token after them, for requests asking for prompt logprobs.
        scored = [(r, r.prompt_positions_to_score(r.computed, n), packed.query_starts[i] - r.computed)
                  for i, (r, n) in enumerate(plan.work)]
        score_at = [entry + p for _, positions, entry in scored for p in positions]  # row entries
        logits_at = packed.last_tokens[ready]
        if score_at:
            logits_at = torch.cat([logits_at, torch.tensor(score_at, device=device)])
        copies = self.manager.take_copies()  # copy-on-write, asked for while the scheduler reserved slots
        logits = self.runner.step(packed, tokens, logits_at, copies)  # [len(ready) + len(score_at), V]
        self.forward_passes += 1
        for r, n in plan.work:
            r.computed += n
        scores = logits[len(ready):]
        for r, positions, _ in scored:
            if positions:
                r.score_prompt(scores[: len(positions)])
                scores = scores[len(positions):]
        ready_requests = [requests[i] for i in ready]
        drawn = sample_next(ready_requests, logits[: len(ready)]) if ready else []
        forked = self._fork_followers(ready_requests, logits[: len(ready)])  # before a leader that ends frees blocks
        for request, token in [*zip(ready_requests, drawn), *forked]:
            request.append(token)
            events.append(request.event([token]))
            if request.finished:
                self.scheduler.remove(request, keep_blocks=request.id in self._hold)
        self._record(start, plan, decode_tokens, len(copies))
        return events

    def _fork_followers(self, ready: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, int]]:
        """The requests waiting on a leader whose prompt is now computed: each takes the leader's blocks
        (shared) and draws its own first token from the leader's logits. Returns (request, token) pairs."""
        forked = []
        for row, leader in enumerate(ready):
            followers = self._forks.pop(leader.id, None)
            if not followers:
                continue
            for follower in followers:
                self.manager.fork(leader.id, follower.id)
                follower.computed = leader.computed
                self.scheduler.adopt(follower)
            tokens = sample_next(followers, logits[row].expand(len(followers), -1))
            forked += zip(followers, tokens)
        return forked

    def _record(self, start: float, plan, decode_tokens: int, blocks_copied: int) -> None:
        running, m = self.scheduler.running, self.manager
        blocks_used = m.num_used
        # Only full blocks are shared, and they are full of keys: what is empty is each request's own.
        empty = sum(len(m.block_table(r.id)) * m.block_size - r.computed for r in running)
        self.timeline.append(StepRecord(
            start=start, seconds=time.perf_counter() - start, requests=[r.id for r, _ in plan.work],
            prefill_tokens=plan.num_tokens - decode_tokens, decode_tokens=decode_tokens,
            blocks_used=blocks_used, slots_filled=blocks_used * m.block_size - empty,
            tokens_stored=sum(r.computed for r in running),
            tokens_reserved=sum(len(r.prompt_ids) + r.max_new_tokens for r in running),
            preempted=[r.id for r in plan.preempted], blocks_copied=blocks_copied))

    # ------------------------------------------------------------------ summaries

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the prompt tokens admitted (recomputations included) whose keys came from the prefix cache."""
        m = self.manager
        return m.prefix_hit_tokens / m.prompt_tokens if m.prompt_tokens else 0.0


__all__ = ["Engine", "StepRecord", "kv_bytes_per_token"]
