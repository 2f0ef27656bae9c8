"""Lesson 12 exercises: write your answers here; `pytest lessons/12-continuous-batching` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/12_continuous_batching.py (try first!).

Conventions (the package's, `minillm.cache.paged`): a pool holds `num_blocks` blocks of `block_size` token slots; a
sequence's block table lists the blocks holding its tokens in order; the slot of a token is its row in the pool
flattened to [num_blocks * block_size, ...].
"""

from __future__ import annotations

import torch  # noqa: F401


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Exercise 1: Slots and block tables

    The pool row (slot) holding the token at `position` of a sequence with this block table:
    the block is block_table[position // block_size], the offset inside it position % block_size.
    Example: block_table [7, 2], block_size 4: position 5 -> 2 * 4 + 1 = 9.
    Raise ValueError if the table is too short to hold the position.
    """
    raise NotImplementedError


def gather_keys(pool: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    """Exercise 1: Slots and block tables

    pool [num_blocks, block_size, KV, hd] -> the sequence's first `length` keys in order, [KV, length, hd]
    (the layout attention wants: one [length, hd] matrix per KV head).
    """
    raise NotImplementedError


def blocks_held(prompts: list[list[int]], block_size: int) -> int:
    """Exercise 2: What prefix sharing saves

    Prompts are admitted one after another (none is ever freed). Each needs ceil(len / block_size) blocks, but
    its i-th full block is shared with an earlier prompt when both have the same tokens in blocks 0..i, as long as
    every block before it was shared too (a prefix ends at its first miss), and never for the block holding the
    prompt's last token (its keys are recomputed to get its logits, into a block of its own). How many distinct
    blocks does the pool hold at the end?

    Example: block_size 2, prompts [1, 2, 3, 4, 5] and [1, 2, 3, 4, 6] -> 3 + 1 = 4 blocks (the second shares
    [1 2] and [3 4]); [1, 2, 3, 4] twice -> 2 + 1 = 3 (the second's last block holds its last token).
    """
    raise NotImplementedError


def packed_mask(lengths: list[int]) -> torch.Tensor:
    """Exercise 3: The packed attention mask

    Sequences of these lengths packed back to back into one row of N = sum(lengths) tokens. Return a bool [N, N]
    mask: True where token i may attend to token j, i.e. j belongs to the same sequence and comes at or before i.
    Example: lengths [2, 1] -> [[1, 0, 0], [1, 1, 0], [0, 0, 1]].
    """
    raise NotImplementedError


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """Exercise 3: The packed attention mask

    long [N]: each packed token's position within its own sequence. Example: lengths [2, 1] -> [0, 1, 0].
    """
    raise NotImplementedError


def serving_metrics(arrivals: list[float], token_times: list[list[float]]) -> dict:
    """Exercise 4: Serving metrics

    Request r arrived at arrivals[r] (seconds) and produced its tokens at token_times[r] (ascending, at least one).
    Return a dict with
      "ttft": (p50, p99) of the time to first token, token_times[r][0] - arrivals[r];
      "tpot": (p50, p99) of the time per output token after the first,
              (last - first) / (number of tokens - 1), over the requests with at least two tokens;
      "itl":  (p50, p99) of every gap between successive tokens of a request, all requests pooled;
      "e2e":  (p50, p99) of the end-to-end latency, last token time - arrival;
      "tokens_per_second": all tokens / (latest last-token time - earliest arrival).
    Percentiles interpolate linearly between the sorted values (NumPy's default): the q-th percentile of n sorted
    values sits at index (n - 1) * q / 100.
    """
    raise NotImplementedError
