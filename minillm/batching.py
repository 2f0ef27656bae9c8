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

Right padding (`pad_right`, `greedy_right_padded`) is here for comparison: it works
only without a cache, where every step rebuilds the batch. `generate_in_batches`
runs any number of prompts in length-sorted chunks of a given batch size.
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


class _ChunkStreamer:
    """Forwards a chunk's rows to the caller's streamer under their input index."""

    def __init__(self, streamer, index: list[int]):
        self.streamer, self.index = streamer, index

    def put(self, row: int, text: str) -> None:
        self.streamer.put(self.index[row], text)

    def end(self) -> None:  # the caller's streamer ends once, after the last chunk
        pass


def generate_in_batches(model, prompts, batch_size: int, config=None, *, tokenizer=None, streamer=None,
                        **generate_kwargs):
    """`generate()` over many prompts, at most `batch_size` at a time.

    Prompts are grouped by length (`length_sorted_chunks`); rows come back in input
    order and the statistics are summed over the chunks. Each row's tokens are the
    ones `generate()` gives it alone, so the split changes speed, never output.
    """
    from .infer import GenerationOutput, GenerationStats, check_prompts, encode_prompts, generate  # infer imports us

    rows = encode_prompts(prompts, tokenizer)
    check_prompts(rows, model.config.block_size, model.config.vocab_size)  # name the bad row by its input index
    outputs, stats = [None] * len(rows), GenerationStats()
    for index in length_sorted_chunks([len(r) for r in rows], batch_size):
        chunk_streamer = _ChunkStreamer(streamer, index) if streamer is not None else None
        out = generate(model, [rows[i] for i in index], config, tokenizer=tokenizer, streamer=chunk_streamer,
                       **generate_kwargs)
        for i, row in zip(index, out.rows):
            outputs[i] = row
        for name in ("prompt_tokens", "prefill_seconds", "decode_tokens", "decode_seconds", "forward_passes"):
            setattr(stats, name, getattr(stats, name) + getattr(out.stats, name))
        for key, value in out.stats.extra.items():  # counters (drafted, accepted, ...) add up
            stats.extra[key] = stats.extra.get(key, 0) + value if isinstance(value, (int, float)) else value
    if streamer is not None:
        streamer.end()
    return GenerationOutput(outputs, stats)
