"""The decode session: a batch of rows over a contiguous KV cache, with their positions and masks.

A session holds a batch of rows (token sequences) and whatever makes the next forward
cheap: the KV cache, each row's length, the positions and masks. The model runner
(`minillm.runtime.runner`) drives it for every strategy, in five verbs, and nobody
touches a tensor of the cache themselves:

    logits = session.prefill(rows)                # [B, V]: next-token logits after each prompt
    logits = session.extend(tokens, tree=None)    # [B, T, V]: logits after each of T new tokens per row
    session.select(index)                         # keep / duplicate / drop rows (finished rows, beams)
    session.rollback(lengths)                     # forget each row's tokens past lengths[b] (rejected drafts)
    session.keep_positions(row, index)            # keep an accepted path of a token tree

How rows of different lengths share one forward. Row b's token at position p sits at
column p of the cache, so rows are aligned on the left and padded on the right:

    row 0:  a b c d e .      lengths [5, 3]; the next token of row 0 goes to column 5,
    row 1:  f g h . . .      of row 1 to column 3

Prefill pads the shorter prompts on the right; a causal mask already keeps every real
token from seeing the padding after it, and the padding's cache columns are overwritten
by the row's next tokens. Later forwards pass a mask built from the lengths (query t of
row b sees columns < lengths[b] and the new columns up to its own), so rows may grow,
shrink and roll back independently. When every row has the same length the mask is
None and attention takes its plain causal path.

With cache="none" nothing is kept between forwards: `extend` recomputes each row's
whole sequence (the baseline that lesson 06's cache is measured against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.kinds import make_cache
from ..cache.kv_cache import KVCache, StaticCache


@dataclass
class Tree:
    """T tokens verified in one forward as a tree: node i sees its ancestors and itself.

    mask: bool [T, T] (or [B, T, T] per row), mask[i, j] = node j is node i or one of its
    ancestors; depth: long [T] (or [B, T]), each node's distance from the root (node 0,
    depth 0). Node i's position is the row's length + depth[i].
    """

    mask: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def from_parents(cls, parents: list[int]) -> "Tree":
        """parents[i] = index of node i's parent (-1 for the root); parents come before children."""
        T = len(parents)
        mask = torch.eye(T, dtype=torch.bool)
        depth = torch.zeros(T, dtype=torch.long)
        for i, parent in enumerate(parents):
            if parent >= 0:
                if parent >= i:
                    raise ValueError(f"tree node {i} has parent {parent}: parents must come before their children")
                mask[i] |= mask[parent]
                depth[i] = depth[parent] + 1
        return cls(mask, depth)


class DecodeSession:
    """A batch of rows decoding together; see the module docstring for the verbs."""

    def __init__(self, model, cache: str = "static", max_len: int | None = None, max_batch: int = 1,
                 fixed_shape: bool = False):
        """max_len: the most tokens a row will hold (capped at the model's context); max_batch:
        the most rows `select` will make (a static cache is allocated for them up front);
        fixed_shape: every forward sees all max_len cache columns, masked (compiled graphs need it)."""
        self.model, self.cache_kind, self.max_batch, self.fixed_shape = model, cache, max_batch, fixed_shape
        self.max_len = min(max_len or model.config.context_length, model.config.context_length)
        make_cache(cache, model, 0, 0, fixed_shape)  # refuses an unknown kind now, not at the first forward
        self.cache: KVCache | None = None
        self.rows: list[list[int]] = []  # every token each row holds (in the cache, when there is one)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def device(self):
        return self.model.device

    # ------------------------------------------------------------------ verbs

    def prefill(self, rows: list[list[int]]) -> torch.Tensor:
        """Start over with these prompts (non-empty token lists); next-token logits [B, V]."""
        self.rows = [list(r) for r in rows]
        if any(not r for r in self.rows):
            raise ValueError("prefill: every row needs at least one token")
        self._reset_cache()
        if self.cache is None:
            return self._recompute(1)[:, -1]
        lengths = self.lengths
        tokens = right_padded(self.rows, self.device)  # [B, L]
        positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        equal = len(set(lengths)) == 1
        logits_at = None if equal else torch.tensor(lengths, device=self.device) - 1
        mask = self._mask([0] * len(lengths), tokens.shape[1], None)  # causal; explicit only for a fixed shape
        logits = self.model(tokens, positions, cache=self.cache, mask=mask, last_only=equal, logits_at=logits_at)
        if not equal:
            self.cache.crop(lengths)  # the padding's columns are free again
        return logits[:, -1]

    def extend(self, tokens, tree: Tree | None = None) -> torch.Tensor:
        """Append T tokens to every row and return the logits after each one: [B, T, V].

        tokens: long [B, T] (or lists). Without a tree the T tokens follow each other
        (decode: T = 1; speculative verification: T = k + 1); with a tree they are its
        nodes, node 0 first.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if tokens.dim() != 2 or tokens.shape[0] != self.batch_size:
            raise ValueError(f"extend: tokens must be [batch={self.batch_size}, T], got {list(tokens.shape)}")
        T = tokens.shape[1]
        starts = self.lengths
        if self.cache is None:
            for row, new in zip(self.rows, tokens.tolist()):
                row.extend(new)
            return self._recompute(T, tree)
        depth = torch.arange(T, device=self.device) if tree is None else tree.depth.to(self.device)
        positions = torch.tensor(starts, device=self.device)[:, None] + depth  # [B, T]
        mask = self._mask(starts, T, tree)
        logits = self.model(tokens, positions, cache=self.cache, mask=mask)  # [B, T, V]
        for row, new in zip(self.rows, tokens.tolist()):
            row.extend(new)
        return logits

    def select(self, index) -> None:
        """Keep the rows `index` names, in that order (a row may appear twice)."""
        index = torch.as_tensor(index, dtype=torch.long)
        self.rows = [list(self.rows[i]) for i in index.tolist()]
        if self.cache is not None:
            self.cache.reorder(index)

    def rollback(self, lengths) -> None:
        """Cut row b back to its first lengths[b] tokens (an int cuts every row)."""
        keep = [lengths] * self.batch_size if isinstance(lengths, int) else list(lengths)
        if len(keep) != self.batch_size or not all(0 <= k <= len(r) for k, r in zip(keep, self.rows)):
            raise ValueError(f"rollback({lengths}): rows hold {self.lengths} tokens; give one length per row, "
                             f"each between 0 and the row's length")
        self.rows = [r[:k] for r, k in zip(self.rows, keep)]
        if self.cache is not None:
            self.cache.crop(keep)

    def keep_positions(self, row: int, index) -> None:
        """Keep only the tokens at `index` (ascending positions) of one row, e.g. prefix + accepted path."""
        index = torch.as_tensor(index, dtype=torch.long)
        self.rows[row] = [self.rows[row][i] for i in index.tolist()]
        if self.cache is not None:
            self.cache.keep_positions(row, index)

    # ------------------------------------------------------------------ internals

    def _reset_cache(self) -> None:
        B = max(self.batch_size, self.max_batch)
        reusable = isinstance(self.cache, StaticCache) and self.cache.k.shape[1] >= B
        if self.cache_kind == "none":
            self.cache = None
        elif reusable or (self.cache is not None and self.cache_kind == "dynamic"):
            self.cache.reset()
        else:
            self.cache = make_cache(self.cache_kind, self.model, B, self.max_len, self.fixed_shape)

    def _mask(self, starts: list[int], T: int, tree: Tree | None) -> torch.Tensor | None:
        """bool [B, T, S]: query t of row b sees the row's stored columns and the new ones it may see."""
        if tree is None and len(set(starts)) == 1 and not self.fixed_shape:
            return None  # every row the same length: plain causal attention
        S = self.cache.key_span(T)
        within = torch.ones(T, T, dtype=torch.bool, device=self.device).tril() if tree is None \
            else tree.mask.to(self.device)  # [T, T] or [B, T, T]
        return new_token_mask(torch.tensor(starts, device=self.device), within, S)

    def _recompute(self, T: int, tree: Tree | None = None) -> torch.Tensor:
        """No cache: forward every row in full, return the logits of its last T tokens [B, T, V]."""
        lengths = torch.tensor(self.lengths, device=self.device)
        tokens = right_padded(self.rows, self.device)  # [B, L]
        B, L = tokens.shape
        positions = torch.arange(L, device=self.device).expand(B, L)
        starts = lengths - T  # [B]: where each row's T newest tokens begin
        mask = None
        if tree is not None:  # the newest T tokens are a tree: their positions and mutual visibility change
            offset = positions - starts[:, None]  # [B, L]: index among the new tokens
            is_new = (offset >= 0) & (offset < T)
            depth = per_row(tree.depth.to(self.device), B, 1).gather(1, offset.clamp(0, T - 1))  # [B, L]
            positions = torch.where(is_new, starts[:, None] + depth, positions)
            among_new = pick(per_row(tree.mask.to(self.device), B, 2), offset, offset)  # [B, L, L]
            causal = torch.ones(L, L, dtype=torch.bool, device=self.device).tril()
            mask = torch.where(is_new[:, :, None] & is_new[:, None, :], among_new, causal)
        columns = starts[:, None] + torch.arange(T, device=self.device)  # [B, T]: the newest T tokens' places
        return self.model(tokens, positions, mask=mask, logits_at=columns)  # [B, T, V]: the LM head on those alone


def right_padded(rows: list[list[int]], device=None, pad_id: int = 0) -> torch.Tensor:
    """Token lists -> long [B, max length], each row from column 0, padded on the right."""
    tokens = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for b, ids in enumerate(rows):
        tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return tokens.to(device)


def per_row(tensor: torch.Tensor, batch: int, shared_dims: int) -> torch.Tensor:
    """A tree tensor shared by every row (`shared_dims` dims) or given per row: -> one per row [B, ...]."""
    return tensor.expand(batch, *tensor.shape) if tensor.dim() == shared_dims else tensor


def pick(within: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """within [B, T, T], query_index [B, Q], key_index [B, S] (clamped into 0..T-1) -> [B, Q, S]."""
    T = within.shape[-1]
    rows = torch.arange(len(within), device=within.device)[:, None, None]
    return within[rows, query_index.clamp(0, T - 1)[:, :, None], key_index.clamp(0, T - 1)[:, None, :]]


def new_token_mask(starts: torch.Tensor, within: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, T, S] for T new tokens written at columns starts[b] .. starts[b] + T - 1 of row b.

    A new token sees every column before its row's start and, among the new columns,
    those that `within` ([T, T], or [B, T, T] per row) allows; never a column after them.
    """
    B, T = len(starts), within.shape[-1]
    offset = torch.arange(num_keys, device=starts.device)[None, :] - starts[:, None]  # [B, S]
    is_new = (offset >= 0) & (offset < T)
    queries = torch.arange(T, device=starts.device).expand(B, T)
    return (offset < 0)[:, None, :] | (is_new[:, None, :] & pick(per_row(within, B, 2), queries, offset))


__all__ = ["DecodeSession", "Tree", "right_padded", "new_token_mask", "per_row", "pick"]
