"""Checks for lesson 11's exercises: `pytest lessons/11-lookahead` (yours) or `--solutions`.

References: brute-force walks over the tree, the package's tree mask (`Tree.from_parents`, `new_token_mask`),
plain forwards over each node's path on a tiny model, plain greedy decoding token for token, the package's
`SpeculativeDecoder` round for round, and `NGramTrie.prune` on random texts.
"""

from __future__ import annotations

import random

import pytest
import torch

from minillm.cache.kinds import make_cache
from minillm.decoding.sampling import SamplingConfig
from minillm.model.tiny import tiny_pair
from minillm.runtime.session import DecodeSession, Tree, new_token_mask
from minillm.strategies.drafters import Draft
from minillm.strategies.generate import generate
from minillm.strategies.lookahead import Lookahead
from minillm.strategies.ngram_trie import NGramTrie
from minillm.strategies.speculative import SpeculativeDecoder, speculative_generate

PROMPT = [5, 9, 14, 3, 27, 9, 14, 3, 8, 5, 9, 14]  # repeats, so copying drafters find branches


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair("llama", seed=0)[1]


def plain_greedy(model, prompt, n):
    return generate(model, prompt, max_new_tokens=n, eos_token_id=()).rows[0].token_ids


def random_parents(rng: random.Random, T: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, T)]


def path_of(node: int, tokens, parents) -> list[int]:
    """The tokens from the root to `node`, both included."""
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


def ancestors_and_self(node, parents):
    found = []
    while node >= 0:
        found.append(node)
        node = parents[node]
    return found


# ------------------------------------------------------------------ Exercise 1


def brute_force_mask(parents, P):
    """Walk up from every node: it sees the prefix, itself and each node met on the way to the root."""
    T = len(parents)
    rows, positions = [], []
    for i in range(T):
        met = ancestors_and_self(i, parents)
        rows.append([True] * P + [k in met for k in range(T)])
        positions.append(P + len(met) - 1)  # depth = nodes above it
    return torch.tensor(rows, dtype=torch.bool), torch.tensor(positions)


def test_exercise_1_mask_and_positions_by_walking_the_tree(answers):
    mask, positions = answers.tree_attention_mask([-1, 0, 1, 1], 2)
    assert ["".join(str(int(v)) for v in row) for row in mask] == ["111000", "111100", "111110", "111101"]
    assert positions.tolist() == [2, 3, 4, 4]
    rng = random.Random(0)
    for trial in range(60):
        T, P = rng.randint(1, 12), rng.randint(0, 6)
        parents = random_parents(rng, T)
        mask, positions = answers.tree_attention_mask(parents, P)
        expected_mask, expected_positions = brute_force_mask(parents, P)
        assert mask.dtype == torch.bool and mask.shape == (T, P + T), (parents, P, mask.shape)
        assert torch.equal(mask, expected_mask), (parents, P)
        assert torch.as_tensor(positions).tolist() == expected_positions.tolist(), (parents, P)
        package = Tree.from_parents(parents)
        assert torch.equal(mask, new_token_mask(torch.tensor([P]), package.mask, P + T)[0])
        assert torch.as_tensor(positions).tolist() == (P + package.depth).tolist()
    with pytest.raises(ValueError):
        answers.tree_attention_mask([-1, 2, 0], 3)


@torch.inference_mode()
def test_exercise_1_one_tree_forward_equals_a_forward_per_path(answers, tiny):
    prefix = [3, 17, 4, 9, 22, 40]
    tokens = [9, 5, 6, 7, 5, 8, 1, 2]
    rng = random.Random(1)
    for parents in ([-1, 0, 0, 1, 1, 2, 4, 6], random_parents(rng, 8), random_parents(rng, 8)):
        mask, positions = answers.tree_attention_mask(parents, len(prefix))
        cache = make_cache("dynamic", tiny, 1, len(prefix) + len(tokens))
        tiny(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache=cache)
        logits = tiny(torch.tensor([tokens]), torch.as_tensor(positions)[None], cache=cache, mask=mask[None])[0]
        for node in range(len(tokens)):
            sequence = prefix + path_of(node, tokens, parents)
            reference = tiny(torch.tensor([sequence]), torch.arange(len(sequence))[None])[0, -1]
            torch.testing.assert_close(logits[node], reference, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"parents {parents}, node {node}: {m}")


@torch.inference_mode()
def test_exercise_1_predicted_breaks(answers, tiny):
    prefix, tokens, parents = [3, 17, 4, 9, 22, 40], [9, 5, 6, 7, 5, 8], [-1, 0, 1, 1, 0, 4]
    P, T = len(prefix), len(tokens)
    tree = Tree.from_parents(parents)
    tree_mask, tree_positions = new_token_mask(torch.tensor([P]), tree.mask, P + T)[0], P + tree.depth
    causal = torch.ones(T, P + T, dtype=torch.bool).tril(P)  # node i: the prefix and nodes 0..i
    cases = {"causal mask": (causal, tree_positions), "positions by index": (tree_mask, P + torch.arange(T))}
    truth = {}
    for case, (mask, positions) in cases.items():
        cache = make_cache("dynamic", tiny, 1, P + T)
        tiny(torch.tensor([prefix]), torch.arange(P)[None], cache=cache)
        logits = tiny(torch.tensor([tokens]), positions[None], cache=cache, mask=mask[None])[0]
        truth[case] = []
        for node in range(T):
            sequence = prefix + path_of(node, tokens, parents)
            reference = tiny(torch.tensor([sequence]), torch.arange(len(sequence))[None])[0, -1]
            if torch.allclose(logits[node], reference, rtol=1e-5, atol=1e-5):
                truth[case].append(node)
    predicted = answers.predicted_exact_nodes()
    assert set(predicted) == set(truth), f"predict exactly these cases: {sorted(truth)}"
    wrong = {case: (sorted(predicted[case]), truth[case]) for case in truth if sorted(predicted[case]) != truth[case]}
    assert not wrong, "predicted vs measured exact nodes: " + "; ".join(
        f"{case}: {p} vs {t}" for case, (p, t) in wrong.items())


# ------------------------------------------------------------------ Exercise 2


def brute_force_branches(sequence, n, depth) -> set[tuple]:
    """Every candidate scored by brute force, continuations merged as sets of paths."""
    last = len(sequence) - 1
    scored = []
    for i in range(last):
        match = 0
        for j in range(3):
            if i - j < 0 or sequence[i - j] != sequence[last - j]:
                break
            match += 1
        if match:
            scored.append((match, i))
    scored.sort(key=lambda item: (-item[0], -item[1]))
    paths: set[tuple] = set()
    for _, i in scored:
        continuation = sequence[i + 1:i + 1 + depth]
        for j in range(1, len(continuation) + 1):
            if tuple(continuation[:j]) not in paths:
                if len(paths) == n:
                    return paths
                paths.add(tuple(continuation[:j]))
    return paths


def paths_of(draft: Draft) -> set[tuple]:
    """A draft's tree as the set of its root-to-node token paths (root excluded); checks its shape."""
    tokens, parents = list(draft.tokens), list(draft.parents if draft.parents is not None else [])
    assert len(parents) == len(tokens), "give one parent per drafted token"
    found = {0: ()}
    for i, (token, parent) in enumerate(zip(tokens, parents), start=1):
        assert 0 <= parent < i, f"node {i} has parent {parent}: parents come before their children"
        found[i] = found[parent] + (token,)
    paths = set(found.values()) - {()}
    assert len(paths) == len(tokens), "two siblings hold the same token: merge shared prefixes"
    return paths


def test_exercise_2_branches_match_a_brute_force_scan(answers):
    draft = answers.branches_from_prompt([7, 1, 2, 3, 9, 1, 2, 4, 1], 6, 3)
    assert paths_of(draft) == {(2,), (2, 4), (2, 4, 1), (2, 3), (2, 3, 9)}
    assert paths_of(answers.branches_from_prompt([7, 1, 2, 3, 9, 1, 2, 4, 1], 3, 3)) == {(2,), (2, 4), (2, 4, 1)}
    # the longer match (5 1) beats the more recent one (8 1)
    assert paths_of(answers.branches_from_prompt([5, 1, 2, 9, 8, 1, 3, 5, 1], 3, 3)) == {(2,), (2, 9), (2, 9, 8)}
    assert paths_of(answers.branches_from_prompt([1, 2, 3], 4, 3)) == set()
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        sequence = torch.randint(0, 5, (int(torch.randint(1, 30, (), generator=gen)),), generator=gen).tolist()
        n, depth = trial % 11, 1 + trial % 5
        draft = answers.branches_from_prompt(sequence, n, depth)
        assert len(draft.tokens) <= n, (sequence, n, depth)
        assert paths_of(draft) == brute_force_branches(sequence, n, depth), (sequence, n, depth)


class BranchDrafter:
    """Your function as a drafter for `speculative_generate`; records whether any draft branched."""

    def __init__(self, function, depth):
        self.function, self.depth, self.branched = function, depth, False

    def begin(self, target, tokenizer, max_len):
        pass

    def propose(self, sequence, n, config, history, generator):
        draft = self.function(sequence, n, self.depth)
        self.branched |= len(set(draft.parents or [])) < len(draft.parents or [])  # a node with two children
        return draft

    def rollback(self, sequence):
        pass


def test_exercise_2_branch_drafter_gives_plain_greedy(answers, tiny):
    plain = plain_greedy(tiny, PROMPT, 40)
    accepted = 0
    for k, depth in ((4, 2), (8, 4), (16, 6)):
        drafter = BranchDrafter(answers.branches_from_prompt, depth)
        out = speculative_generate(tiny, PROMPT, drafter, num_draft_tokens=k, max_new_tokens=40, eos_token_id=())
        assert out.rows[0].token_ids == plain, f"k={k}, depth={depth}"
        assert drafter.branched, "no draft had two branches: merge every earlier occurrence's continuation"
        accepted += out.stats.extra["accepted"]
    assert accepted > 0


# ------------------------------------------------------------------ Exercise 3


def brute_force_verify(logits, tokens, parents):
    """The deepest node whose every drafted token equals the argmax after its parent's path."""
    best = logits.argmax(-1).tolist()
    accepted = [node for node in range(len(tokens))
                if all(tokens[a] == best[parents[a]] for a in ancestors_and_self(node, parents) if a > 0)]
    deepest = max(accepted, key=lambda node: len(ancestors_and_self(node, parents)))
    path = sorted(ancestors_and_self(deepest, parents))
    return path, [best[node] for node in path]


def test_exercise_3_verify_matches_a_brute_force_search(answers):
    path, emitted = answers.verify_tree_greedy(torch.eye(10)[[8, 0, 9, 4]], [5, 7, 8, 9], [-1, 0, 0, 2])
    assert list(path) == [0, 2, 3] and list(emitted) == [8, 9, 4]
    rng = random.Random(0)
    deep = 0
    for trial in range(300):
        T, V = rng.randint(1, 14), 16
        parents = random_parents(rng, T)
        tokens = [rng.randrange(V)]
        for i in range(1, T):  # siblings hold distinct tokens, as in a merged draft
            taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
            tokens.append(rng.choice([t for t in range(V) if t not in taken]))
        logits = torch.randn(T, V, generator=torch.Generator().manual_seed(trial))
        for node in range(T):  # mostly agree with one of the children, so paths run deep
            kids = [c for c in range(1, T) if parents[c] == node]
            if kids and rng.random() < 0.75:
                logits[node, tokens[rng.choice(kids)]] += 10
        path, emitted = answers.verify_tree_greedy(logits, tokens, parents)
        assert (list(path), [int(t) for t in emitted]) == brute_force_verify(logits, tokens, parents), \
            (tokens, parents, logits.argmax(-1).tolist())
        deep += len(path) > 2
    assert deep > 30


def warmed_lookahead(model, prompt, n):
    """A Lookahead whose memory holds the plain continuation and corrupted copies of it: long accepted
    paths, rejected siblings."""
    plain = plain_greedy(model, prompt, n)
    lookahead = Lookahead(decoding_length=12, branch_length=5)
    gen = torch.Generator().manual_seed(1)
    texts = [prompt + plain]
    for _ in range(3):
        text = list(texts[0])
        for i in torch.randint(len(prompt), len(text), (4,), generator=gen).tolist():
            text[i] = (text[i] + 1) % model.config.vocab_size
        texts.append(text)
    lookahead.warm(texts)
    return lookahead, plain


@torch.inference_mode()
def decode_with(verify, model, prompt, lookahead, max_new_tokens, budget=12):
    """Lookahead decoding written out: draft a tree, one tree forward, `verify` picks the path, keep it."""
    session = DecodeSession(model, "static", len(prompt) + max_new_tokens)
    sequence = list(prompt) + [int(session.prefill([prompt])[0].argmax())]
    lookahead.begin(model, None, len(prompt) + max_new_tokens)
    rounds = []
    while len(sequence) - len(prompt) < max_new_tokens:
        room = max_new_tokens - (len(sequence) - len(prompt))
        most = min(budget, room - 1)  # a copy may draft past the budget: cut it, as the decoder does
        draft = lookahead.propose(sequence, most, None, None, None).first(most)
        tokens, parents = [sequence[-1], *draft.tokens], [-1, *draft.parents]
        before = len(sequence) - 1  # the session holds every token but the newest (the root)
        logits = session.extend([tokens], Tree.from_parents(parents))[0]  # [T, V]
        path, emitted = verify(logits, tokens, parents)
        emitted = [int(t) for t in emitted][:room]
        sequence += emitted
        session.keep_positions(0, list(range(before)) + [before + node for node in list(path)[:len(emitted)]])
        rounds.append(emitted)
    return sequence[len(prompt):], rounds


def test_exercise_3_decoding_with_your_rule_gives_plain_greedy(answers, tiny):
    n = 40
    lookahead, plain = warmed_lookahead(tiny, PROMPT, n)
    tokens, rounds = decode_with(answers.verify_tree_greedy, tiny, PROMPT, lookahead, n)
    assert tokens == plain
    assert max(map(len, rounds)) >= 3 and len(rounds) < n - 1, "drafts were accepted"
    package, _ = warmed_lookahead(tiny, PROMPT, n)
    decoder = SpeculativeDecoder(tiny, package, PROMPT, SamplingConfig(max_new_tokens=n, eos_token_id=()),
                                 num_draft_tokens=12, adaptive=False)  # decode_with's fixed budget
    decoder.prefill()
    package_rounds = []
    while not decoder.finished:
        package_rounds.append(decoder.round().emitted)
    assert rounds == package_rounds


# ------------------------------------------------------------------ Exercise 4


def ngram_counts(texts, depth):
    counts = {}
    for text in texts:
        for start in range(len(text)):
            for size in range(1, min(depth, len(text) - start) + 1):
                gram = tuple(text[start:start + size])
                counts[gram] = counts.get(gram, 0) + 1
    return counts


def kept_by_the_trie(texts, depth, budget):
    trie = NGramTrie(depth, node_budget=budget)
    for text in texts:
        trie.add_text(text)
    trie.prune()
    return {path: node.count for path, node in trie.walk()}


def test_exercise_4_prune_keeps_what_the_trie_keeps(answers):
    texts = [[1, 2, 3]] * 4 + [[8, 9]]
    assert answers.prune_to_budget(ngram_counts(texts, 3), 4) == {(1,): 4, (2,): 4, (3,): 4, (1, 2): 4}
    rng = random.Random(0)
    for trial in range(80):
        texts = [[rng.randrange(6) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(1, 6))]
        depth, budget = rng.randint(2, 5), rng.randint(1, 60)
        counts = ngram_counts(texts, depth)
        kept = answers.prune_to_budget(dict(counts), budget)
        assert len(kept) == min(budget, len(counts)), (texts, depth, budget)
        assert all(gram[:-1] in kept for gram in kept if len(gram) > 1), "the kept n-grams must form a trie"
        assert kept == kept_by_the_trie(texts, depth, budget), (texts, depth, budget)
