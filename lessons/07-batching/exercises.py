"""Lesson 07 exercises: write your answers here; `pytest lessons/07-batching` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/07_batching.py
(try first: `pytest lessons/07-batching --solutions` runs the checks on them).
"""

from __future__ import annotations

import torch  # noqa: F401

from minillm.cache.kv_cache import DynamicCache  # noqa: F401  (exercise 4)
from minillm.runtime.batching import attention_mask, pad_left  # noqa: F401  (exercise 4)
from minillm.runtime.session import DecodeSession  # noqa: F401  (exercise 3)


def packed_prefill(model, rows: list[list[int]]) -> list[torch.Tensor]:
    """Exercise 1: Packed prefill

    Forward all `rows` (non-empty token lists) in ONE call of `model(tokens, positions, mask=mask)`
    with tokens of shape [1, N], N = the sum of the row lengths: the rows concatenated, no padding.
    Positions restart at 0 for each row; the mask [1, N, N] is block-diagonal and causal (a token
    sees the earlier tokens of its own row and itself, nothing of the other rows).

    Returns one float tensor per row, [len(row), vocab]: the logits at each of its tokens. The
    check compares them with each row forwarded alone and counts the forward calls.
    """
    raise NotImplementedError


def least_padding_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Exercise 2: Buckets with the least padding

    Split the row indices 0..len(lengths)-1 into exactly ceil(n / batch_size) batches of at most
    `batch_size` rows each, minimising the padding a padded prefill computes:
    sum over batches of sum(max(batch lengths) - length). Return the batches as lists of indices
    (any order). Hint: some optimal split takes contiguous runs of the rows sorted by length; choose
    where the runs break with dynamic programming. `minillm.runtime.batching.length_sorted_chunks` is
    sorted too, but fills batches from the shortest rows up, which is not always optimal.
    """
    raise NotImplementedError


def greedy_per_row_eos(model, prompts: list[list[int]], eos_ids: list[int], max_new_tokens: int) -> list[list[int]]:
    """Exercise 3: Per-row stops on the session

    Greedy decoding of all `prompts` together on a `minillm.runtime.session.DecodeSession`
    (`prefill`, `extend`, `select`). Row i stops after it produces eos_ids[i] (kept as its last
    token) or after `max_new_tokens` tokens. A finished row must leave the batch at once with
    `session.select(...)`: no forward may hold a finished row.

    Returns each row's new tokens, in the prompts' order. The check compares each row with
    `generate(model, prompt, max_new_tokens=..., eos_token_id=eos)` run alone and watches the
    batch size of every forward.
    """
    raise NotImplementedError


def greedy_left_padded(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Exercise 4: A left-padded cached loop

    transformers' layout: left-pad once with `pad_left`, keep one `DynamicCache` for the whole batch
    (one length for every row) and call `model(tokens, positions, cache=cache, mask=mask)` yourself.
    Prefill: the padded prompts with `attention_mask(valid, L)`. Each step: append one True column
    to `valid`, build `attention_mask(valid, 1)` and give every row the position after its previous
    one. Greedy, no EOS: every row makes `max_new_tokens` tokens.

    Returns each row's new tokens. The check compares with `generate` and with transformers'
    batched `generate` on the same weights.
    """
    raise NotImplementedError
