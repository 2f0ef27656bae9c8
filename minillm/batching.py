"""Many sequences of different lengths in one forward: left padding, masks, positions.

A KV cache appends each row's new key at the same column for every row, so the
rows must end together: shorter prompts are padded on the *left*. Padding must
then be invisible:

* attention: no real query may attend to a padding key (the padding mask);
* positions: a row's first real token has position 0 however much padding precedes
  it (for learned positions and RoPE alike).

    tokens     [B, L]  padded ids        key_valid [B, L]  True at real tokens
    positions  [B, L]  0.. per row (padding gets 0: it is never attended to)

`attention_mask` turns `key_valid` into the [B, T, S] boolean mask the model takes.
"""

from __future__ import annotations

import torch


def pad_left(rows: list[list[int]], pad_id: int = 0, device=None):
    """Left-pad token lists into one batch. Returns tokens, key_valid, positions (all [B, L])."""
    length = max(len(r) for r in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    key_valid = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, ids in enumerate(rows):
        if ids:
            tokens[b, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
            key_valid[b, length - len(ids):] = True
    positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)  # transformers' position_ids rule
    return tokens.to(device), key_valid.to(device), positions.to(device)


def attention_mask(key_valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """key_valid [B, S] -> bool mask [B, T, S] for the last T = num_queries positions.

    Causal (query t sees keys up to its own column) and blind to padding keys. A
    padding query would see no key at all, which makes softmax 0/0 = NaN, so every
    query may always see itself; padding outputs are never used.
    """
    S = key_valid.shape[1]
    causal = torch.ones(num_queries, S, dtype=torch.bool, device=key_valid.device).tril(diagonal=S - num_queries)
    own_column = torch.zeros_like(causal)
    own_column[torch.arange(num_queries), torch.arange(S - num_queries, S)] = True
    return causal & (key_valid[:, None, :] | own_column)  # [B, T, S]
