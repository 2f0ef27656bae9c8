"""Log-probabilities a request asks to see: each token's, and the likeliest alternatives' at its position.

A server reports them for generated tokens (OpenAI's `logprobs`, `top_logprobs`) and, for
scoring a text, for the prompt's own tokens (`echo`; what lm-evaluation-harness reads):

    reports = token_logprobs(logits, tokens, tops)   # logits [K, V], tokens [K]: one TokenLogprobs per row

Which distribution. A generated token's logprobs come from the logits the sampler drew it
from (`minillm.runtime.sequence.sample_next`): after the penalties and, when sampling, after
temperature, top-k, top-p and min-p; a token those removed has logprob -inf. So the chosen
token's logprob is the log of the very probability it was drawn with, and greedy decoding
without penalties reports the model's own distribution. (This is vLLM's
`logprobs_mode="processed_logprobs"`; vLLM's default reports the raw model output whatever
the sampling settings, which describes the model, not the draw.) A prompt token is drawn by
no sampler: its logprobs are the model's raw distribution, as vLLM's prompt logprobs are.
Always log_softmax in float32.

Cost: a [K, V] log_softmax, a top-k and a copy to the host for each reported token, paid only
by the requests that ask; prompt logprobs also need the LM head at every prompt position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """One position's report: the token there, its log-probability, and the likeliest tokens', best first."""

    token_id: int
    logprob: float  # log p(token_id); -inf for a token the logits processors removed
    top: list[tuple[int, float]]  # (token id, logprob) of the likeliest tokens, best first (token_id may be one)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprobs]:
    """Row k: the logprob of tokens[k] under logits[k], and the tops[k] likeliest tokens'.

    logits [K, V] (float32 log_softmax whatever their dtype), tokens long [K], tops: K counts >= 0.
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [K, V]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()  # [K]
    best = logprobs.topk(max(tops, default=0), dim=-1)  # values, indices [K, max(tops)]
    return [TokenLogprobs(token, logprob, list(zip(ids[:top], values[:top])))
            for token, logprob, ids, values, top in zip(tokens.tolist(), chosen, best.indices.tolist(),
                                                          best.values.tolist(), tops)]


__all__ = ["TokenLogprobs", "token_logprobs"]
