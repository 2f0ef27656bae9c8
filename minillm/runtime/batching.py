"""Many sequences of different lengths in one forward: left padding, masks, positions.

A cache with one length for the whole batch appends each row's new key at the same
column for every row, so the rows must end together: shorter prompts are padded on
the *left* (transformers' way). Padding must then be invisible:

* attention: no real query may attend to a padding key (the padding mask);
* positions: a row's first real token has position 0 however much padding precedes
  it (for learned positions and RoPE alike).

    tokens     [B, L]  padded ids        key_valid [B, L]  True at real tokens
    positions  [B, L]  0.. per row (padding gets 0: it is never attended to)

`attention_mask` turns `key_valid` into the [B, T, S] boolean mask the model takes.

minillm's decode session (`minillm.runtime.session`) goes one step further: its cache keeps a
length per row, so rows are aligned on the left, padded on the right only during
prefill, and may then grow and roll back independently (what speculative decoding and
continuous batching need). Both layouts give every row exactly its unbatched tokens.

Right padding (`pad_right`, `greedy_right_padded`) is here for comparison: without a
cache every step rebuilds the batch, so a right-padded row simply continues after its
last token. `length_sorted_chunks` groups prompts of similar lengths into batches
(`minillm.strategies.generate.generate_in_batches` runs them).
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


def pad_right(rows: list[list[int]], pad_id: int = 0, device=None):
    """Right-pad token lists: the layout that works only without a KV cache.

    Returns tokens, key_valid, positions (all [B, L]); positions are simply 0..L-1,
    since every row starts at column 0. `attention_mask(key_valid, L)` still applies:
    causality already hides the padding that follows a row's last real token.
    """
    length = max(len(r) for r in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    key_valid = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, ids in enumerate(rows):
        tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        key_valid[b, : len(ids)] = True
    positions = torch.arange(length).expand(len(rows), length)
    return tokens.to(device), key_valid.to(device), positions.to(device)


@torch.inference_mode()
def greedy_right_padded(model, rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Batched greedy decoding with right padding and no cache: the comparison for left padding.

    Each step re-pads the grown rows and recomputes everything, so every new token
    lands right after its own row's last token and no padding hole ever opens in
    the middle of a row. With a cache the new column is shared by all rows, so a
    short row would get a hole between its prompt and its continuation: that is
    why cached batching pads on the left.
    """
    sequences = [list(r) for r in rows]
    for _ in range(max_new_tokens):
        tokens, key_valid, positions = pad_right(sequences, device=model.device)
        logits = model(tokens, positions, mask=attention_mask(key_valid, tokens.shape[1]))  # [B, L, V]
        last = torch.tensor([len(s) - 1 for s in sequences], device=model.device)
        next_tokens = logits[torch.arange(len(sequences)), last].argmax(dim=-1)  # [B]
        for seq, token in zip(sequences, next_tokens.tolist()):
            seq.append(token)
    return [seq[len(r):] for seq, r in zip(sequences, rows)]


def padding_share(lengths: list[int], new_tokens: int = 1) -> float:
    """Share of the positions a left-padded batch pushes through the model that are padding.

    Prefill forwards max(lengths) positions per row; each of the `new_tokens - 1`
    decode steps forwards one real position per row. (Attention also reads the
    padding keys at every step; that cost is not counted here.)
    """
    padded = sum(max(lengths) - n for n in lengths)
    computed = len(lengths) * (max(lengths) + max(new_tokens - 1, 0))
    return padded / computed


def length_sorted_chunks(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Split row indices into batches of at most `batch_size`, grouping similar lengths.

    Rows of similar length share a batch, so little padding is computed. Reordering
    is safe: a row's output depends only on its own prompt, config and seed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is invalid: must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
