"""The cost model's arithmetic: a step's time from what it reads, computes, dispatches and waits for.

    predict(step) = work(step) + ops * op_seconds + syncs * sync_seconds
    work(step)    = max(bytes / bandwidth, flops / peak_flops)                        (the roofline)
                  = weight_bytes * kernel(rows) + attention + activations / bandwidth  (probed kernels)

The roofline: a step cannot finish before the machine has read what it reads (weights, KV
cache, activations) or done its arithmetic, whichever takes longer. Real kernels fall short of it,
so where the machine's probes cover a step's kernels they price it instead: an eager step's weight
matrices at the matrix library's speed for matrices of the model's shapes at its rows
(`Machine.linear`) and its attention at what one `scaled_dot_product_attention` call per layer over
that many keys takes (`Machine.attention`); a compiled step's weight matrices at the speed of the
kernels a compiled graph runs for their format at one row. The rest is overhead the roofline does
not see: every eager PyTorch op is a Python call and a dispatch (a kernel launch on a GPU), and every
`.item()` waits for the device. The step's counts come from the model's config by formula
(`decode_step`, `packed_step`); the machine's constants come from the probes in `probes.py`. Nothing
here times a step, so a prediction is made before the measurement it predicts
(lessons/cost-model/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..model.config import ModelConfig
from ..strategies.acceptance import expected_tokens_per_round

# aten ops one decode step dispatches (T = 1, a static cache), by part of the model: read off the code
# (`model/transformer.py`, `norms.py`, `rope.py`) and checked against a real count by tests/test_cost_model.py.
NORM_OPS = {"layernorm": 5, "rmsnorm": 8, "gemma_rmsnorm": 9}  # casts to float32 and back, the statistics
ATTENTION_OPS = 19  # qkv and out projections, views, transposes, the cache's two copies, SDPA
ROPE_OPS = 6  # rotate q and k together: two slices, a cat, two muls, an add
GQA_FOLD_OPS = 2  # one query, n_head > n_kv_head: fold the query heads onto their KV head and back
MLP_OPS = {"gated": 5, "plain": 3}  # two matmuls, the activation (and chunk, product when gated)
FORWARD_OPS = 7  # two constants, the token embedding, the LM head, the float32 cast of the logits ...
ROPE_TABLE_OPS = 6  # ... the RoPE table look-up (the max position: one host sync, the two gathers)
LEARNED_POSITION_OPS = 2  # ... or GPT-2's position embedding and its add
# A continuous-batching step over the paged pool (lesson 12, `cache/paged.py`), on top of the plain ops; counted
# with grouped-query heads (as SmolLM2 has) and checked against the dispatcher by tests/test_cost_model.py:
PACKED_LAYER_OPS = 8  # per layer: the new keys written into their slots, the output buffer
PACKED_DECODE_OPS = 18  # per layer, once for all one-token rows: their blocks gathered, masked, one batched SDPA
PACKED_CHUNK_OPS = 16  # per layer and prompt chunk: its blocks gathered, the KV heads repeated, its causal SDPA
PACKED_FORWARD_OPS = 3  # once per step: the packed positions and the rows whose logits are kept
# The default model (SmolLM2-135M-Instruct), written out so a prediction needs no weights.
SMOLLM2_135M = ModelConfig(vocab_size=49152, context_length=8192, n_layer=30, n_head=9, n_kv_head=3, d_model=576,
                           d_ff=1536, norm="rmsnorm", positions="rope", rope_theta=100000.0, mlp="swiglu", bias=False,
                           qkv_bias=False)


def log_interpolate(curve, x: float) -> float | None:
    """The curve's value at `x`, log-linear between its (x, y) points; None for an empty curve.

    Below the first point: the first value (a kernel does not get cheaper than its smallest probed call).
    Past the last: the last value scaled by x / last x (the work grows with x there).
    """
    curve = sorted(curve)
    if not curve:
        return None
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            share = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + share * (math.log(y1) - math.log(y0)))
    last_x, last = curve[-1]
    return last * x / last_x


@dataclass(frozen=True)
class Machine:
    """What a machine can do: read bandwidth (bytes/s), peak arithmetic (flop/s), cost of an op and of a sync, and
    how fast its libraries run the two kernels an eager step spends most of its time in.

    `linear[dtype]` is a curve of (rows, seconds per weight byte) points from `probes.measure_linear_rates` over
    matrices of the model's own block shapes, `linear[dtype + " head"]` the same for its LM head, and
    `linear[format + " compiled"]` one point at one row through a compiled graph's kernels for float32,
    bfloat16, int8 or int4 weights (`probes.measure_compiled_rates`): a library
    matrix-vector product rarely streams its weights at the bandwidth a plain sum reaches, how near it comes
    depends on the matrix's shape, and a product over a few rows is neither memory- nor compute-bound at its
    peak. `attention[(batch, queries)]` is a curve of (keys, seconds per call) points from
    `probes.measure_attention_seconds`: one attention call of `batch` rows with `queries` new tokens each over
    that many cached keys, for one layer. Both empty when only the four scalar constants are known; then every
    step is priced by the roofline alone.
    """

    bandwidth: float
    peak_flops: float
    op_seconds: float
    sync_seconds: float
    linear: dict = field(default_factory=dict, hash=False, compare=False)
    attention: dict = field(default_factory=dict, hash=False, compare=False)
    allreduce: dict = field(default_factory=dict, hash=False, compare=False)  # ranks -> ((bytes, seconds), ...)

    def linear_seconds_per_byte(self, dtype: str, rows: int, part: str = "block") -> float | None:
        """The library's time per weight byte of a block matrix (`part` 'block') or of the LM head ('head') at
        `rows` rows, log-linear between probed row counts and compute-bound past them; None if not probed.
        The head falls back on the block curve where it was not probed apart."""
        curve = self.linear.get(f"{dtype} head", ()) if part == "head" else ()
        return log_interpolate(curve or self.linear.get(dtype, ()), rows)

    def allreduce_seconds(self, ranks: int, nbytes: float) -> float | None:
        """One all-reduce of `nbytes` among `ranks` processes, log-linear between the probed sizes
        (`probes.measure_allreduce_seconds`: gloo over this machine's loopback); None if that group was not probed."""
        return log_interpolate(self.allreduce.get(ranks, ()), nbytes)

    def attention_seconds(self, batch: int, queries: int, keys: int) -> float | None:
        """One layer's attention call for `batch` rows of `queries` new tokens over `keys` keys, from the probed
        calls: the nearest probed (batch, queries) at or below these, scaled by the rows and queries it lacks
        (each is more of the same work), log-linear in the keys. None where nothing at or below was probed, or
        where more queries come than any probed call had (a prefill: another kernel, priced by its flops)."""
        below = [(b, q) for b, q in self.attention if b <= batch and q <= queries]
        if not below or queries > max(q for _, q in self.attention):
            return None
        b, q = max(below, key=lambda bq: (bq[0] * bq[1], bq[0]))
        return log_interpolate(self.attention[(b, q)], keys) * (batch / b) * (queries / q)


@dataclass(frozen=True)
class Step:
    """What one forward costs in counts; `tokens` is how many tokens it yields (for tokens/s).

    `rows` is how many rows each weight matrix multiplies (batch x new tokens per row), `dtype` the weights' type
    and `kernels` who multiplies them: 'library' (eager PyTorch calls its matrix library, whose speed at `rows`
    rows the machine's `linear` curve gives), 'generated' (a compiled graph's kernels, whose speed at one row
    the machine's `linear[dtype + " compiled"]` gives; the roofline where it is not known) or 'roofline' (kernels
    no probe covers, such as lesson 16's attention kernels on their own: the roofline prices them).
    `attention_flops` is the part of `flops` outside the weight matrices; `attention_calls` of
    `batch` rows with `queries` new tokens each over `keys` keys is how the eager step computes it (one call a
    layer; 0 where the step's attention is not one such call per layer, as in a packed step).
    """

    weight_bytes: float
    kv_bytes: float = 0.0
    activation_bytes: float = 0.0
    flops: float = 0.0
    ops: int = 0
    syncs: int = 0
    tokens: float = 1.0
    rows: int = 1
    dtype: str = "float32"
    kernels: str = "roofline"
    attention_flops: float = 0.0
    head_bytes: float = 0.0  # the part of weight_bytes that is the LM head, which multiplies only head_rows rows
    head_rows: int = 1
    head_dtype: str | None = None  # the LM head's type where it differs from the blocks' (an int8 head)
    attention_calls: int = 0
    batch: int = 1
    queries: int = 1
    keys: int = 0
    ranks: int = 1  # processes computing the step together (tensor parallelism: this step is one rank's share)
    collectives: int = 0  # all-reduces (and the all-gather and step message, priced alike) each rank waits in
    collective_bytes: float = 0.0  # the bytes of each

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes


def roofline_seconds(step: Step, machine: Machine) -> float:
    """The time the bytes or the flops need at the machine's peak, whichever is longer."""
    return max(step.bytes / machine.bandwidth, step.flops / machine.peak_flops)


def attention_seconds(step: Step, machine: Machine) -> float:
    """The step's attention: its calls at the machine's probed speed where the step makes them one a layer and
    the machine probed such calls; else its cache read or its arithmetic at the roofline."""
    library = step.attention_calls and step.kernels == "library"  # a compiled step's attention is its own loops
    call = machine.attention_seconds(step.batch, step.queries, step.keys) if library else None
    if call is None:
        return max(step.kv_bytes / machine.bandwidth, step.attention_flops / machine.peak_flops)
    return step.attention_calls * call


def work_seconds(step: Step, machine: Machine) -> float:
    """The step's reading and arithmetic: the roofline, or, where the machine's curves for the step's kernels are
    known, its weight matrices at the probed speed of those kernels (an eager step's: the library's, at its rows;
    a compiled step's: the generated ones', at one row) plus its attention (`attention_seconds`) and the
    activations read and written at the bandwidth."""
    if step.kernels == "library":
        curve, head_curve = step.dtype, step.head_dtype or step.dtype
    else:  # generated kernels were probed at one row: a compiled step over more is priced by the roofline
        curve, head_curve = f"{step.dtype} compiled", f"{step.head_dtype or step.dtype} compiled"
    probed = step.kernels == "library" or (step.kernels == "generated" and step.rows == 1)
    per_byte = machine.linear_seconds_per_byte(curve, step.rows) if probed else None
    if per_byte is None:
        return roofline_seconds(step, machine)
    head_per_byte = machine.linear_seconds_per_byte(head_curve, step.head_rows, part="head") or per_byte
    return ((step.weight_bytes - step.head_bytes) * per_byte + step.head_bytes * head_per_byte
            + attention_seconds(step, machine) + step.activation_bytes / machine.bandwidth)


def collective_seconds(step: Step, machine: Machine) -> float:
    """The step's waits in collectives: each at the probed all-reduce time for its group and size (none for one
    process; an unprobed group costs nothing here, and the prediction says so by being too fast)."""
    if step.ranks == 1 or not step.collectives:
        return 0.0
    return step.collectives * (machine.allreduce_seconds(step.ranks, step.collective_bytes) or 0.0)


def predict(step: Step, machine: Machine) -> float:
    """Seconds for the step: its reading and arithmetic, the overhead of its ops and syncs, and its collectives."""
    return (work_seconds(step, machine) + step.ops * machine.op_seconds + step.syncs * machine.sync_seconds
            + collective_seconds(step, machine))


def tokens_per_second(step: Step, machine: Machine) -> float:
    return step.tokens / predict(step, machine)


def bound(step: Step, machine: Machine) -> str:
    """Which term dominates: 'memory', 'compute' or 'overhead' ('library' where the library's curve prices it)."""
    overhead = step.ops * machine.op_seconds + step.syncs * machine.sync_seconds
    if step.kernels == "library" and machine.linear_seconds_per_byte(step.dtype, step.rows) is not None:
        return "library" if work_seconds(step, machine) >= overhead else "overhead"
    terms = {"memory": step.bytes / machine.bandwidth, "compute": step.flops / machine.peak_flops,
             "overhead": overhead}
    return max(terms, key=terms.get)


# --- Counts from the config. -------------------------------------------------------------------------------------


def matmul_flops(m: int, k: int, n: int) -> int:
    """[m, k] @ [k, n]: m * n dot products of length k, a multiply and an add each."""
    return 2 * m * k * n


def block_matrix_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of each weight matrix one block multiplies, as the model holds them: the query, key and value
    projections as one matrix, the output projection, the MLP's gate and up as one (when gated) and down."""
    c = config
    gated = c.mlp in ("swiglu", "geglu")
    return [((c.n_head + 2 * c.kv_heads) * c.head_size, c.d_model), (c.d_model, c.n_head * c.head_size),
            ((2 if gated else 1) * c.ff_size, c.d_model), (c.d_model, c.ff_size)]


def head_shape(config: ModelConfig) -> tuple[int, int]:
    """(out, in) of the LM head: a score for every token of the vocabulary."""
    return config.vocab_size, config.embed_size


def block_matrix_params(config: ModelConfig) -> int:
    """Weights of one block's matrices (q/k/v, out, MLP): each is read once and used for 2 flops per row."""
    return sum(out * inp for out, inp in block_matrix_shapes(config))


def weight_bytes(config: ModelConfig, bytes_per_weight: float = 4.0, head_bytes_per_weight: float | None = None,
                 norm_bytes: float = 4.0) -> float:
    """Bytes of weights one forward reads: every matrix once (a tied LM head once), biases and norms.

    `bytes_per_weight` is the dtype's size (4, 2) or a quantized format's bits / 8 with its scales
    (int8 with a float scale per row is 8.03 bits); the embedding / LM head may be stored apart.
    """
    c = config
    head = bytes_per_weight if head_bytes_per_weight is None else head_bytes_per_weight
    n_norms = (4 if c.post_norms else 1 if c.block == "parallel" else 2) * c.n_layer + (1 if c.final_norm else 0)
    norm_params = n_norms * c.d_model * (2 if c.norm == "layernorm" else 1)
    if c.qk_norm:
        norm_params += 2 * c.n_layer * c.head_size
    biases = 0
    if c.qkv_bias:
        biases += c.n_layer * (c.n_head + 2 * c.kv_heads) * c.head_size
    out_bias = c.bias if c.attn_out_bias is None else c.attn_out_bias
    biases += c.n_layer * ((c.d_model if out_bias else 0)
                           + (c.ff_size * (2 if c.mlp in ("swiglu", "geglu") else 1) + c.d_model if c.bias else 0))
    embeddings = c.vocab_size * c.embed_size * (1 if c.tie_embeddings else 2)
    positions = c.context_length * c.d_model if c.positions == "learned" else 0
    projections = 2 * c.d_model * c.embed_size if c.embed_size != c.d_model else 0
    matrices = c.n_layer * block_matrix_params(c) + projections + positions
    return matrices * bytes_per_weight + embeddings * head + (norm_params + biases) * norm_bytes


def kv_bytes_per_token(config: ModelConfig, element: float = 4.0) -> float:
    """A key and a value vector per KV head per layer (latent attention: one latent): what the cache stores for each
    token."""
    return config.cache_values_per_token * element


def attention_flops(config: ModelConfig, queries: int, keys: int) -> int:
    """q kᵀ and p v for `queries` new tokens over `keys` visible keys, in every layer."""
    return config.n_layer * 2 * matmul_flops(queries, config.head_size, keys) * config.n_head


def forward_flops(config: ModelConfig, tokens: int, context: int, logits: int = 1) -> int:
    """A forward of `tokens` new tokens per row after `context - tokens` cached ones; LM head at `logits` rows."""
    matrices = config.n_layer * block_matrix_params(config) * tokens
    causal_pairs_mean = context - (tokens - 1) / 2  # the i-th new token sees context - tokens + i + 1 keys
    attention = config.n_layer * 4 * config.n_head * config.head_size * tokens * causal_pairs_mean
    return int(2 * matrices + attention + matmul_flops(logits, config.embed_size, config.vocab_size))


def eager_ops(config: ModelConfig, tokens: int = 1) -> int:
    """aten ops one eager forward dispatches (pre-norm blocks, as SmolLM2, Llama, Qwen2 and GPT-2 have)."""
    c = config
    attention = ATTENTION_OPS + (ROPE_OPS if c.positions == "rope" else 0)
    attention += GQA_FOLD_OPS if tokens == 1 and c.kv_heads < c.n_head else 0
    mlp = MLP_OPS["gated" if c.mlp in ("swiglu", "geglu") else "plain"]
    block = 2 * NORM_OPS[c.norm] + attention + mlp + 2  # two norms, two residual adds
    outside = FORWARD_OPS + (ROPE_TABLE_OPS if c.positions == "rope" else LEARNED_POSITION_OPS)
    outside += NORM_OPS[c.norm] if c.final_norm else 0
    return c.n_layer * block + outside


def compiled_kernels(config: ModelConfig) -> int:
    """Kernels a compiled decode graph calls per forward: per block four matmuls and about four fused loops
    (norm + residual, RoPE + cache write, attention, activation), plus the embedding, final norm and head."""
    return 8 * config.n_layer + 3


def decode_step(config: ModelConfig, batch: int = 1, context: int = 256, bytes_per_weight: float = 4.0,
                head_bytes_per_weight: float | None = None, kv_element: float = 4.0, cache: str = "static",
                graph: str = "eager", tokens_per_row: int = 1, acceptance: float | None = None,
                syncs: int = 2, dtype: str = "float32", head_dtype: str | None = None) -> Step:
    """One decode step of `batch` rows at `context` tokens, as the run's settings make it.

    cache 'static' / 'dynamic' / 'paged': the step feeds `tokens_per_row` new tokens (1, or k + 1 when
    verifying k drafted tokens) and reads the cache; 'none': it recomputes all `context` positions.
    graph 'eager' dispatches every aten op from Python; 'compiled' calls a few fused kernels.
    `acceptance` (with tokens_per_row = k + 1): the step yields (1 - a^(k+1)) / (1 - a) tokens per row.
    syncs: the RoPE table's max position and the sampler's token read back. dtype: the weights' type or format
    ('float32', 'bfloat16', 'int8', 'int4'), for the machine's curves (`bytes_per_weight` gives their size);
    head_dtype the LM head's, where it differs.
    """
    new = context if cache == "none" else tokens_per_row
    kv = 0.0 if cache == "none" else batch * context * kv_bytes_per_token(config, kv_element)
    activations = batch * new * config.d_model * 4 * 2 * config.n_layer  # the residual read and written per block
    flops = batch * forward_flops(config, new, context, logits=tokens_per_row)
    attention = batch * (forward_flops(config, new, context, logits=0) - 2 * config.n_layer
                         * block_matrix_params(config) * new)
    ops = eager_ops(config, new) if graph == "eager" else compiled_kernels(config)
    k = tokens_per_row - 1
    yielded = tokens_per_row if acceptance is None or k == 0 else expected_tokens_per_round(acceptance, k)
    head = config.vocab_size * config.embed_size * (bytes_per_weight if head_bytes_per_weight is None
                                                    else head_bytes_per_weight)
    return Step(weight_bytes(config, bytes_per_weight, head_bytes_per_weight), kv, activations, flops, ops, syncs,
                tokens=batch * yielded, rows=batch * new, dtype=dtype,
                kernels="library" if graph == "eager" else "generated", attention_flops=attention,
                head_bytes=head, head_rows=batch * tokens_per_row, head_dtype=head_dtype,
                attention_calls=config.n_layer, batch=batch, queries=new, keys=context)


def packed_step(config: ModelConfig, prefill_tokens: int, decode_rows: int, chunks: int, keys: int,
                syncs: int = 2) -> Step:
    """One continuous-batching step (lesson 12): `decode_rows` one-token rows and `chunks` prompt chunks of
    `prefill_tokens` in all, packed into one row, reading `keys` cached keys in all; logits for every row.

    The weights are read once for the whole step, however many requests share it: that is why the engine
    packs them; the library multiplies them over all the step's tokens as rows. The paged attention adds its
    writes and gathers to the plain ops (`PACKED_*_OPS`), and is priced by its bytes and flops (its calls
    are not the one-per-layer calls the attention probe times).
    """
    tokens = prefill_tokens + decode_rows
    rows = decode_rows + chunks
    matrices = 2 * config.n_layer * block_matrix_params(config) * tokens
    attention = config.n_layer * 4 * config.n_head * config.head_size * tokens * keys / max(rows, 1)
    flops = matrices + attention + matmul_flops(rows, config.embed_size, config.vocab_size)
    ops = eager_ops(config, tokens) + PACKED_FORWARD_OPS + config.n_layer * (
        PACKED_LAYER_OPS + (PACKED_DECODE_OPS if decode_rows else 0) + PACKED_CHUNK_OPS * chunks)
    return Step(weight_bytes(config), keys * kv_bytes_per_token(config),
                tokens * config.d_model * 4 * 2 * config.n_layer, flops, ops, syncs, tokens=rows, rows=tokens,
                kernels="library", attention_flops=attention, head_bytes=config.vocab_size * config.embed_size * 4.0,
                head_rows=rows)


def shard_config(config: ModelConfig, ranks: int) -> ModelConfig:
    """What one of `ranks` ranks holds (lesson 20, `minillm.parallel.shard`): its query heads, its key/value heads
    (or the one it repeats), its MLP units and its rows of the vocabulary."""
    return replace(config, n_head=config.n_head // ranks, n_kv_head=max(1, config.kv_heads // ranks),
                   head_dim=config.head_size, d_ff=config.ff_size // ranks,
                   vocab_size=math.ceil(config.vocab_size / ranks))


def sharded_decode_step(config: ModelConfig, ranks: int, memory_buses: int = 1, batch: int = 1,
                        context: int = 256) -> Step:
    """One rank's share of an eager float32 decode step split over `ranks` processes (Megatron's split).

    Each rank reads 1/ranks of the weights and of the cache, and then waits in 2 all-reduces per block (after
    attention, after the MLP) of the step's [batch, d_model] activations, one more for the embedding, an
    all-gather of the logits and rank 0's message announcing the step: 2 * n_layer + 3 collectives, each priced
    as an all-reduce of the activations (the gather's logits are larger: a floor for those two). Ranks that
    share `memory_buses` < ranks memory buses share their bandwidth too: each reads its 1/ranks of the bytes at
    buses/ranks of the machine's bandwidth, so the bytes take as long as one process's (`work_seconds` scaled);
    only ranks on buses of their own read in parallel."""
    step = decode_step(shard_config(config, ranks), batch=batch, context=context)
    scale = ranks / min(ranks, memory_buses)  # each rank's share of the bandwidth: min(ranks, buses) / ranks
    return replace(step, weight_bytes=step.weight_bytes * scale, head_bytes=step.head_bytes * scale,
                   kv_bytes=step.kv_bytes * scale, ranks=ranks, collectives=2 * config.n_layer + 3,
                   collective_bytes=batch * config.d_model * 4.0)


def with_bytes(step: Step, weight_bytes: float) -> Step:
    """The same step reading `weight_bytes` of weights (a measured `num_weight_bytes`, a quantized size)."""
    return replace(step, weight_bytes=weight_bytes)
