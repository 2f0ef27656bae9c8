"""Worked solutions for lesson 08 (speculative decoding). Check them: `pytest lessons/08-speculative-decoding --solutions`."""

from __future__ import annotations

import torch

from minillm.cache.kinds import make_cache
from minillm.decoding.sampling import SamplingConfig
from minillm.strategies.drafters import Draft
from minillm.strategies.speculative import SpeculativeDecoder

# ------------------------------------------------------------------ Exercise 1


class BigramDrafter:
    """Draft by following the sequence's own bigrams: after token t, guess the token that followed t
    the last time it appeared, then do the same from that guess, and so on.

    Unlike prompt lookup, which copies a span that already exists, the chain can run past the end of
    what was seen: in [1, 2, 3, 1, 2] it drafts 3, 1, 2, 3, ... (a loop the text has started).
    """

    def begin(self, target, tokenizer, max_len):
        pass  # nothing to load: the table is rebuilt from the sequence each round

    def propose(self, sequence, n, config, history, generator):
        follower = {}
        for before, after in zip(sequence, sequence[1:]):
            follower[before] = after  # later pairs overwrite earlier ones: the most recent wins
        tokens, last = [], sequence[-1]
        while len(tokens) < n and last in follower:
            last = follower[last]
            tokens.append(last)
        # A deterministic drafter: q = None (one-hot), which the sampling rule also understands.
        return Draft(tokens)

    def rollback(self, sequence):
        pass  # no state beyond the sequence itself


def bigram_drafter():
    """Exercise 1: A bigram drafter"""
    return BigramDrafter()


# ------------------------------------------------------------------ Exercise 2


class AtMostK:
    """A drafter wrapper: the inner drafter, asked for at most `k` tokens. Changing `k` between rounds
    changes the draft length without touching the decoder (it only sees the Drafter interface)."""

    def __init__(self, inner, k):
        self.inner, self.k = inner, k

    def begin(self, target, tokenizer, max_len):
        self.inner.begin(target, tokenizer, max_len)

    def propose(self, sequence, n, config, history, generator):
        return self.inner.propose(sequence, min(n, self.k), config, history, generator)

    def rollback(self, sequence):
        self.inner.rollback(sequence)


def adaptive_speculative(model, prompt_ids, drafter, max_new_tokens, k_start=4, k_max=16):
    """Exercise 2: Adaptive draft length"""
    wrapper = AtMostK(drafter, k_start)
    config = SamplingConfig(max_new_tokens=max_new_tokens, eos_token_id=())
    # The decoder may draft up to k_max per round; the wrapper decides how many it actually gets.
    decoder = SpeculativeDecoder(model, wrapper, list(prompt_ids), config, num_draft_tokens=k_max)
    decoder.prefill()
    schedule = []
    while not decoder.finished:
        k = wrapper.k
        r = decoder.round()
        schedule.append((k, r))
        # transformers' "heuristic" schedule: a fully accepted draft says "be bolder", anything else "back off".
        wrapper.k = min(k_max, k + 2) if r.accepted == k else max(1, k - 1)
    return decoder.state.token_ids, schedule


# ------------------------------------------------------------------ Exercise 3


def verify_sampled(p, q, draft_token, generator):
    """Exercise 3: The sampling acceptance rule, by hand"""
    # Keep the drafted x with probability min(1, p(x)/q(x)): where the target likes x at least as much
    # as the drafter did, always; otherwise in proportion.
    keep = min(1.0, float(p[draft_token] / q[draft_token]))
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < keep:
        return draft_token, True
    # Rejected: draw from the mass p has and q lacks, normalise(max(0, p - q)). Together with what the
    # keep step emitted (min(p, q)) this adds up to p exactly.
    residual = (p - q).clamp(min=0)
    token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return token, False


# ------------------------------------------------------------------ Exercise 4


@torch.inference_mode()
def speculative_with_cache(model, prompt_ids, draft, k, max_new_tokens):
    """Exercise 4: Verify with a KV cache"""
    prompt_ids = list(prompt_ids)
    cache = make_cache("static", model, 1, len(prompt_ids) + max_new_tokens + k + 1)
    # Prefill: the cache now holds the prompt; the last logits give the first new token.
    logits = model(torch.tensor([prompt_ids]), torch.arange(len(prompt_ids))[None], cache=cache)[0, -1]
    seq = prompt_ids + [int(logits.argmax())]
    # Invariant between rounds: the cache holds every token of seq except the newest.
    while len(seq) - len(prompt_ids) < max_new_tokens:
        room = max_new_tokens - (len(seq) - len(prompt_ids))
        drafted = list(draft(seq, min(k, room - 1)))[:room - 1]
        start = len(seq) - 1  # position of the newest token, the first one the cache lacks
        tokens = torch.tensor([[seq[-1], *drafted]])
        positions = torch.arange(start, start + tokens.shape[1])[None]
        best = model(tokens, positions, cache=cache)[0].argmax(-1).tolist()  # [len(drafted) + 1]
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == best[accepted]:
            accepted += 1
        seq += best[:accepted + 1]  # the agreed drafts (equal to the target's argmax) and one token of its own
        # The cache now holds keys for [newest, d1..dk]; keep those of accepted tokens only, and not the
        # newest emitted token (it is fed at the start of the next round).
        cache.crop(len(seq) - 1)
    return seq[len(prompt_ids):]
