"""Graph compilation: the model's forward as a few fixed-shape graphs (lesson 15).

At batch 1 a decode step reads every weight once, so its floor is memory bandwidth.
Two things keep an eager decoder far from it. Each of some twenty small ops per
block (norms, RoPE, reshapes, the cache write, the mask, SDPA, the gated MLP) is a
separate Python call and kernel launch over tiny tensors. And each matmul is one
activation row times a weight matrix, a shape general GEMM libraries are not built
for: they stream the weight well below the memory bandwidth. `torch.compile` traces
the forward into one graph; Inductor fuses the elementwise ops into a few generated
C++ loops and replaces the library matmuls with kernels generated for each weight's
exact shape (`inductor_settings`), where those run faster (`matmul_kernels`).

A graph is only reusable while the shapes it was traced with stay the same. A
growing cache changes the key length every step, which would mean a new graph per
token. So the compiled forward runs over a *fixed-shape* static cache
(`StaticCache(fixed_shape=True)`): attention always sees all `max_len` columns and
the mask hides the ones not written yet. The cache write happens inside the graph
too, at column indices given as a tensor (`ColumnWrites`), so no Python integer
that changes per step reaches the graph. Three graphs cover everything:

    decode        T = 1 token per row                          (one per batch size and cache length)
    prefill chunk T = `chunk` tokens, logits at one per row    (prompts cut into chunks, the last padded)
    verify chunk  T = `chunk` tokens, logits at all of them    (speculative verification, trees)

so neither a new decode step nor a new prompt length compiles anything again
(`CompiledModel.graphs` counts compilations; the lesson's test checks it stays put).

`compile_model(model)` returns a `CompiledModel` that answers the model's own call,
`compiled(tokens, positions, cache=..., mask=...)`; the original model is the off
switch and stays untouched (the compiled one works on its own plain copy, so
Inductor may pack its weights for its own matmul kernels). `generate(...,
compile=True)` uses one cached per model.

`graph_forward` (`minillm.speed.graph_forward`) is the pure function both this module and
the ONNX export (`minillm.speed.export`) trace: tokens, positions and the past keys/values
in, logits and the updated keys/values out.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..cache.kv_cache import StaticCache
from ..model.attention import set_attention_backend
from .attention_kernels import make_backend
from .cuda_graph import CapturedStep
from .graph_forward import CacheStep, graph_ready_copy, refuse_ungraphable
from .graph_store import PackagedStep, graph_key, kept_problem, load_or_build
from .inductor import check_matmul_kernels, inductor_settings, matmul_kernels
from .onednn import linears_call_onednn
from .step_shapes import PagedShape, StepShape, causal_columns, spare_rows_fed


class CompiledModel:
    """`model`'s call, run as compiled graphs whenever the cache is a fixed-shape StaticCache.

    Without a cache there is nothing to keep fixed and the eager model answers. A
    forward whose padded chunk would not fit the cache also runs eagerly (counted in
    `eager_calls`): the session's cache is the same either way.
    """

    def __init__(self, model, chunk: int = 64, matmuls: str | None = None, kept: bool = False):
        """kept: run the graphs as AOTInductor packages kept on disk (`minillm.speed.graph_store`), built
        or loaded by `prepare` before the run; False: torch.compile them in this process as they are met.
        matmuls: the kernels that run the weight matmuls, "library", "generated", "timed" or "onednn"
        (`minillm.speed.inductor.MATMUL_KERNELS`) for every shape; None decides for each step's shape, by
        the model, the rows it multiplies and the device (`matmul_kernels`)."""
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: the prefill chunk length must be >= 1")
        check_matmul_kernels(matmuls)
        self.model, self.chunk, self.config, self.matmuls, self.kept = model, chunk, model.config, matmuls, kept
        self.graphs = 0  # graphs compiled so far (a recompile adds one)
        self.compile_seconds = 0.0  # wall time of the calls that compiled a graph
        self.eager_calls = 0
        refuse_ungraphable(model.config)
        # StepShape -> what runs it, once `prepare` made it ready: a loaded package (kept) or this process's
        # compiled step. After `prepare`, a shape not in here runs eagerly instead of compiling in the loop.
        self.packages = {}
        self.only_prepared = kept
        self._matmuls_by_rows = {}  # matmul_kernels' answer per rows, asked once (it walks the model's tensors)
        if kept:  # the traced copy is made only if a package must be built: loading one needs no copy
            return
        # Dynamo re-checks, before every call, that nothing it traced has changed: for a module that is
        # hundreds of attribute checks, about a millisecond per decode step. This module is private to
        # the twin and its weights are frozen into the graph, so the checks on it are skipped.
        self.step = torch.compile(self.step_module, backend=self._backend, fullgraph=True, dynamic=False,
                                  options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        # Every twin (a model and its settings) compiles the same forward, an entry per shape on one code object;
        # past dynamo's default of 8 the next would run eagerly without a word (a GPU suite's seven twins came near).
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))  # (an older torch's name)

    @functools.cached_property
    def step_module(self) -> CacheStep:
        """The unit that is traced: a graph-ready copy of the model behind `CacheStep`."""
        graph_model = graph_ready_copy(self.model)
        # Attention written out as plain tensor ops (the textbook formula, lesson 16's `naive_attention`):
        # Inductor fuses its mask, softmax and products with the cache write around it, where SDPA would
        # stay one opaque library call per layer.
        set_attention_backend(graph_model, make_backend("naive"))
        return CacheStep(graph_model).eval()

    @functools.cached_property
    def onednn_step_module(self) -> CacheStep:
        """`step_module` with its linears calling oneDNN's product on packed weights (`linears_call_onednn`)."""
        return CacheStep(linears_call_onednn(copy.deepcopy(self.step_module.model))).eval()

    def traced_module(self, matmuls: str) -> CacheStep:
        """What a package whose matmuls are `matmuls` traces (made only when one is built)."""
        return self.onednn_step_module if matmuls == "onednn" else self.step_module

    def prepared_for(self, shape: StepShape):
        """What `prepare` made ready to run a step of `shape`: its own package, or one for any cache length; or None."""
        prepared = self.packages.get(shape)
        if prepared is None and isinstance(shape, StepShape):
            prepared = self.packages.get(shape.any_length())
        return prepared

    def kept_problem(self, shape: StepShape) -> str | None:
        """None when an intact kept package for `shape` is on disk (so `prepare` would load rather than build it);
        else "missing", or what is damaged."""
        return kept_problem(self.model, shape, self.settings_for(shape))

    def kept_verify_holding(self, shape: StepShape) -> StepShape | None:
        """The smallest verify step kept intact on disk for `shape`'s rows and cache length that holds more tokens
        than `shape` (a draft is padded to it: `verify_length`), or None: a run drafting 4 tokens verifies through
        the default build's 8-token graph rather than eagerly."""
        for tokens in range(shape.tokens + 1, self.chunk + 1):
            wider = replace(shape, tokens=tokens, logits=tokens)
            if self.kept_problem(wider) is None:
                return wider
        return None

    def matmuls_for(self, shape: StepShape | PagedShape) -> str:
        """The kernels that run the matmuls of the step of `shape`: the choice given, or `matmul_kernels`' for the
        rows its matmuls multiply (one row: matrix-vector products; more, or any number: matrix products)."""
        if self.matmuls is not None:
            return self.matmuls
        if shape.rows not in self._matmuls_by_rows:
            self._matmuls_by_rows[shape.rows] = matmul_kernels(self.model, shape.rows)
        return self._matmuls_by_rows[shape.rows]

    def settings_for(self, shape: StepShape | PagedShape) -> dict:
        """What, beside the model and the shape, changes the kept package of `shape`: part of its key."""
        return {"matmuls": self.matmuls_for(shape)}

    def prepare(self, shapes, session=None, progress: bool = True) -> float:
        """Make the steps of these `StepShape`s (and `PagedShape`s) ready before the run; the seconds it took.

        Kept: load (or build, and keep) their packages. Building is the slow part (40 s to three minutes
        per graph for the default model on two cores, once per machine); loading a kept package
        takes a fraction of a second. In this process (`kept=False`, what a GPU runs): compile each step
        over `session`'s cache (a fixed-shape `DecodeSession`) and, on a GPU, record it as a CUDA
        graph over that cache (`CapturedStep`: one launch per step), so nothing is compiled or
        recorded after the first token. Either way, from then on a shape not prepared runs eagerly.
        """
        if not self.kept and session is None:
            raise ValueError("prepare() in this process compiles over a cache: pass the fixed-shape DecodeSession")
        if not self.kept and any(isinstance(shape, PagedShape) for shape in shapes):
            raise ValueError("the engine's compiled step over the paged pool is a package kept on disk for the CPU; "
                             "in this process (a GPU's path) only the static cache's steps are compiled")
        # A CUDA graph is bound to the cache it was recorded over: a new session records its steps again
        # (in seconds: the compiled kernels are reused).
        captured = not self.kept and self.device.type == "cuda"
        needed = list(shapes) if captured else [s for s in shapes if s not in self.packages]
        if captured:  # forget the graphs recorded over another cache (until recorded again, a shape runs eagerly)
            for shape in needed:
                self.packages.pop(shape, None)
        self.only_prepared = True
        start = time.perf_counter()
        with tqdm(total=len(needed), desc="compiled graphs", unit="graph", disable=not progress or not needed,
                  leave=False) as bar:
            for shape in needed:
                if self.kept:
                    key, matmuls = graph_key(self.model, shape, self.settings_for(shape)), self.matmuls_for(shape)
                    self.packages[shape] = load_or_build(
                        self.model, lambda: shape.module(self.traced_module(matmuls)), shape, key,
                        lambda: inductor_settings(matmuls, self.device), progress=bar.set_postfix_str)
                else:
                    self.packages[shape] = self._warm(shape, session, captured)
                bar.update()
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        return seconds

    def _warm(self, shape: StepShape, session, captured: bool):
        """Compile the step for `shape` over `session`'s own cache storage (and record it, `captured`)."""
        if session.cache is None:
            session.prefill([[0]] * shape.batch)  # allocates the cache (this one-token prompt runs eagerly)
        keys, values = session.cache.k_layers, session.cache.v_layers
        inputs = shape.example_inputs(self.config, self.dtype, self.device)[:-2]  # writes column 0 onward
        if captured:
            with inductor_settings(self.matmuls_for(shape), self.device):
                step = CapturedStep(self._compiled_step, inputs, keys, values)
        else:
            self._timed(*inputs, keys, values)
            step = self.step
        session.cache.reset()  # the rows prefill starts over
        return step

    def paged_step(self, shape: PagedShape):
        """The engine's step (`PagedDecodeStep`) compiled in this process with its sizes symbolic, under this
        model's settings: what a GPU records once per bucket of rows and blocks (`BucketedPagedStep`). It
        compiles on its first call, once per process: each engine's pool is recorded afresh, from the same
        compiled kernels."""
        if self.kept:
            raise ValueError("a kept model loads the engine's step as a package (prepare); paged_step compiles it "
                             "in this process, which a GPU does")
        if shape not in self.packages:
            self.packages[shape] = self._paged_in_process(shape)
        return self.packages[shape]

    def _paged_in_process(self, shape: PagedShape):
        from torch.fx.experimental import _config as shapes_config

        compiled = torch.compile(shape.module(self.step_module), backend=self._backend, fullgraph=True, dynamic=True,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        matmuls = self.matmuls_for(shape)

        def step(*args):
            # Sizes that happen to be equal at the first call (a bucket's 2 blocks, 2 key heads) are not taken for
            # one size ("duck shaping"): the next bucket would compile again.
            with inductor_settings(matmuls, self.device), shapes_config.patch(use_duck_shape=False):
                return compiled(*args)
        return step

    def _compiled_step(self, *args):
        """This process's compiled step, its compile time counted (what `_timed` runs when nothing is kept)."""
        graphs, start = self.graphs, time.perf_counter()
        out = self.step(*args)
        if self.graphs != graphs:
            self.compile_seconds += time.perf_counter() - start
        return out

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype

    def num_weight_bytes(self) -> int:
        return self.model.num_weight_bytes()

    def _backend(self, graph_module, example_inputs):
        """Inductor, counting every graph it is handed."""
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph_module, example_inputs)

    def _timed(self, *args):
        """Run the step: a kept package, a step recorded as a CUDA graph, or this process's compiled step
        (which, met for the first time, compiles: its wall time is added to `compile_seconds`).
        args: `CacheStep.forward`'s."""
        shape = StepShape.of_step(*args)
        prepared = self.prepared_for(shape)
        if isinstance(prepared, (PackagedStep, CapturedStep)):
            return prepared(*args)
        # Set while the step runs: a graph compiles on its first call.
        with inductor_settings(self.matmuls_for(shape), self.device):
            return self._compiled_step(*args)

    def __call__(self, tokens, positions, cache=None, mask=None, last_only: bool = False, logits_at=None):
        """The model's forward (see `Transformer.forward`); `packed` batches are not supported."""
        if cache is None:
            return self.model(tokens, positions, mask=mask, last_only=last_only, logits_at=logits_at)
        if not (isinstance(cache, StaticCache) and cache.fixed_shape):
            raise ValueError("a compiled model runs over a fixed-shape static cache: use "
                             "DecodeSession(model, cache='static', fixed_shape=True) (generate(compile=True) does)")
        B, T = tokens.shape
        lengths = cache.lengths or [0] * B
        if max(lengths) + T > cache.max_len:
            raise RuntimeError(f"static KV cache is full: it holds {max(lengths)} of {cache.max_len} tokens and "
                               f"{T} more were asked for; create it with a larger max_len")
        starts = torch.tensor(lengths, device=tokens.device)[:, None]  # [B, 1]
        columns = starts + torch.arange(T, device=tokens.device)  # [B, T]: row b's token at its length + t
        causal = mask is None
        if causal:  # a token sees the columns up to its own
            mask = causal_columns(columns, cache.max_len)
        step = spare_rows_fed(cache.k.shape[1], tokens, positions, columns, mask)  # each [rows, T, ...]
        # One tensor per layer, not the [n_layer, ...] storage they are views of: written through a view of
        # one big input, the compiled graph would copy every layer's keys out and back each step.
        keys, values = cache.k_layers, cache.v_layers
        decode = T == 1 and (not self.only_prepared
                             or self.prepared_for(StepShape.of_step(*step, None, keys, values)) is not None)
        if decode:
            logits = self._timed(*step, None, keys, values)[:B]
        else:
            logits = self._chunked(*step, last_only, logits_at, keys, values, cache)
            if logits is None:
                self.eager_calls += 1
                if len(set(lengths)) == 1 and (causal or torch.equal(mask, causal_columns(columns, cache.max_len))):
                    # rows alike, plain causal (the mask a session gives a prompt)
                    with cache.columns_in_use():  # attend over the columns written, skipping the masked half
                        return self.model(tokens, positions, cache=cache, last_only=last_only, logits_at=logits_at)
                return self.model(tokens, positions, cache=cache, mask=mask, last_only=last_only,
                                  logits_at=logits_at)
            logits = logits[:B]
        cache.lengths, cache.batch = [n + T for n in lengths], B
        return logits

    def verify_length(self, rows: int, tokens: int, cache_len: int) -> int:
        """How many tokens one step feeds when all `tokens` need logits (verifying a draft): once prepared,
        the shortest verify step prepared that holds them (a shorter draft is padded to it); else `chunk`. The
        engine's paged step (a `PagedShape`, kept beside them once a server has run) is not a verify step."""
        if self.only_prepared:
            fits = [s.tokens for s in self.packages if isinstance(s, StepShape) and s.tokens == s.logits >= tokens > 1
                    and s.batch == rows and s.cache_len in (cache_len, None)]
            if fits:
                return min(fits)
        return self.chunk

    def _chunked(self, tokens, positions, columns, mask, last_only, logits_at, keys, values, cache):
        """T > 1 tokens in chunks of `chunk`, the last padded; None when the padding would not fit the cache.

        Padding tokens continue the positions and columns after the real ones and copy
        the last real token's mask row: whatever they write lies past the row's end,
        where the row's next tokens overwrite it before anything attends to it.
        """
        B, T = tokens.shape
        C = self.chunk if last_only or logits_at is not None else self.verify_length(B, T, mask.shape[-1])
        n_chunks = -(-T // C)
        pad = n_chunks * C - T
        if int(columns[:, -1].max()) + 1 + pad > cache.max_len:
            return None
        if last_only:
            wanted = torch.full((B, 1), T - 1, device=tokens.device)
        elif logits_at is not None:
            wanted = logits_at[:, None] if logits_at.dim() == 1 else logits_at  # [B, K]
            wanted = torch.cat((wanted, wanted[-1:].expand(B - len(wanted), -1)))  # the spare rows' too
        else:
            wanted = None  # every position: logits for each whole chunk
        if self.only_prepared and self.prepared_for(StepShape(B, C, cache.max_len,
                                                              C if wanted is None else wanted.shape[1])) is None:
            return None  # no graph was built for this shape: the eager forward over the same cache
        if pad:
            ahead = torch.arange(1, pad + 1, device=tokens.device)
            tokens = torch.cat((tokens, tokens[:, -1:].expand(B, pad)), dim=1)
            positions = torch.cat((positions, (positions[:, -1:] + ahead).clamp(max=self.config.context_length - 1)), 1)
            columns = torch.cat((columns, columns[:, -1:] + ahead), dim=1)
            mask = torch.cat((mask, mask[:, -1:].expand(B, pad, mask.shape[-1])), dim=1)
        pieces = []
        for start in range(0, n_chunks * C, C):
            part = [t[:, start : start + C].clone(memory_format=torch.contiguous_format)
                    for t in (tokens, positions, columns, mask)]
            at = None if wanted is None else (wanted - start).clamp(0, C - 1)  # None: every position's logits
            pieces.append(self._timed(*part, at, keys, values))  # [B, K, V]
        if wanted is None:
            return torch.cat(pieces, dim=1)[:, :T]
        rows = torch.arange(B, device=tokens.device)[:, None]
        return torch.stack(pieces)[wanted // C, rows, torch.arange(wanted.shape[1], device=tokens.device)]


class CompiledTwins(dict):
    """A model's compiled twins, kept on the model itself: (chunk, matmuls, kept) -> CompiledModel.

    A twin holds its model, so a table outside the model (a WeakKeyDictionary keyed by it) would keep
    every model ever compiled alive: the value holds the key. On the model, the two form a cycle that
    the garbage collector frees with the model. A copy of the model starts with no twins.
    """

    def __deepcopy__(self, memo) -> "CompiledTwins":
        return CompiledTwins()

    def __reduce__(self):
        return CompiledTwins, ()


def compile_model(model, chunk: int = 64, matmuls: str | None = None, kept: bool = False) -> CompiledModel:
    """The model's compiled twin, made once per model and settings (compiled graphs are kept with it).

    matmuls: the kernels that run the weight matmuls (`inductor_settings`): "library" (MKL, oneDNN,
    cuBLAS), "generated" (a kernel Inductor writes for each weight's shape), "timed" (both, the faster
    kept: the slowest to compile) or "onednn" (kept packages only: oneDNN's product on weights packed once, a
    float32 model on a CPU; compiled in this process it is the library's); None (the default): for each step
    by the model, the rows its matmuls multiply and the device (`matmul_kernels`). kept: its graphs are
    AOTInductor packages on disk (`minillm.speed.graph_store`), built once per machine and loaded
    by `CompiledModel.prepare`; False: compiled in this process by torch.compile when first met.
    """
    if isinstance(model, CompiledModel):
        return model
    twins = model.__dict__.setdefault("_compiled_twins", CompiledTwins())
    if (chunk, matmuls, kept) not in twins:
        twins[chunk, matmuls, kept] = CompiledModel(model, chunk, matmuls, kept)
    return twins[chunk, matmuls, kept]


__all__ = ["CompiledModel", "compile_model"]
