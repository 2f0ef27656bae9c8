"""The shapes of the compiled steps (lesson 15): what one kept package (`minillm.speed.graph_store`) is built for.

`StepShape` fixes every size of a step over a contiguous static cache (rows, tokens fed,
cache length, logits kept); `PagedShape` is the engine's decode step over the paged pool,
whose sizes stay symbolic. Each gives the example inputs the export traces and the module
it exports; `context_bucket` rounds a run's length to the cache lengths graphs are built for;
`spare_rows_fed` fills a step's inputs out to the rows its shape fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .graph_forward import PagedDecodeStep


@dataclass(frozen=True)
class StepShape:
    """The shapes of one compiled step: every size fixed, or all but the cache's length.

    batch: rows; tokens: T fed per row (1 to decode, the chunk length to prefill or verify);
    cache_len: S, the cache columns every step sees, or None: any S, read at each call (one
    package for every cache length: `any_length`); logits: K positions per row that get
    logits (1: the prompt's last; T: every fed token, as decode and verify need).
    """

    batch: int
    tokens: int
    cache_len: int | None
    logits: int

    def any_length(self) -> "StepShape":
        """The same step over a cache of any length: S symbolic in the exported program."""
        return replace(self, cache_len=None)

    @property
    def rows(self) -> int:
        """The rows each of the step's weight matmuls multiplies: every token of every row."""
        return self.batch * self.tokens

    @property
    def name(self) -> str:
        kind = "decode" if self.tokens == 1 else "prefill" if self.logits == 1 else "verify"
        return f"{kind}-b{self.batch}-t{self.tokens}-s{self.cache_len or 'any'}"

    @classmethod
    def of_step(cls, tokens, positions, columns, mask, logits_at, keys, values) -> "StepShape":
        """The shape of a call with `CacheStep.forward`'s arguments (mask: [B, T, S]; logits_at: [B, K] or None)."""
        B, T, S = mask.shape
        return cls(B, T, S, T if logits_at is None else logits_at.shape[1])

    @classmethod
    def decode(cls, config, batch: int, max_len: int | None) -> "StepShape":
        """The decode step for `batch` rows of up to `max_len` tokens (None: the whole context)."""
        context = config.context_length
        return cls(batch, 1, context_bucket(max_len or context, context), 1)

    @classmethod
    def verify(cls, config, batch: int, tokens: int, max_len: int | None) -> "StepShape":
        """The verify step: `tokens` fed per row (the newest token and a draft), logits after every one."""
        return cls(batch, tokens, StepShape.decode(config, batch, max_len).cache_len, tokens)

    def example_inputs(self, config, dtype: torch.dtype, device) -> tuple:
        """Inputs of `CacheStep.forward` with these shapes (their values only need to be valid)."""
        B, T, S = self.batch, self.tokens, self.cache_len or min(ANY_LENGTH_HINT, config.context_length)
        tokens = torch.zeros(B, T, dtype=torch.long, device=device)
        columns = torch.arange(T, device=device).expand(B, T).contiguous()  # [B, T]
        mask = torch.arange(S, device=device) <= columns[:, :, None]  # [B, T, S]
        logits_at = None if self.logits == T else torch.full((B, self.logits), T - 1, device=device)
        shape = (B, config.kv_heads, S, config.head_size)  # one layer's keys (or values)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        return tokens, columns.clone(), columns, mask, logits_at, keys, values

    def dynamic_shapes(self, config):
        """What `torch.export` keeps symbolic (one entry per input): nothing, or with `cache_len` None the cache's
        length in the mask [B, T, S] and in every layer's keys and values [B, KV, S, hd]."""
        if self.cache_len is not None:
            return None
        from torch.export import Dim

        length = Dim("cache_len", min=self.tokens + 1, max=config.context_length)
        layers = [{2: length}] * config.n_layer
        return None, None, None, {2: length}, None, layers, layers

    def module(self, cache_step):
        """The unit exported for this shape: the `CacheStep` itself."""
        return cache_step


@dataclass(frozen=True)
class PagedShape:
    """The engine's decode step over the paged pool (lesson 12): one package for every step in which each
    sequence feeds one token.

    A server's steps differ in the rows decoding, the blocks each row's keys span and the
    pool's size. Buckets of fixed shapes would need a graph per (rows, blocks) pair, tens of
    builds of 40 s to three minutes each on two cores; instead the three sizes stay symbolic in the exported program
    (`torch.export`'s `Dim`), and the generated C++ loops run over sizes read at each call.
    Only the block size is fixed: it is baked into the slot arithmetic.
    """

    block_size: int

    @property
    def rows(self) -> None:
        """The rows its weight matmuls multiply: any number, decided at each call (symbolic)."""
        return None

    @property
    def name(self) -> str:
        return f"paged-decode-bs{self.block_size}"

    def example_inputs(self, config, dtype: torch.dtype, device) -> tuple:
        """Inputs of `PagedDecodeStep.forward`: 8 rows, each over 17 blocks, of a pool of 139 blocks.

        The sizes stay symbolic, but Inductor reads these as hints of what a step holds when it
        decides which loops to split across threads and which to vectorize: built from 2 rows
        over 3 blocks, the attention's softmax ran on one thread (the engine's step at 8 rows
        and ~250 keys: 88 ms, against 82 from these). Distinct sizes, none 0 or 1, so the
        export takes none of them for a constant or for another."""
        rows, blocks = 8, 17
        pool = rows * blocks + 3
        tables = torch.arange(rows * blocks, device=device).view(rows, blocks)  # each row its own blocks
        positions = torch.full((rows, 1), blocks * self.block_size - 1, device=device)  # the last slot of each table
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        slots = tables[:, -1] * self.block_size + positions[:, 0] % self.block_size
        shape = (pool, self.block_size, config.kv_heads, config.head_size)  # one layer's block pool
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        return tokens, positions, slots, tables, keys, values

    def dynamic_shapes(self, config):
        """Rows, blocks per row and the pool's blocks symbolic, as `torch.export` takes them (one entry per input)."""
        from torch.export import Dim

        rows, blocks = Dim("rows", min=1, max=4096), Dim("blocks", min=1, max=config.context_length)
        pool = Dim("pool_blocks", min=1, max=2**31 - 1)
        pools = [{0: pool}] * config.n_layer
        return ({0: rows}, {0: rows}, {0: rows}, {0: rows, 1: blocks}, pools, pools)

    def module(self, cache_step):
        """The unit exported: the same graph-ready model as the `CacheStep`'s, behind `PagedDecodeStep`."""
        return PagedDecodeStep(cache_step.model, self.block_size).eval()


# The cache length an any-length step is traced with: Inductor reads it as a hint of the sizes it will meet when it
# decides which loops to split across threads (`PagedShape.example_inputs`).
ANY_LENGTH_HINT = 512
SMALLEST_BUCKET = 256  # cache lengths: powers of two from here, so short and medium runs share one graph


def any_length_cache(tokens: int, context_length: int) -> int:
    """The cache length a run of `tokens` tokens allocates for a step built for any length: the next multiple of
    64 (the prefill chunk, so a padded chunk still fits), capped at the model's context. Every step attends over
    all of it, masked: the closer to the run's own length, the fewer columns each step reads."""
    return min(context_length, -(-max(tokens, 1) // 64) * 64)


def context_bucket(tokens: int, context_length: int) -> int:
    """The fixed cache length for a run of `tokens` tokens: the next power of two (at least SMALLEST_BUCKET),
    capped at the model's context. A power of two from 256 up is a multiple of the usual chunk lengths, so
    a prompt's padded last chunk still fits."""
    return min(context_length, max(SMALLEST_BUCKET, 1 << (tokens - 1).bit_length()))


def causal_columns(columns: torch.Tensor, length: int) -> torch.Tensor:
    """bool [B, T, S]: each new token (at `columns` [B, T]) sees the cache columns up to its own."""
    return torch.arange(length, device=columns.device) <= columns[:, :, None]


def spare_rows_fed(rows: int, tokens, positions, columns, mask):
    """The step's inputs for every row the cache holds: rows past the B in use (finished sequences' rows)
    are fed token 0 at column 0, where they see only that column.

    A graph's batch is fixed: running the cache's every row keeps one graph for the whole run
    while sequences finish and leave. The spare rows' writes land in rows nobody reads.
    tokens, positions, columns [B, T], mask [B, T, S] -> each with `rows` rows.
    """
    B, T = tokens.shape
    if rows == B:
        return tokens, positions, columns, mask
    spare = rows - B
    zeros = tokens.new_zeros(spare, T)
    first_column = torch.zeros(spare, T, mask.shape[-1], dtype=torch.bool, device=mask.device)
    first_column[:, :, 0] = True
    return (torch.cat((tokens, zeros)), torch.cat((positions, zeros)), torch.cat((columns, zeros)),
            torch.cat((mask, first_column)))


__all__ = ["ANY_LENGTH_HINT", "PagedShape", "SMALLEST_BUCKET", "StepShape", "any_length_cache", "causal_columns",
           "context_bucket", "spare_rows_fed"]
