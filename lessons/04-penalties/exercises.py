"""Lesson 04 exercises: write your answers here; `pytest lessons/04-penalties` checks them.

Each function starts as a stub; its check is skipped until you replace the
`raise NotImplementedError`. Worked answers: solutions/04_penalties.py
(try first: `pytest lessons/04-penalties --solutions` runs the checks on them).

Like the penalties in `minillm/decoding/sampling.py`, a processor here is a pure function
logits [batch, vocab] -> logits [batch, vocab] that does not modify its input.
"""

from __future__ import annotations

import math  # noqa: F401

import torch  # noqa: F401

from minillm.decoding.sampling import TokenHistory
from minillm.runtime.session import DecodeSession  # noqa: F401


def apply_no_repeat_ngram(logits: torch.Tensor, sequences: list[list[int]], n: int) -> torch.Tensor:
    """Exercise 1: No-repeat n-gram processor

    transformers' `no_repeat_ngram_size=n` (`NoRepeatNGramLogitsProcessor`): ban (set to -inf)
    every token that would complete an n-gram already present in the row's sequence. The
    candidate n-gram is (the row's last n-1 tokens, next token); every token that followed
    those same n-1 tokens earlier in the sequence is banned. With n = 1 every token already in
    the sequence is banned; a row shorter than n-1 tokens bans nothing.

    logits: float32 [batch, vocab]; sequences: each row's whole sequence so far (prompt
      included, as transformers sees input_ids), rows may differ in length; n >= 1.
    Returns float32 [batch, vocab]: banned tokens -inf, the rest unchanged.
    """
    raise NotImplementedError


def greedy_with_processor(model, prompt: list[int], max_new_tokens: int, processor) -> list[int]:
    """Exercise 2: A decode loop that takes any processor

    Greedy decoding where a logits processor with transformers' calling convention,
    `processor(input_ids, scores) -> scores` (input_ids long [1, L]: the whole sequence so far,
    prompt included; scores float32 [1, vocab]), rewrites the logits before every argmax. Use a
    KV cache: `DecodeSession(model, max_len=...)`, `session.prefill([prompt])` gives the next-token
    logits [1, V], `session.extend([[token]])` appends one token and returns logits [1, 1, V].
    Never stop early (no EOS): return exactly max_new_tokens tokens.

    model: a minillm Transformer; prompt: token ids; processor: e.g. transformers'
      `NoRepeatNGramLogitsProcessor(3)` or `RepetitionPenaltyLogitsProcessor(1.5)`.
    Returns the generated token ids (a list of max_new_tokens ints).
    """
    raise NotImplementedError


def penalise_rows(logits: torch.Tensor, history: TokenHistory, repetition: torch.Tensor,
                  presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Exercise 3: Per-row penalties in one pass

    A server batches requests with different settings. `minillm.decoding.sampling.process_rows` groups
    rows by settings and runs the processors once per group; do it for all rows at once instead:
    the repetition penalty (history.seen) and then presence/frequency (history.generated_counts),
    each row with its own values, as tensor operations with no loop over rows. Compute each
    penalty the way `apply_repetition_penalty` and `apply_presence_frequency_penalty` do, so the
    results are equal bit for bit (a value of 1 or 0 leaves a row unchanged).

    logits: float32 [B, V]; history: the rows' TokenHistory; repetition, presence, frequency:
      float [B], row b's settings.
    Returns float32 [B, V], equal to `process_rows(logits, configs, history)` for greedy configs.
    """
    raise NotImplementedError


def picks_before_overtaken(lead: float, presence: float, frequency: float, max_uses: int = 1000) -> int | None:
    """Exercise 4: How long the leader keeps the argmax

    Greedy decoding with the OpenAI penalties on a model whose logits never change: the leader
    (token 0) scores `lead`, the runner-up (token 1) scores 0, nothing was generated yet. Each
    step the leader wins while its penalised logit is >= the runner-up's (ties go to the lower
    token id), and every win adds one use to its count. How many times is the leader picked
    before the runner-up takes over? Work it out from the formula (no loop over steps needed).

    lead: any float; presence, frequency: in [0, 2].
    Returns the number of picks (0 if the leader never wins), or None if the leader would be
    picked more than max_uses times.
    """
    raise NotImplementedError
