"""One rank's shard of a model: Megatron's split of each block, the vocabulary split for the embedding and LM head.

A block's two matmul pairs split so that each rank computes without talking until the
pair's end (Shoeybi et al., 2019, "Megatron-LM"):

    attention  QKV column-parallel: rank r holds the rows of its query heads and of the
               key/value heads they read, so it attends over its own heads alone;
               the output projection row-parallel: its columns for those heads. Each
               rank's product is a partial sum of the output: one all-reduce adds them.
    MLP        gate/up column-parallel (rank r holds hidden units r·f/w ... (r+1)·f/w of
               both), down row-parallel over the same units: one all-reduce.
    experts    a mixture of experts splits each expert the same way (rank r holds its share of
               every expert's hidden units, and of the shared experts'), the router replicated:
               every rank routes each token alike, and one all-reduce after the layer adds the
               partial outputs (vLLM's tensor-parallel MoE; expert parallelism, whole experts on
               ranks, is the other way).

So a block costs two all-reduces of [tokens, d_model] and nothing else crosses ranks.
The embedding is split by vocabulary (each rank looks up the tokens in its rows, zeros
for the rest, and an all-reduce adds the one non-zero row); the LM head too (each rank
scores its rows; an all-gather joins the logits, so every rank holds all of them and
picks the same next token). Norms, RoPE and biases after a sum are replicated.

Latent attention (DeepSeek-V3) splits by heads too: the query's and the latent's up-projections
column-parallel (each rank's heads' rows), the output projection row-parallel; the latent itself
and its down-projection are every head's, so every rank computes and caches it whole.

Grouped-query attention: with as many key/value heads as ranks or more, they split like
the query heads; with fewer (Gemma 3 270M: one over two ranks) each rank keeps a copy of
the key/value head its query heads read, and caches it: the cache then repeats on every
rank (said by `Split.replicated_kv`). Anything else (the default model's three key/value
heads over two ranks) is refused by `check_split` in one line.

The sums run in another order than one process's matmul (partial sums per rank, then
added), so logits agree with one process's to about 1e-6 relative in float32 (the tests
hold them within 1e-4), not bit for bit; every rank ends a step holding the same logits
(an all-reduce gives each rank the same bytes). Rank 0 alone chooses the tokens; the
others follow its runner call by call (`minillm.parallel.follow`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Split:
    """What rank `rank` of `world` holds of a model with `config`: index ranges into the whole model's heads,
    hidden units and vocabulary."""

    rank: int
    world: int
    n_head: int
    kv_heads: int
    hidden: int
    vocab: int

    @property
    def heads_per_rank(self) -> int:
        return self.n_head // self.world

    @property
    def replicated_kv(self) -> bool:
        """Fewer key/value heads than ranks: each rank keeps a copy of the one its query heads read."""
        return self.kv_heads < self.world

    def query_heads(self) -> range:
        return range(self.rank * self.heads_per_rank, (self.rank + 1) * self.heads_per_rank)

    def key_value_heads(self) -> range:
        if self.replicated_kv:
            first = self.query_heads()[0] // (self.n_head // self.kv_heads)  # the head its query heads share
            return range(first, first + 1)
        per = self.kv_heads // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def hidden_units(self) -> range:
        return self.share(self.hidden)

    def share(self, units: int) -> range:
        """This rank's share of `units` hidden units (a dense MLP's, or each expert's)."""
        per = units // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding each rank holds: the vocabulary divided, rounded up (the last rank's padded)."""
        return math.ceil(self.vocab / self.world)

    def vocab_rows(self) -> range:
        start = self.rank * self.vocab_per_rank
        return range(start, min(self.vocab, start + self.vocab_per_rank))


def check_split(config, world: int) -> None:
    """Refuse, in one line naming the sizes, a split the model's shapes do not allow."""
    if world < 1:
        raise ValueError(f"--tp {world}: give 1 or more processes")
    kv = config.kv_heads
    if config.n_head % world:
        raise ValueError(f"--tp {world} does not divide the model's {config.n_head} attention heads: use a divisor of "
                         f"{config.n_head} ({', '.join(str(d) for d in divisors(config.n_head))})")
    if kv % world and world % kv and not config.kv_lora_rank:  # latent attention caches one latent for all heads
        raise ValueError(f"--tp {world}: the model's {kv} key/value heads neither split evenly over {world} ranks nor "
                         f"repeat evenly on them: use a divisor or a multiple of {kv} that divides {config.n_head}")
    for what, units in (("each expert's", config.moe_ff or config.ff_size if config.num_experts else 0),
                        ("the shared experts'", config.shared_ff)):
        if units % world:
            raise ValueError(f"--tp {world} does not divide {what} {units} hidden units: use a divisor of {units}")
    if config.ff_size % world:
        fitting = [str(d) for d in divisors(config.n_head) if config.ff_size % d == 0]
        raise ValueError(f"--tp {world} does not divide the MLP's {config.ff_size} hidden units: use a divisor of both "
                         f"{config.n_head} and {config.ff_size} ({', '.join(fitting)})")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_for(config, rank: int, world: int) -> Split:
    check_split(config, world)
    return Split(rank, world, config.n_head, config.kv_heads, config.ff_size, config.vocab_size)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: rank r multiplies its slice of the input features by its columns of the
    weight; the all-reduce adds the partial sums. `linear` is a plain bias-free `nn.Linear` (so the fast paths that
    swap linears swap it too); the bias, replicated, is added once after the sum."""

    def __init__(self, linear: nn.Linear, bias: torch.Tensor | None):
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding's rows `rows` (padded to `per_rank`): tokens outside them look up zeros, and an all-reduce adds
    the one rank's row each token has."""

    def __init__(self, weight: torch.Tensor, rows: range):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [per_rank, d]
        self.start, self.stop = rows.start, rows.stop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.start) & (tokens < self.stop)
        x = F.embedding(torch.where(mine, tokens - self.start, 0), self.weight)
        x = x * mine[..., None].to(x.dtype)  # a zero row where another rank holds the token
        dist.all_reduce(x)
        return x


class GatheredLMHead(nn.Module):
    """Logits for the vocabulary rows this rank holds, all-gathered so that every rank has them all [..., vocab]."""

    def __init__(self, linear: nn.Linear, vocab: int, world: int):
        super().__init__()
        self.linear, self.vocab, self.world = linear, vocab, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.linear(x).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def rows_of(weight: torch.Tensor, ranges: list[range], size: int) -> torch.Tensor:
    """The rows of `weight` (in blocks of `size`: a head's hd rows, or one row) in `ranges`, in order, as a copy."""
    return torch.cat([weight[r.start * size: r.stop * size] for r in ranges]).clone()


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                       dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.requires_grad_(False)


def shard_attention(attn, split: Split, head_dim: int) -> None:
    H, KV = split.n_head, split.kv_heads
    q, kv = split.query_heads(), split.key_value_heads()
    k_rows, v_rows = range(H + kv.start, H + kv.stop), range(H + KV + kv.start, H + KV + kv.stop)
    blocks = [q, k_rows, v_rows]  # in heads of the fused QKV's rows: all queries, then keys, then values
    qkv = attn.qkv
    attn.qkv = plain_linear(rows_of(qkv.weight, blocks, head_dim),
                            None if qkv.bias is None else rows_of(qkv.bias, blocks, head_dim))
    proj = attn.proj
    columns = proj.weight[:, q.start * head_dim: q.stop * head_dim].clone()
    attn.proj = RowParallelLinear(plain_linear(columns, None), None if proj.bias is None else proj.bias.clone())
    attn.n_head, attn.n_kv_head = len(q), len(kv)
    if attn.sinks is not None:  # gpt-oss: each head's sink goes with the head
        attn.sinks = nn.Parameter(attn.sinks[q.start:q.stop].clone(), requires_grad=False)


def shard_latent_attention(attn, split: Split) -> None:
    """Latent attention's heads split (see the module docstring): q_up's and kv_up's rows of this rank's heads,
    proj's columns for them; the latent's down-projection and norm stay whole."""
    heads = split.query_heads()
    attn.q_up = plain_linear(rows_of(attn.q_up.weight, [heads], attn.nope_dim + attn.rope_dim), None)
    attn.kv_up = plain_linear(rows_of(attn.kv_up.weight, [heads], attn.nope_dim + attn.v_dim), None)
    proj = attn.proj
    columns = proj.weight[:, heads.start * attn.v_dim: heads.stop * attn.v_dim].clone()
    attn.proj = RowParallelLinear(plain_linear(columns, None), None if proj.bias is None else proj.bias.clone())
    attn.n_head = len(heads)


def gated_blocks(units: range, hidden: int) -> list[range]:
    """The rows of `units` in a gate/up matrix stacked [gate; up] over `hidden` units: theirs in both halves."""
    return [units, range(hidden + units.start, hidden + units.stop)]


def column_row_pair(fc: nn.Linear, proj: nn.Linear, units: range, hidden: int, gated: bool):
    """Megatron's pair over this rank's `units` of `hidden`: fc's rows for them (gate's and up's when gated) and
    proj's columns, bias-free (a bias after the sum is the caller's)."""
    blocks = gated_blocks(units, hidden) if gated else [units]
    return (plain_linear(rows_of(fc.weight, blocks, 1), None if fc.bias is None else rows_of(fc.bias, blocks, 1)),
            plain_linear(proj.weight[:, units.start: units.stop].clone(), None))


def shard_mlp(mlp, split: Split) -> None:
    bias = mlp.proj.bias
    mlp.fc, columns = column_row_pair(mlp.fc, mlp.proj, split.hidden_units(), split.hidden, mlp.gated)
    mlp.proj = RowParallelLinear(columns, None if bias is None else bias.clone())


class ReducedExperts(nn.Module):
    """A mixture of experts over this rank's share of each expert's hidden units: its output is a partial sum, which
    one all-reduce completes (the row-parallel half of every expert at once)."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.moe(x)
        dist.all_reduce(y)
        return y


def shard_experts(moe, split: Split):
    """Keep this rank's share of every expert's hidden units (and of the shared experts'): gate/up rows and down
    columns, as `shard_mlp` keeps a dense MLP's; the down biases on rank 0 alone, since the all-reduce adds every
    rank's output. Returns the layer behind the all-reduce."""
    ff = moe.gate_up.shape[1] // 2
    mine = split.share(ff)
    rows = torch.cat([torch.arange(r.start, r.stop) for r in gated_blocks(mine, ff)])
    moe.gate_up = nn.Parameter(moe.gate_up[:, rows].clone(), requires_grad=False)  # gates, then ups
    moe.down = nn.Parameter(moe.down[:, :, mine.start:mine.stop].clone(), requires_grad=False)
    if moe.gate_up_bias is not None:
        moe.gate_up_bias = nn.Parameter(moe.gate_up_bias[:, rows].clone(), requires_grad=False)
        moe.down_bias = nn.Parameter(moe.down_bias.clone() if split.rank == 0 else torch.zeros_like(moe.down_bias),
                                     requires_grad=False)
    if moe.shared_fc is not None:
        shared_ff = moe.shared_proj.in_features
        moe.shared_fc, moe.shared_proj = column_row_pair(moe.shared_fc, moe.shared_proj, split.share(shared_ff),
                                                         shared_ff, gated=True)
    return ReducedExperts(moe)


def shard_vocab(model, split: Split) -> None:
    rows = split.vocab_rows()
    weight = model.tok_emb.weight
    table = weight.new_zeros(split.vocab_per_rank, weight.shape[1])
    table[: len(rows)] = weight[rows.start: rows.stop]
    tied = model.config.tie_embeddings
    head = model.lm_head
    model.tok_emb = VocabParallelEmbedding(table, rows)
    if tied:
        linear = nn.Linear(table.shape[1], table.shape[0], bias=False, device=table.device, dtype=table.dtype)
        linear.weight = model.tok_emb.weight  # still one matrix, as in the whole model
    else:
        head_rows = head.weight.new_zeros(split.vocab_per_rank, head.weight.shape[1])
        head_rows[: len(rows)] = head.weight[rows.start: rows.stop]
        bias = None
        if head.bias is not None:
            bias = head.bias.new_zeros(split.vocab_per_rank)
            bias[: len(rows)] = head.bias[rows.start: rows.stop]
        linear = plain_linear(head_rows, bias)
    model.lm_head = GatheredLMHead(linear.requires_grad_(False), split.vocab, split.world)


@torch.no_grad()
def shard_model(model, rank: int, world: int):
    """Turn `model` (a plain `Transformer`, float weights, no fast paths swapped in yet) into rank `rank`'s shard of
    `world`, in place, and return it: its config then says the heads and hidden units this rank holds (so a KV cache
    built from it holds only this rank's key/value heads); the vocabulary stays the whole model's."""
    config = model.config
    split = split_for(config, rank, world)
    if world == 1:
        return model
    for i, block in enumerate(model.blocks):
        if config.kv_lora_rank:
            shard_latent_attention(block.attn, split)
        else:
            shard_attention(block.attn, split, config.head_size)
        if config.is_moe(i):
            block.mlp = shard_experts(block.mlp, split)
        else:
            shard_mlp(block.mlp, split)
    shard_vocab(model, split)
    model.config = replace(config, n_head=len(split.query_heads()), n_kv_head=len(split.key_value_heads()),
                           head_dim=config.head_size, d_ff=len(split.hidden_units()),
                           moe_ff=config.moe_ff and config.moe_ff // world, shared_ff=config.shared_ff // world)
    model.split = split
    return model


__all__ = ["GatheredLMHead", "ReducedExperts", "RowParallelLinear", "Split", "VocabParallelEmbedding", "check_split",
           "shard_experts", "shard_model", "split_for"]
