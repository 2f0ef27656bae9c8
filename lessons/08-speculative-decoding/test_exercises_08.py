"""Checks for lesson 08's exercises: `pytest lessons/08-speculative-decoding` (yours) or `--solutions`.

References: plain greedy decoding (`minillm.strategies.generate.generate`) token for token, a brute-force bigram table,
the schedule's rule recomputed from the rounds, and exact probability arithmetic for the sampling rule.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from minillm.model.tiny import tiny_pair
from minillm.strategies.drafters import PromptLookup
from minillm.strategies.generate import generate
from minillm.strategies.speculative import speculative_generate

PROMPT = [5, 17, 3, 42, 8, 5, 17, 3, 9, 61, 5, 17]  # repeats, so copying drafters find matches


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request):
    return tiny_pair(request.param, seed=0)[1]


def plain_greedy(model, prompt, n):
    return generate(model, prompt, max_new_tokens=n, eos_token_id=()).rows[0].token_ids


def brute_force_bigram_draft(sequence, n):
    """Scan backwards for the latest pair (t, next) each time: no table, no cleverness."""
    out, last = [], sequence[-1]
    for _ in range(n):
        followers = [sequence[i + 1] for i in range(len(sequence) - 1) if sequence[i] == last]
        if not followers:
            break
        last = followers[-1]
        out.append(last)
    return out


# ------------------------------------------------------------------ Exercise 1


def test_exercise_1_bigram_drafter_proposes_the_bigram_chain(answers):
    drafter = answers.bigram_drafter()
    assert drafter.propose([1, 2, 3, 1, 2], 4, None, None, None).tokens == [3, 1, 2, 3]
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        sequence = torch.randint(0, 6, (int(torch.randint(1, 25, (), generator=gen)),), generator=gen).tolist()
        n = trial % 9
        got = drafter.propose(sequence, n, None, None, None)
        assert list(got.tokens) == brute_force_bigram_draft(sequence, n), (sequence, n)


def test_exercise_1_bigram_drafter_gives_plain_greedy(answers, tiny):
    plain = plain_greedy(tiny, PROMPT, 40)
    drafted = accepted = 0
    for k in (1, 3, 8):
        out = speculative_generate(tiny, PROMPT, answers.bigram_drafter(), num_draft_tokens=k, max_new_tokens=40,
                                   eos_token_id=())
        assert out.rows[0].token_ids == plain, f"k={k}"
        drafted, accepted = drafted + out.stats.extra["drafted"], accepted + out.stats.extra["accepted"]
    assert drafted > 0 and accepted > 0  # greedy on a tiny model loops, so the bigrams it repeats are accepted


# ------------------------------------------------------------------ Exercise 2


def test_exercise_2_adaptive_draft_length(answers, tiny):
    plain = plain_greedy(tiny, PROMPT, 48)
    for drafter, k_start, k_max in ((PromptLookup(), 4, 16), (PromptLookup(max_ngram=1), 2, 5)):
        tokens, schedule = answers.adaptive_speculative(tiny, PROMPT, drafter, 48, k_start=k_start, k_max=k_max)
        assert list(tokens) == plain
        assert schedule and schedule[0][0] == k_start
        for (k, r), (next_k, _) in zip(schedule, schedule[1:]):
            assert len(r.drafted) <= k
            assert next_k == (min(k_max, k + 2) if r.accepted == k else max(1, k - 1)), [s[0] for s in schedule]
        assert len({k for k, _ in schedule}) > 1  # the schedule moved


# ------------------------------------------------------------------ Exercise 3


def test_exercise_3_sampling_rule_emits_p(answers):
    gen = torch.Generator().manual_seed(0)
    cases = [
        (torch.tensor([0.05, 0.40, 0.30, 0.15, 0.10]), torch.tensor([0.30, 0.10, 0.35, 0.00, 0.25])),
        (torch.tensor([0.70, 0.20, 0.10, 0.00]), torch.tensor([0.00, 0.00, 0.00, 1.00])),  # one-hot q, p(x) = 0
        (torch.tensor([0.25, 0.25, 0.50]), torch.tensor([0.25, 0.25, 0.50])),  # q = p: every draft kept
    ]
    draws = 6000
    for p, q in cases:
        p, q = p.double(), q.double()
        counts, kept = torch.zeros(len(p), dtype=torch.float64), 0
        drafts = torch.multinomial(q, draws, replacement=True, generator=gen).tolist()
        for x in drafts:
            token, ok = answers.verify_sampled(p, q, x, gen)
            assert not ok or int(token) == x, "a kept draft must be the drafted token"
            counts[int(token)] += 1
            kept += bool(ok)
        assert counts[p == 0].sum() == 0, "emitted a token the target gives probability 0"
        support = p > 0
        expected = p[support] / p[support].sum() * counts.sum()
        assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3, (p, q, counts)
        keep_rate = float(torch.minimum(p, q).sum())  # P(keep) = sum_x q(x) min(1, p(x)/q(x))
        assert abs(kept / draws - keep_rate) < 4 * (keep_rate * (1 - keep_rate) / draws) ** 0.5 + 1e-9, kept / draws


# ------------------------------------------------------------------ Exercise 4


class CountingModel:
    """The model, recording the number of tokens of each call and whether a cache came with it."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, positions, cache=None, **kwargs):
        self.calls.append((tokens.shape[1], cache is not None))
        return self.model(tokens, positions, cache=cache, **kwargs)


def test_exercise_4_verify_with_a_kv_cache(answers, tiny):
    n = 40
    plain = plain_greedy(tiny, PROMPT, n)
    vocab = tiny.config.vocab_size
    drafts = {
        "prompt lookup": lambda seq, m: PromptLookup().propose(seq, m, None, None, None).tokens,
        "oracle": lambda seq, m: (PROMPT + plain)[len(seq):len(seq) + m],  # always right: long accepted runs
        "noise": lambda seq, m: [(seq[-1] * 7 + i) % vocab for i in range(m)],  # almost always wrong
    }
    for name, draft in drafts.items():
        for k in (1, 4, 8):
            counting = CountingModel(tiny)
            assert list(answers.speculative_with_cache(counting, PROMPT, draft, k, n)) == plain, f"{name}, k={k}"
            assert counting.calls[0][0] == len(PROMPT), "prefill the prompt in one forward"
            assert all(with_cache for _, with_cache in counting.calls), "pass the cache to every forward"
            assert all(t <= k + 1 for t, _ in counting.calls[1:]), "a round feeds only the newest token and the draft"
            if name == "oracle":
                assert len(counting.calls) <= 1 + -(-(n - 1) // (k + 1)), "accept whole drafts"
