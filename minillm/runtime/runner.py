"""The model runner: the one place every decoding path calls the model, for a batch of `Sequence`s.

    runner = ModelRunner(model, cache="static", graph="eager", max_len=512)
    logits = runner.prefill(seqs)               # [B, V]: next-token logits after each sequence's window
    logits = runner.decode(seqs)                # [B, V]: after each sequence's newest token
    logits = runner.verify(seqs, drafts, tree)  # [B, T, V]: after its newest token and each drafted one
    runner.rollback(seqs)                       # forget what the sequences did not keep (rejected drafts)

    engine_runner = ModelRunner(model, cache="paged", graph="auto", num_blocks=..., block_size=16)
    logits = engine_runner.step(packed, tokens, ready)   # one continuous-batching forward (lesson 12)

`generate`, speculative decoding, prompt lookup, lookahead, beam search and the engine all
call a runner, so how the model runs (its cache, and its graph mode) is decided here, once:

    cache   "static" (preallocated, lesson 06), "dynamic" (grows), "blocks" (rows in a block pool,
            beams sharing blocks: lesson 10), "none" (recompute: the baseline the cache is
            measured against), or "paged" (the engine's block pool, lesson 12)
    graph   "eager" (the model's own forward) or "compiled" (a decode graph, and with `verify_tokens`
            a verify graph for drafts, over a fixed-shape static cache, lesson 15: `minillm.speed.compile`;
            on a CPU kept on disk as an AOTInductor package by `minillm.speed.graph_store` and loaded,
            or built once, one package for every cache length (its length symbolic: `StepShape.any_length`,
            measured as fast as a package of one fixed length); on a GPU compiled in the process for a
            bucketed length and captured as a CUDA graph; either way when the runner is made: before the first step,
            never inside the loop; prompts run eagerly over the same cache, which measured faster
            than compiled chunks); over the paged cache, one kept package for the engine's steps in
            which every sequence decodes one token, its rows and lengths symbolic (`PagedShape`;
            steps that prefill run eagerly), on a GPU compiled in the process and captured once per
            bucket of rows and blocks (`minillm.speed.paged_buckets`); a model exported to ONNX
            (`minillm.speed.onnx_model.OnnxModel`) is its own graphs: graph "onnx", set by itself;
            "auto": "compiled" when its package is already on disk for this model and shape (and the
            model runs the default attention kernel; on a GPU, where nothing is kept, never), else
            "eager" (what the command line and the server run unless told)

A model the loader left out of huge pages (`load_model(defer_huge_pages=True)`, as the command line loads: a
one-shot run) is placed there here, once, when the run decodes eagerly. A run through kept graphs leaves it where
it is, even where a graph calls the library on the model's own weights (the Q4_1 and int8 steps): on the 2-core AMD
EPYC the copy took 0.64 s and the Q4_1 step ran 73.3 against 70.6 tok/s for it (median of six 64-token runs,
alternated), some 0.07 s back over a 128-token answer. Such a run's eager forwards (the prefill) multiply each
weight once, so they call oneDNN on the weight as it lies rather than pack it first (`use_unpacked_onednn`): on the
2-core AMD EPYC with AVX-512 an 805-token prefill took 0.66 s so, against 1.14 through MKL's `F.linear`, and a
22-token one 0.034 against 0.067 (packing every weight costs some 0.2 s).

For contiguous caches the runner keeps its rows in the order of the sequences it was last
given; a step over fewer sequences (some finished) drops the others' rows, so a strategy
only says which sequences go on. The rows, positions and masks themselves are the decode
session's job (`minillm.runtime.session`); the paged cache's are the block manager's.
"""

from __future__ import annotations

import functools
import time

import torch

from ..cache.paged import PackedSequences, PagedAttention, PagedKVCache
from ..model.attention import uses_default_attention
from ..parallel.follow import Announced, announce, announce_runner, group_answering, leads
from ..speed.compile import CompiledModel, compile_model
from ..speed.cuda_graph import CapturedStep
from ..speed.graph_forward import graph_problem
from ..speed.huge_pages import place_deferred, placement_deferred
from ..speed.onednn import use_unpacked_onednn
from ..speed.onnx_model import OnnxModel, OnnxSession
from ..speed.paged_buckets import BucketedPagedStep
from ..speed.step_shapes import PagedShape, StepShape, any_length_cache
from .sequence import Sequence
from .session import DecodeSession, Tree

CACHES = ("static", "dynamic", "blocks", "none", "paged")
# What the runner asks of its decode session that changes the cache: on rank 0 of a sharded model, each is sent
# to the other ranks first (`minillm.parallel.follow`), whose sessions then hold the same positions of their heads.
SESSION_CALLS = frozenset({"prefill", "extend", "rollback", "keep_positions", "select"})
GRAPHS = ("eager", "compiled", "auto", "onnx")


class ModelRunner:
    """Runs the model's prefill, decode and verify steps over one cache; see the module docstring."""

    def __init__(self, model, *, cache: str = "static", graph: str = "eager", max_len: int | None = None,
                 max_batch: int = 1, num_blocks: int | None = None, block_size: int = 16,
                 verify_tokens: int | None = None):
        """max_len: the most tokens a sequence will hold (contiguous caches); max_batch: the most rows a
        static cache is allocated for; num_blocks, block_size: the paged pool's size; verify_tokens: the
        most tokens one `verify` feeds a row (speculative decoding), so a compiled runner has a graph
        for them too."""
        if cache not in CACHES:
            raise ValueError(f"cache={cache!r} is invalid: use one of {', '.join(CACHES)}")
        if graph not in GRAPHS:
            raise ValueError(f"graph={graph!r} is invalid: use one of {', '.join(GRAPHS)}")
        if getattr(model, "split", None) is not None:  # one rank's shard (lesson 20): eager, its steps announced
            if graph in ("compiled", "onnx"):
                raise ValueError("a sharded model (--tp) runs eagerly: the compiled graphs are built for one process, "
                                 "without the all-reduces between ranks; drop --compile")
            graph = "eager"
        self.leads = leads(model)  # rank 0 of a sharded model: tells the other ranks each step before it runs it
        if self.leads:
            announce_runner(dict(cache=cache, max_len=max_len, max_batch=max_batch, num_blocks=num_blocks,
                                 block_size=block_size, verify_tokens=verify_tokens))
        exported = isinstance(model, OnnxModel)
        shapes = [StepShape.decode(model.config, max_batch, max_len)]  # the compiled graphs the run needs
        if verify_tokens and verify_tokens > 1:
            shapes.append(StepShape.verify(model.config, max_batch, verify_tokens, max_len))
        in_process = isinstance(model, CompiledModel) and not model.kept  # a twin compiled here, as a GPU's is
        if not exported and model.device.type == "cpu" and not in_process:  # kept packages: one for every length
            shapes = [shape.any_length() for shape in shapes]
        if cache == "paged":  # the engine's one step that is compiled: every sequence decoding
            shapes = [PagedShape(block_size)]
        self.kept_problem = None  # with graph="auto": why a kept graph this run could use was not (not "missing")
        self.unbuilt: list = []  # with graph="auto": the shapes whose kept graph this run could use but lacks
        if graph == "auto":  # the compiled graphs when they are already built for this run, else eager
            eligible = (cache in ("static", "paged") and isinstance(model, torch.nn.Module)
                        and model.device.type == "cpu"  # a GPU keeps nothing: it compiles and records when asked
                        and graph_problem(model.config, cache) is None  # long RoPE, experts: no fixed graph
                        and uses_default_attention(model))  # another kernel asked for (lesson 16) runs eagerly
            kept = compile_model(model, kept=True) if eligible else None
            problems = list(map(kept.kept_problem, shapes)) if eligible else []
            if eligible and len(shapes) > 1 and problems[1] == "missing":  # a longer kept verify graph serves too
                shapes[1] = kept.kept_verify_holding(shapes[1]) or shapes[1]
                problems[1] = kept.kept_problem(shapes[1])
            # The decode graph decides; a verify graph not built leaves speculative rounds that draft to the
            # eager forward over the same cache, while the plain steps between them still run compiled.
            graph = "compiled" if eligible and problems[0] is None else "eager"
            self.kept_problem = next((p for p in problems if p not in (None, "missing")), None)
            self.unbuilt = [shape for shape, problem in zip(shapes, problems) if problem] if graph == "compiled" else []
            shapes = [shape for shape, problem in zip(shapes, problems) if problem is None]
        if graph == "compiled" and cache not in ("static", "paged"):
            raise ValueError(f"compiled graphs run over the static cache (the engine's over the paged one), not "
                             f"cache={cache!r}: use cache='static'")
        if graph == "compiled" and cache == "paged" and (problem := graph_problem(model.config, cache)):
            raise ValueError(f"{problem}: serve this model without --compile")
        if graph == "onnx" and not exported or exported and (graph == "compiled" or cache != "static"):
            raise ValueError("an ONNX export runs its own graphs over its own static cache: load it with "
                             "OnnxModel(folder) and leave cache and compile at their defaults")
        if not exported and not (graph == "compiled" and model.device.type == "cpu"):
            place_deferred(model)  # an eager decode: the model into huge pages (if the loader deferred)
        elif not exported and placement_deferred(model):  # a one-shot run through kept graphs: see the module doc
            use_unpacked_onednn(model)
        self.model, self.cache_kind, self.graph = model, cache, "onnx" if exported else graph
        self.rows: list[Sequence] = []  # the sequences the contiguous cache holds, in row order
        self.build_seconds = 0.0  # how long loading or building the compiled graphs took, before any step
        if exported:
            self.session = OnnxSession(model, max_len, max_batch)
            return
        if cache == "paged":
            if num_blocks is None:
                raise ValueError("a paged runner needs num_blocks (the pool's size)")
            self.session, self.decode_step = None, None
            self.compiled_steps = 0  # steps the compiled graph ran (the rest, prefilling ones, ran eagerly)
            compiled = compile_model(model, kept=model.device.type == "cpu") if graph == "compiled" else None
            # Compiled in this process (a GPU's path), the step is padded to buckets whose spare rows write
            # into one more block than the block manager hands out (`BucketedPagedStep`).
            bucketed = compiled is not None and not compiled.kept
            self.cache = PagedKVCache.for_model(model, num_blocks + bucketed, block_size)
            if isinstance(model, CompiledModel):  # its twin decodes; prefilling steps run the model eagerly
                self.model = model.model
            if compiled is not None and compiled.kept:
                self.build_seconds = compiled.prepare(shapes)
                self.decode_step = compiled.packages[shapes[0]]
            elif bucketed:
                start = time.perf_counter()
                most_blocks = min(num_blocks, -(-model.config.context_length // block_size))
                record = (functools.partial(CapturedStep, pool=torch.cuda.graph_pool_handle())
                          if model.device.type == "cuda" else None)  # on a GPU every bucket in one memory pool
                self.decode_step = BucketedPagedStep(compiled.paged_step(shapes[0]), *self.cache.block_pools(),
                                                     num_blocks, block_size, max_batch, most_blocks, record)
                self.decode_step.record_all()
                self.build_seconds = time.perf_counter() - start
            self.pools = self.cache.block_pools()
            return
        if graph == "compiled":  # one cache length per bucket, so most runs reuse the graphs already built
            # On a CPU the graphs are AOTInductor packages kept on disk; on a GPU they are compiled in this
            # process and captured as CUDA graphs over this runner's cache, both before the first token.
            compiled = compile_model(model, kept=model.device.type == "cpu")
            cache_len = shapes[0].cache_len or any_length_cache(max_len or model.config.context_length,
                                                                model.config.context_length)
            self.session = DecodeSession(compiled, cache, cache_len, max_batch, fixed_shape=True)
            self.build_seconds = compiled.prepare(shapes, self.session)
        else:
            self.session = DecodeSession(model, cache, max_len, max_batch)
        if self.leads:
            self.session = Announced(self.session, "session", SESSION_CALLS)

    def graph_stats(self) -> dict:
        """What a run's stats say about its path: the graph that ran, why a kept graph was not loaded when one is
        there but damaged (the command line names it rather than calling it unbuilt), and whether speculative
        rounds verified eagerly beside a compiled decode (no verify graph kept for them)."""
        return {"graph": self.graph, **({"kept_problem": self.kept_problem} if self.kept_problem else {}),
                **({"verify_graph": "eager"} if self.unbuilt else {})}

    @property
    def device(self):
        return self.model.device

    @property
    def max_len(self) -> int:
        return self.session.max_len

    # ------------------------------------------------------------------ contiguous caches

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Start the cache over with these sequences' windows; next-token logits [B, V]."""
        self.rows = list(seqs)
        return self.session.prefill([s.window() for s in seqs])

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token; next-token logits [B, V]."""
        self._keep(seqs)
        return self.session.extend([[s.tokens[-1]] for s in seqs])[:, -1]

    def verify(self, seqs: list[Sequence], drafts: list[list[int]], tree: Tree | None = None) -> torch.Tensor:
        """Feed each sequence's newest token and its draft (a chain, or the nodes of `tree`); logits [B, T, V]
        after each fed token. Drafts of one call have one length (a tree is one shape for every row)."""
        self._keep(seqs)
        return self.session.extend([[s.tokens[-1], *d] for s, d in zip(seqs, drafts)], tree)

    def feed(self, seqs: list[Sequence], tokens: list[list[int]]) -> torch.Tensor:
        """Feed these tokens after what the cache holds for each sequence (equal counts); logits [B, T, V]."""
        self._keep(seqs)
        return self.session.extend(tokens)

    def held(self, seq: Sequence) -> list[int]:
        """The token ids the cache holds for a sequence (what it was fed and has not rolled back)."""
        return self.session.rows[self.rows.index(seq)] if seq in self.rows else []

    def rollback(self, seqs: list[Sequence], lengths: list[int] | None = None) -> None:
        """Cut each sequence's cache back to `lengths` (default: all of its tokens but the newest, which the
        next step feeds): drafts the target rejected are forgotten."""
        self._keep(seqs)
        self.session.rollback([len(s.tokens) - 1 for s in seqs] if lengths is None else lengths)

    def keep_path(self, seq: Sequence, positions: list[int]) -> None:
        """Keep only the cache entries at these ascending positions of one sequence (a tree's accepted path)."""
        self.session.keep_positions(self.rows.index(seq), positions)

    def select(self, index, seqs: list[Sequence]) -> None:
        """Rows follow `index` (kept, dropped or duplicated: beams) and then belong to `seqs`."""
        self.session.select(index)
        self.rows = list(seqs)

    def _keep(self, seqs: list[Sequence]) -> None:
        """Drop the rows of sequences no longer given (finished ones), keeping the rest in order."""
        if len(seqs) == len(self.rows) and all(a is b for a, b in zip(seqs, self.rows)):
            return
        where = {id(s): i for i, s in enumerate(self.rows)}
        if any(id(s) not in where for s in seqs):
            raise ValueError("a sequence the runner does not hold: prefill it first")
        index = [where[id(s)] for s in seqs]
        if index != sorted(index):
            raise ValueError("sequences must keep the order they were prefilled in (use select to reorder)")
        self.session.select(torch.tensor(index, device=self.device))
        self.rows = list(seqs)

    # ------------------------------------------------------------------ the paged cache

    def keep_alive(self) -> None:
        """Rank 0 of a sharded model, while no request runs: tell the other ranks it is still there (each waits for
        its next call under the group's timeout); a rank gone raises `RanksLost` here or at the next step."""
        if self.leads:
            announce(("runner", "keep_alive", (), {}))

    def step(self, packed: PackedSequences, tokens: torch.Tensor, logits_at: torch.Tensor,
             copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """One packed forward over the paged pool: tokens long [N] of several sequences back to back
        (`packed` says whose and where); logits [K, V] at the row entries `logits_at` [K]. `copies`: the
        (source, destination) blocks copy-on-write asks for, copied first."""
        if self.leads:
            announce(("runner", "step", (packed, tokens, logits_at), {"copies": copies}))
            with group_answering():  # a rank gone is found by the broadcast or by the forward's first all-reduce
                return self._step(packed, tokens, logits_at, copies)
        return self._step(packed, tokens, logits_at, copies)

    def _step(self, packed: PackedSequences, tokens: torch.Tensor, logits_at: torch.Tensor,
              copies: list[tuple[int, int]]) -> torch.Tensor:
        self.cache.copy_blocks(copies)
        if self.decode_step is not None and len(packed.decode_queries) == packed.num_tokens:
            # Every sequence feeds one token (row entry i is sequence i's): the compiled step, logits [D, 1, V].
            logits = self.decode_step(tokens[:, None], packed.positions[:, None], packed.slots,
                                      packed.decode_blocks, *self.pools)
            self.compiled_steps += 1
            return logits[logits_at, 0]
        PagedAttention.install(self.model)  # idempotent: a backend swapped in since is wrapped again
        self.cache.begin_step(packed)
        return self.model(tokens[None], packed.positions[None], cache=self.cache, packed=packed,
                          logits_at=logits_at[None])[0]


__all__ = ["ModelRunner", "CACHES", "GRAPHS"]
