"""Lesson 12 exercises: write your answers here; `pytest lessons/12-continuous-batching` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/12_continuous_batching.py (try first!).

Conventions (the package's, `minillm.cache.paged`): a pool holds `num_blocks` blocks of `block_size` token slots; a
sequence's block table lists the blocks holding its tokens in order.
"""

from __future__ import annotations


def make_free_list(num_blocks: int):
    """Exercise 1: A free list with reference counts

    The bookkeeping under every paged cache: which of `num_blocks` blocks are free, and how many holders each
    held block has (a block is shared when a prefix-cache hit or a fork gives it a second holder). Write a class
    and return a new instance of it with every block free, with these methods:

      allocate() -> int      take the block on top of the free stack, reference count 1 (at the start the
                             stack holds 0 on top, then 1, 2, ...); RuntimeError when no block is free
      fork(block)            one more holder of a held block (its count + 1); ValueError if the block is free
      free(block)            one holder fewer; at zero the block is pushed on top of the free stack (so it is
                             the next one `allocate` hands out); ValueError if it is already free (a double free)
      ref_count(block) -> int   its holders (0 when free)
      num_free() -> int         how many blocks are free

    The check replays random allocate / free sequences on your list and on the package's
    `minillm.cache.blocks.BlockManager` (one-token blocks, prefix caching off: a sequence of n tokens takes n
    blocks, and freeing it frees them last block first): the same block ids, the same free counts, the same
    reference counts. Then random sequences with forks: every count equals the holders, free + held = all
    blocks, a held block is never handed out again, and the errors above are raised.
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


def ridge_batch(weight_bytes: float, bytes_per_second: float, flops_per_token: float,
                flops_per_second: float) -> int:
    """Exercise 3: When batching stops paying

    A decode step of a batch of B requests reads every weight once (weight_bytes at bytes_per_second) and does
    B * flops_per_token of arithmetic (at flops_per_second). Take the roofline's view (lesson 06): the step
    lasts as long as the slower of the two. Up to some batch the weights dominate, the step costs the same
    whatever B, and throughput grows B-fold; past it the arithmetic dominates and throughput stays flat while
    every request waits longer per token. Return that batch: the smallest integer B at which the step's
    arithmetic takes at least as long as its weight reading. Continuous batching (or any batching) stops
    paying there: a larger batch adds latency, not throughput.

    The check compares it with a brute-force scan of the roofline on random machines, then with the stored
    measurements (see `machine_from_results`).
    """
    raise NotImplementedError


def machine_from_results(rows: list[dict], weight_bytes: float, flops_per_token: float) -> tuple[float, float]:
    """Exercise 3: When batching stops paying

    rows: `results/batch.json`'s "rows" (lesson 07's batch benchmark on the default model): each has "batch"
    and "minillm" -> "decode_per_second", the decode-phase tokens per second of all rows together.
    Return (bytes_per_second, flops_per_second) as the measurements imply them: the rate at which the batch-1
    step reads the weights (one token per step, so one weight read per token) and the arithmetic rate of the
    largest batch (which is the most compute-bound). Then `ridge_batch` on these predicts where the measured
    throughput stops growing B-fold; the check holds the prediction against the measured curve.
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


def admit(waiting: list[int], running: int, free_blocks: int, num_blocks: int, block_size: int, budget: int,
          max_num_seqs: int, watermark: float) -> list[int]:
    """Exercise 5: The admission rule

    The second half of a scheduler step (`minillm.runtime.scheduler`): the running requests have taken their
    tokens; now waiting requests join. waiting: each waiting request's prompt length, first in line first (no
    prefix cache: a prompt of n tokens needs ceil(n / block_size) new blocks); running: how many requests run;
    free_blocks: free blocks left in a pool of num_blocks; budget: tokens this step's forward may still take.
    Admit requests in order while budget > 0, fewer than max_num_seqs run, and the request's blocks fit the free
    ones leaving int(watermark * num_blocks) free while any request runs (a request alone may take the whole
    pool). The first request that does not fit stops admission: nobody overtakes it. Each admitted request feeds
    min(its length, budget) tokens of its prompt (a long prompt is chunked: the rest comes in later steps) and takes
    all its blocks now. Return the tokens each admitted request feeds, in order.

    Example: waiting [10, 30, 4], running 1, 10 free of 20 blocks of 4, budget 32, max_num_seqs 8, watermark 0.1:
    the first takes 3 blocks (7 free >= 2 kept) and feeds 10; the second needs 8 (7 free): admission stops -> [10].
    """
    raise NotImplementedError
