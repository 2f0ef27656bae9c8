"""Lesson 08 exercises: write your answers here; `pytest lessons/08-speculative-decoding` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/08_speculative_decoding.py (try first!).
"""

from __future__ import annotations


def bigram_drafter():
    """Exercise 1: A bigram drafter

    Return a drafter object for `minillm.strategies.speculative` (the `Drafter` interface: `begin(target, tokenizer,
    max_len)`, `propose(sequence, n, config, history, generator) -> Draft`, `rollback(sequence)`) that drafts
    by following the sequence's own bigrams: after the last token t, guess the token that followed t the most
    recent time t appeared earlier in `sequence` (pairs sequence[i], sequence[i + 1]; the latest pair wins),
    then continue from that guess with the same table, up to n tokens; stop early when the current token has
    never been followed by anything. Return `Draft(tokens)` (q=None: a deterministic drafter).

    Example: sequence [1, 2, 3, 1, 2], n = 4 -> Draft([3, 1, 2, 3]).

    It must plug into `speculative_generate(model, prompt, bigram_drafter(), num_draft_tokens=k)` unchanged
    and give exactly plain greedy's tokens.
    """
    raise NotImplementedError


def adaptive_speculative(model, prompt_ids, drafter, max_new_tokens, k_start=4, k_max=16):
    """Exercise 2: Adaptive draft length

    Greedy speculative decoding whose draft length changes between rounds (transformers' "heuristic"
    schedule): after a round in which all k drafted tokens were accepted, k grows by 2 (at most k_max);
    after any other round (a rejection, or fewer than k tokens drafted) k shrinks by 1 (at least 1).

    Change the draft length through the Drafter interface alone: wrap `drafter` in a small drafter of your
    own whose `propose(sequence, n, ...)` asks the inner drafter for at most `self.k` tokens (and whose
    `begin` / `rollback` pass through), build `SpeculativeDecoder(model, wrapper, prompt_ids,
    SamplingConfig(max_new_tokens=max_new_tokens, eos_token_id=()), num_draft_tokens=k_max)`, call
    `prefill()`, then `round()` until `finished`, and update the wrapper's k from each returned `Round`
    (`drafted`, `accepted`).

    Returns (token_ids, schedule): the generated ids (`decoder.state.token_ids`) and, per round, a pair
    (the k that round used, the `Round` it returned).
    """
    raise NotImplementedError


def verify_sampled(p, q, draft_token, generator):
    """Exercise 3: The sampling acceptance rule, by hand

    p, q: float64 probability vectors [V] (target and drafter, already processed); draft_token: an id drawn
    from q (so q[draft_token] > 0); generator: a torch.Generator for every random draw you make.

    Keep the drafted token with probability min(1, p(x)/q(x)); otherwise draw a token from
    normalise(max(0, p - q)). Returns (emitted token id as an int, whether it is the kept drafted token).
    Write it from the formulas, without `minillm.strategies.speculative`'s helpers. The check draws x ~ q many times
    and compares how often each token comes out with p, and how often a draft is kept with sum(min(p, q)).
    """
    raise NotImplementedError


def speculative_with_cache(model, prompt_ids, draft, k, max_new_tokens):
    """Exercise 4: Verify with a KV cache

    The notebook's hand loop, but with a KV cache: greedy draft-and-verify where the target never recomputes
    a token it has already seen.

    - Make a cache: `cache = make_cache("static", model, 1, max_len)` with max_len large enough for the
      prompt, the new tokens and one round's draft.
    - Prefill: `model(tokens [1, P], positions [1, P], cache=cache)`; the argmax of the last position is
      the first new token.
    - Each round: `drafted = draft(sequence, n)` (a function returning up to n guessed ids; ask for at most
      k, and never more than the tokens still allowed minus one); one forward over [newest token, *drafted]
      at positions len(sequence) - 1, len(sequence), ...; accept the drafted prefix that equals the
      target's argmax, plus the target's own next token; then `cache.crop(...)` so the cache holds exactly
      the kept tokens except the newest one.

    Returns the max_new_tokens generated ids (no EOS handling needed): exactly plain greedy's.
    """
    raise NotImplementedError
