"""Lesson 07 exercises: write your answers here; `pytest lessons/07-batching` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/07_batching.py
(try first: `pytest lessons/07-batching --solutions` runs the checks on them).
"""

from __future__ import annotations

import torch  # noqa: F401

from minillm.model.attention import causal_mask_lower_right, set_attention_backend  # noqa: F401  (exercise 4)
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


def predicted_nan_rows() -> dict[str, list[bool]]:
    """Exercise 4: Break the diagonal

    Write your prediction as literals, before you run anything: running your code is checking, not
    predicting. The experiment: prompts of 3, 17, 1 and 9 tokens, left-padded into one batch
    (`pad_left`), one prefill forward of tiny Llama (`tiny_pair("llama", n_layer=...)`, no cache)
    with the mask of `mask_without_own_column` below: `attention_mask`'s rule with the s = t term
    dropped. For each case, which rows' logits at their REAL tokens contain a NaN?

        "sdpa, 2 layers":    the default attention backend (PyTorch's SDPA), the 2-layer model
        "softmax, 1 layer":  your `softmax_attention` as every layer's backend, a 1-layer model
        "softmax, 2 layers": your `softmax_attention`, the 2-layer model

    Returns {case: [one bool per row, True where that row's real logits hold a NaN]}. The check runs
    the three cases (with its own textbook attention) and compares.
    """
    raise NotImplementedError


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step) -> torch.Tensor:
    """Exercise 4: Break the diagonal

    Attention as the textbook writes it, as a backend the model can run (`set_attention_backend(model,
    softmax_attention)`; the calling convention is in minillm/model/attention.py): q [B, H, T, hd];
    k, v [B, KV, S, hd], query head h reading KV head h // (H // KV); step.mask bool [B, T, S], True
    where a query may see a key, or None for causal attention with the T queries the last T of the S
    keys. Scores q . k / sqrt(hd), -inf where the mask says no, softmax over the keys, times v.
    Returns [B, H, T, hd].

    Add no guard for a query that may see no key at all (no nan_to_num, no clamping): what such a row
    becomes, and where it goes, is the experiment. The check runs the tiny models through it and
    compares with SDPA.
    """
    raise NotImplementedError


def mask_without_own_column(key_valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Exercise 4: Break the diagonal

    `minillm.runtime.batching.attention_mask` without its s = t term: query t sees key s only when s
    is at or before t (lower-right causal, the T queries the last T of the S columns) AND key s is a
    real token; a query no longer sees its own column just because it is its own. key_valid: bool
    [B, S]. Returns bool [B, T, S], T = num_queries.

    Then run the experiment of `predicted_nan_rows` with your backend, and once more with
    `attention_mask`: look where the NaN appears, and at what the s = t term gives back.
    """
    raise NotImplementedError
