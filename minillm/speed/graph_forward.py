"""The forward as a graph can hold it: fixed RoPE tables, plain linears, the cache written at tensor columns (lesson 15).

A traced graph cannot branch on a value it computes, and cannot grow a tensor whose
length changes every step. These pieces rewrite the model's forward into a pure
function of fixed-shape tensors, `graph_forward`, which both the compiled step
(`minillm.speed.compile`) and the ONNX export (`minillm.speed.export`) trace.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..model.rope import RopeTable
from .onednn import use_plain_linear


class FixedRope:
    """RoPE's cos/sin lookup over a table of fixed size, built once.

    `RopeTable` grows on demand, which needs the largest position as a Python number
    (`int(positions.max())`): a graph cannot branch on a value it computes, so the
    traced forward uses this lookup, whose table already covers the model's context.
    Every entry equals `RopeTable`'s (the same `build`).
    """

    def __init__(self, table: RopeTable, size: int, dtype: torch.dtype, device):
        self.size = size
        self.cos, self.sin = table.build(size, dtype, device, long=False)  # [size, head_dim] each

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, T, 1, head_dim], like RopeTable."""
        return self.cos[positions][:, :, None], self.sin[positions][:, :, None]


def graph_problem(config, cache: str | None = None) -> str | None:
    """Why no fixed graph can hold this model's forward (None: one can): it branches on values it computes, or
    (over the engine's paged cache, `cache="paged"`) on how many keys a step reads."""
    if config.rope_long_factor is not None:
        return ("long-RoPE models (Phi-3 with rope_long_factor) pick their RoPE table by the largest position, which "
                "a fixed graph cannot do")
    if config.num_experts:
        return "a mixture of experts runs the experts its tokens pick, a loop over data that a fixed graph cannot hold"
    if config.kv_lora_rank:
        return ("latent attention caches one latent per token, not the keys and values per head the graphs are laid "
                "out for")
    if cache == "paged" and config.sliding_window is not None:
        return ("a sliding window's mask depends on how many keys each step reads, which the engine's one paged "
                "graph leaves open")
    return None


def refuse_ungraphable(config) -> None:
    if problem := graph_problem(config):
        raise ValueError(f"{problem}: run this model without compile/export")


def graph_ready_copy(model):
    """A copy of `model` that traces as one graph: plain nn.Linear, fixed RoPE tables.

    The oneDNN swap (`minillm.speed.onednn`) keeps a packed weight behind a Python-side
    check that a tracer cannot follow; a compiler packs weights for its own kernels.
    Models whose forward branches on values inside the graph (long-RoPE's table switch,
    a mixture of experts' routing) are refused (`graph_problem`).
    """
    config = model.config
    refuse_ungraphable(config)
    graph_model = use_plain_linear(copy.deepcopy(model))
    if graph_model.rope is not None:
        graph_model.rope = FixedRope(graph_model.rope, config.context_length, model.dtype, model.device)
    if graph_model.rope_local is not None:
        graph_model.rope_local = FixedRope(graph_model.rope_local, config.context_length, model.dtype, model.device)
    return graph_model


class ColumnWrites:
    """The KV cache a traced forward sees: per-layer storage [B, KV, S, hd], new columns written at `columns`.

    columns: long [B, T], where each row's T new keys go. `in_place=True` writes into
    the storage (a compiled step over a StaticCache); False builds new tensors (an
    exported graph returns its updated keys and values as outputs).
    """

    def __init__(self, keys, values, columns: torch.Tensor, in_place: bool):
        self.keys, self.values = list(keys), list(values)
        self.columns, self.in_place = columns, in_place

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        if self.in_place:
            # An indexed assignment (index_put_), which Inductor writes in place: the columns and nothing
            # else. A scatter_ on a graph input is compiled as copy out, scatter, copy back, every column.
            rows = torch.arange(k_new.shape[0], device=k_new.device)[:, None]  # [B, 1]
            for store, new in ((self.keys, k_new), (self.values, v_new)):
                store[layer][rows, :, self.columns] = new.transpose(1, 2)  # indexed as [B, T, KV, hd]
        else:
            index = self.columns[:, None, :, None].expand_as(k_new)  # [B, KV, T, hd]
            for store, new in ((self.keys, k_new), (self.values, v_new)):
                store[layer] = store[layer].scatter(2, index, new)
        return self.keys[layer], self.values[layer]


def graph_forward(model, tokens, positions, columns, mask, logits_at, keys, values, in_place: bool):
    """One forward over a fixed-shape cache: logits [B, K, V] and the keys and values after the write.

    tokens, positions, columns: long [B, T]; mask: bool [B, T, S]; logits_at: long [B, K]
    (positions within the T tokens) or None for all; keys, values: per-layer [B, KV, S, hd].
    """
    cache = ColumnWrites(keys, values, columns, in_place)
    logits = model(tokens, positions, cache=cache, mask=mask, logits_at=logits_at)
    return logits, cache.keys, cache.values


class PoolWrites:
    """The paged cache a traced decode step sees: per-layer block pools [num_blocks, block_size, KV, hd]
    (`PagedKVCache.block_pools`).

    slots: long [B], where each row's new key goes (block * block_size + offset); tables: long
    [B, nb], each row's block table (padded with any block: the mask hides what lies past the
    row's position). `update` writes the new keys in place, then reads each row's keys back
    through its table, in order: [B, KV, nb * block_size, hd], what a static cache returns, so
    the model's own attention runs over them with a mask. In the compiled graph that read is not
    a copy: Inductor folds the table lookup into the attention's loops, which read the blocks
    where they lie.

    Why whole blocks, indexed by the table, rather than slots (`table * block_size + offset`,
    one index per key): with slot indices every key's address is its own lookup, and Inductor
    vectorized the attention's product with the values across the keys, reading each value
    column by column; with block indices a block's keys are contiguous and the product
    vectorizes across the head dimension, as over a static cache. Measured on the default
    model's package alone (2-core Xeon, alternated): 16 rows of 512 keys 139-151 -> 124 ms a
    step, 8 rows of 256 keys 57 -> 53 ms, 4 rows of 128 keys 36-37 -> 34-35 ms.
    """

    def __init__(self, keys, values, slots: torch.Tensor, tables: torch.Tensor, block_size: int):
        self.keys, self.values, self.tables = keys, values, tables
        self.blocks, self.offsets = slots // block_size, slots % block_size  # each [B]: where the new keys go

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """k_new, v_new [B, KV, 1, hd] -> written; returns the rows' keys and values [B, KV, L, hd]."""
        read = []
        for pool, new in ((self.keys[layer], k_new), (self.values[layer], v_new)):
            pool[self.blocks, self.offsets] = new[:, :, 0]  # index_put_ on the graph's input: in place, one row each
            read.append(pool[self.tables].flatten(1, 2).transpose(1, 2))  # [B, nb, bs, KV, hd] -> [B, KV, L, hd]
        return tuple(read)


class PagedDecodeStep(nn.Module):
    """The engine's compiled unit (lesson 12's pool): every running sequence feeds one token over the paged cache.

    Its sizes are the step's: rows, blocks per row and pool slots all change from step to
    step, so it is exported with all three symbolic (`PagedShape`) and one graph serves
    every step in which each sequence decodes.
    """

    def __init__(self, graph_model, block_size: int):
        super().__init__()
        self.model, self.block_size = graph_model, block_size

    def forward(self, tokens, positions, slots, tables, keys, values):
        """tokens, positions long [B, 1]; slots long [B]; tables long [B, nb]; keys, values: each layer's block pool
        [num_blocks, block_size, KV, hd], written in place. Returns logits [B, 1, V]."""
        cache = PoolWrites(keys, values, slots, tables, self.block_size)
        seen = tables.shape[1] * self.block_size
        mask = torch.arange(seen, device=tokens.device) <= positions[:, :, None]  # [B, 1, L]: keys up to its own
        return self.model(tokens, positions, cache=cache, mask=mask)


class CacheStep(nn.Module):
    """The compiled unit: one forward that writes its keys and values into the cache storage in place.

    A module, so that the compiler sees the weights as the module's parameters and
    can freeze them into constants (and prepack them for its matmuls).
    """

    def __init__(self, graph_model):
        super().__init__()
        self.model = graph_model

    def forward(self, tokens, positions, columns, mask, logits_at, keys, values):
        """keys, values: each layer's cache storage [B, KV, S, hd], written in place; returns logits [B, K, V]."""
        return graph_forward(self.model, tokens, positions, columns, mask, logits_at, keys, values, True)[0]


__all__ = ["CacheStep", "ColumnWrites", "FixedRope", "PagedDecodeStep", "PoolWrites", "graph_forward",
           "graph_problem", "graph_ready_copy", "refuse_ungraphable"]
