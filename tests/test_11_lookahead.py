"""Lesson 11: lookahead decoding. The trie against hand-counted n-grams, the tree forward against
sequential forwards, and the whole loop against plain decoding, token for token."""

from __future__ import annotations

import pytest
import torch
from test_08_speculative_decoding import OracleDrafter

from minillm.decoding.sampling import SamplingConfig
from minillm.model.tiny import tiny_pair
from minillm.runtime.session import DecodeSession, Tree
from minillm.strategies.drafters import Draft, PromptLookup, latest_earlier_occurrence
from minillm.strategies.generate import generate
from minillm.strategies.lookahead import CopyPointer, DraftTree, Lookahead, context_first, share_draft
from minillm.strategies.ngram_trie import NGramTrie, likeliest_paths
from minillm.strategies.speculative import SpeculativeDecoder, speculative_generate

TINY_PROMPT = [5, 9, 14, 3, 27, 9, 14, 3, 8]


# --- The trie. ----------------------------------------------------------------------------------------------------

def ngram_counts(texts, depth):
    """Brute force: every n-gram (n <= depth) of every text, counted."""
    counts = {}
    for text in texts:
        for start in range(len(text)):
            for n in range(1, depth + 1):
                if start + n <= len(text):
                    gram = tuple(text[start:start + n])
                    counts[gram] = counts.get(gram, 0) + 1
    return counts


def trie_counts(trie):
    found, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            found[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return found


def test_trie_counts_every_ngram_whole_or_in_pieces():
    texts = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3, 2, 3, 2], [7]]
    whole = NGramTrie(depth=3)
    for text in texts:
        whole.add_text(text)
    assert trie_counts(whole) == ngram_counts(texts, 3) and whole.nodes == len(ngram_counts(texts, 3))
    pieces = NGramTrie(depth=3)
    for text in texts:
        for i in range(0, len(text), 2):
            pieces.extend(text[i:i + 2])
        pieces.end_text()
    assert trie_counts(pieces) == trie_counts(whole)


def test_the_issue_example_tree_and_mask():
    """After [1, 2, 3] and [1, 2, 4], a context ending in 1 drafts 1 -> 2 -> {3, 4}."""
    trie = NGramTrie(depth=4)
    trie.add_text([1, 2, 3])
    trie.add_text([1, 2, 4])
    tree = DraftTree.from_paths(1, [path for path, _ in trie.continuations([9, 1], 8, 4, max_match=1)])
    assert tree.tokens == [1, 2, 3, 4] and tree.parents == [-1, 0, 1, 1]
    rows = ["".join(str(int(v)) for v in row) for row in Tree.from_parents(tree.parents).mask]
    assert rows == ["1000", "1100", "1110", "1101"]


def test_retrieval_is_most_likely_first_and_respects_the_limits():
    trie = NGramTrie(depth=4)
    for text in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5]):
        trie.add_text(text)
    paths = trie.continuations([1], max_nodes=10, max_depth=3, max_match=1)
    # p(2 | 1) = 3/4, p(5 | 1) = 1/4, p(2, 3 | 1) = 3/4 * 2/3, p(2, 4 | 1) = 3/4 * 1/3
    assert paths == [((2,), 0.75), ((2, 3), 0.5), ((5,), 0.25), ((2, 4), 0.25)]
    assert [p for p, _ in trie.continuations([1], max_nodes=2, max_depth=3, max_match=1)] == [(2,), (2, 3)]
    assert {p for p, _ in trie.continuations([1], max_nodes=10, max_depth=1, max_match=1)} == {(2,), (5,)}


def test_retrieval_prefers_the_longest_suffix_and_falls_back():
    trie = NGramTrie(depth=5)
    trie.add_text([7, 1, 2, 3, 4])  # after "7 1": 2 3 4
    trie.add_text([1, 9, 9, 9])     # after "1": also 9 9 9
    long_match = trie.continuations([7, 1], max_nodes=3, max_depth=3, max_match=2)
    assert [p for p, _ in long_match] == [(2,), (2, 3), (2, 3, 4)]
    # "8 1" is unseen: fall back to "1", which offers both branches
    short = trie.continuations([8, 1], max_nodes=6, max_depth=3, max_match=2)
    assert {p for p, _ in short} == {(2,), (2, 3), (2, 3, 4), (9,), (9, 9), (9, 9, 9)}
    assert trie.continuations([8, 6], 4, 3, 2) == []
    # a long match yielding too little falls back to a shorter one yielding more
    sparse = NGramTrie(depth=4)
    sparse.add_text([5, 1, 2])
    sparse.add_text([1, 3, 4, 6])
    assert {p for p, _ in sparse.continuations([5, 1], 3, 3, 2)} == {(2,), (3,), (3, 4)}


def test_pruning_keeps_what_recurs_within_the_budget():
    trie = NGramTrie(depth=3, node_budget=4)
    for _ in range(4):
        trie.add_text([1, 2, 3])
    trie.add_text([8, 9])
    assert trie.nodes > 4
    trie.prune()
    counts = trie_counts(trie)
    assert trie.nodes == len(counts) == 4
    assert set(counts) == {(1,), (2,), (3,), (1, 2)}  # most frequent, then shortest, then first


def test_share_draft_gives_both_sources_a_share():
    context = [((1,), 0.9), ((1, 2), 0.8), ((1, 2, 3), 0.7), ((4,), 0.1)]
    memory = [((5,), 0.9), ((1,), 0.5), ((5, 6), 0.4)]
    # the best path of each, then the likeliest of the rest: (1, 2) 0.8, (1, 2, 3) 0.7
    assert share_draft(context, memory, 4) == [(1,), (5,), (1, 2), (1, 2, 3)]
    # 8: then (1,) again (counted once), (5, 6) 0.4, (4,) 0.1: every path either source offers
    assert share_draft(context, memory, 8) == [(1,), (5,), (1, 2), (1, 2, 3), (5, 6), (4,)]
    assert share_draft(context, [], 3) == [(1,), (1, 2), (1, 2, 3)]
    assert share_draft([], memory, 2) == [(5,), (1,)]
    assert share_draft(context, memory, 1) == [(1,)]


def test_context_first_fills_from_the_memory_only_after_the_context():
    context = [((1,), 0.3), ((1, 2), 0.3), ((4,), 0.1)]
    memory = [((5,), 0.9), ((1,), 0.5), ((5, 6), 0.4)]
    assert context_first(context, memory, 2) == [(1,), (1, 2)]
    assert context_first(context, memory, 5) == [(1,), (1, 2), (4,), (5,), (5, 6)]
    assert context_first([], memory, 2) == [(5,), (1,)]


def test_a_copy_drafts_a_whole_branch_whatever_the_budget():
    lookahead = Lookahead(decoding_length=16, branch_length=4, max_match=2)
    lookahead.begin(None, None, 64)
    config, history = SamplingConfig(), None
    copying = [5, 6, 7, 8, 9, 10, 11, 5, 6]  # "5 6" occurred before, followed by 7 8 9 10 ...
    assert lookahead.propose(copying, 1, config, history, None).tokens == [7, 8, 9, 10]
    assert lookahead.pointer.copying
    lookahead.begin(None, None, 64)
    fresh = [5, 6, 7, 8, 9, 10, 11, 4, 6]  # only "6" occurred before: a weak match keeps the budget
    assert lookahead.propose(fresh, 1, config, history, None).tokens == [7]
    assert not lookahead.pointer.copying and not lookahead.pointer.resuming


def test_the_copy_pointer_follows_a_copy_through_its_edits():
    passage = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    pointer = CopyPointer(max_match=3)
    sequence = passage + [10, 11, 12]  # the output starts copying the passage
    pointer.follow(sequence, 0)
    assert pointer.copying and pointer.source == 3
    sequence += [13, 99]  # copies 13, then writes 99 in place of 14, 15 (an edit)
    pointer.follow(sequence, len(sequence) - 2)
    assert pointer.resuming and (pointer.source, pointer.edit) == (4, 1)
    # the copy may go on at 14, 15, 16 or 17 (the edit replaced 0 to 3 tokens): a tree of 5 nodes over
    # them, the first place (no text to rank them by) two deep, the others one token each
    assert pointer.paths(sequence, 5) == [(14,), (14, 15), (15,), (16,), (17,)]
    sequence += [16, 17]  # it went on at 16: the edit replaced two tokens, and copying resumes
    pointer.follow(sequence, len(sequence) - 2)
    assert pointer.copying and pointer.source == 8
    assert pointer.paths(sequence, 4) == [(18,), (18, 19), (18, 19, 10), (18, 19, 10, 11)]
    sequence += [98, 97, 96, 95, 94, 93]  # an edit longer than max_edit: the copy is over, whatever follows
    pointer.follow(sequence, len(sequence) - 6)
    assert pointer.source is None and pointer.paths(sequence, 4) == []


def test_a_copy_that_starts_inside_a_round_is_followed_from_there():
    """The tokens a round accepts may start a copy and then edit it: the pointer restarts at each new
    token, so it is resuming after the edit (a restart at the round's end alone finds no copy)."""
    passage = [10, 11, 12, 13, 14, 15, 16]
    pointer = CopyPointer(max_match=3)
    sequence = passage + [50]
    pointer.follow(sequence, 0)
    assert pointer.source is None
    sequence += [10, 11, 12, 13, 99]  # one round: a copy of 10 11 12 13, then an edit
    pointer.follow(sequence, len(sequence) - 5)
    assert pointer.resuming and (pointer.source, pointer.edit) == (4, 1)
    assert latest_earlier_occurrence(sequence, 3, end=len(sequence) - 1) == 1  # 11 12 13, before the end


def test_the_copy_pointer_ranks_the_places_by_how_alike_the_edit_is_to_the_text_it_skips():
    """passage "... was b ilt in 1871", output "... was built": " built" is most like " bilt", the
    two tokens it replaced, so the copy most likely goes on at " in" (2 tokens past " b")."""
    words = {1: " The", 2: " tower", 3: " was", 4: " b", 5: "ilt", 6: " in", 7: " 1871", 8: " built"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    passage = [1, 2, 3, 4, 5, 6, 7]
    pointer = CopyPointer(max_match=3, decode=decode)
    sequence = passage + [1, 2, 3]
    pointer.follow(sequence, 0)
    sequence += [8]
    pointer.follow(sequence, len(sequence) - 1)
    assert pointer.resuming and pointer.places(sequence) == [2, 3, 1, 0]
    assert pointer.paths(sequence, 5) == [(6,), (6, 7), (7,), (5,), (4,)]
    assert CopyPointer(max_match=3).places(sequence) == [0, 1, 2, 3]  # without text: in order


def test_after_an_edit_the_places_the_copy_may_go_on_at_lead_the_draft():
    lookahead = Lookahead(decoding_length=16, branch_length=6, max_match=3)
    lookahead.begin(None, None, 64)
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    copy = lookahead.propose(passage + [10, 11, 12], 16, SamplingConfig(), None, None)
    assert copy.tokens == [13, 14, 15, 16, 17, 10]
    # budget 1, yet branch_length nodes: half of them the pointer's tree over the places the copy may go on
    # at (the likeliest, 14, first: three tokens deep), the other half the context trie's guesses after 99
    lookahead.context.add_text([99, 30, 31, 32, 33])
    draft = lookahead.propose(passage + [10, 11, 12, 13, 99], 1, SamplingConfig(), None, None)
    assert draft.tokens == [14, 30, 15, 31, 16, 32] and draft.parents == [0, 0, 1, 2, 3, 4]
    assert lookahead.pointer.paths(passage + [10, 11, 12, 13, 99], 6) == [(14,), (14, 15), (14, 15, 16), (15,),
                                                                          (16,), (17,)]


def test_a_draft_cut_to_its_first_nodes_is_still_a_tree():
    tree = Draft([7, 8, 9, 10], parents=[0, 0, 1, 3])
    assert tree.first(3) == Draft([7, 8, 9], parents=[0, 0, 1])
    assert tree.first(9) is tree
    chain = Draft([1, 2, 3], q=torch.eye(3))
    assert chain.first(2).tokens == [1, 2] and torch.equal(chain.first(2).q, torch.eye(3)[:2])


def test_likeliest_paths_are_ancestor_closed():
    trie = NGramTrie(depth=6)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        trie.add_text(torch.randint(0, 4, (12,), generator=generator).tolist())
    for budget in (1, 3, 7, 15):
        paths = [p for p, _ in likeliest_paths(trie.root.children[0], budget, 4)]
        assert len(paths) == budget and all(p[:-1] in paths or len(p) == 1 for p in paths)


# --- The tree forward. -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_tree_forward_equals_sequential_forward_at_every_node(tiny, cache):
    _, model = tiny
    prefix = [3, 17, 4, 9, 22]
    tree = DraftTree(tokens=[9, 5, 6, 7, 5, 8, 1], parents=[-1, 0, 0, 1, 1, 2, 4])  # depths 0..3, shared prefixes
    session = DecodeSession(model, cache, max_len=32)
    session.prefill([prefix[:-1]])
    logits = session.extend([tree.tokens], Tree.from_parents(tree.parents))[0]  # [T, V]
    for node in range(len(tree.tokens)):
        path, i = [], node
        while i >= 0:
            path.insert(0, tree.tokens[i])
            i = tree.parents[i]
        reference = model(torch.tensor([prefix[:-1] + path]), torch.arange(len(prefix) - 1 + len(path))[None])
        torch.testing.assert_close(logits[node], reference[0, -1], rtol=1e-5, atol=1e-5)


# --- The decoding loop. ------------------------------------------------------------------------------------------------

def warmed(model, prompt, max_new_tokens, config=None, noise: int = 3):
    """A Lookahead whose memory holds the plain continuation and `noise` corrupted copies of it,
    so that rounds accept long paths, reject branches and choose among siblings."""
    plain = generate(model, prompt, config or SamplingConfig(max_new_tokens=max_new_tokens)).rows[0].token_ids
    lookahead = Lookahead(decoding_length=12, branch_length=5)
    generator = torch.Generator().manual_seed(1)
    texts = [prompt + plain]
    for _ in range(noise):
        text = list(texts[0])
        for i in torch.randint(len(prompt), len(text), (4,), generator=generator).tolist():
            text[i] = (text[i] + 1) % model.config.vocab_size
        texts.append(text)
    lookahead.warm(texts)
    return lookahead, plain


def test_greedy_lookahead_equals_plain_greedy(tiny):
    _, model = tiny
    lookahead, plain = warmed(model, TINY_PROMPT, 40, SamplingConfig(max_new_tokens=40, eos_token_id=()))
    out = speculative_generate(model, TINY_PROMPT, lookahead, num_draft_tokens=12, max_new_tokens=40,
                               eos_token_id=())
    assert out.rows[0].token_ids == plain
    assert out.stats.extra["tokens_per_target_forward"] > 2  # the memory made it draft, and pay
    cold = speculative_generate(model, TINY_PROMPT, Lookahead(), num_draft_tokens=16, max_new_tokens=40,
                                eos_token_id=(), adaptive=True)
    assert cold.rows[0].token_ids == plain


def test_the_decoder_cuts_a_longer_draft_to_what_the_output_may_still_take(tiny):
    _, model = tiny
    plain = generate(model, TINY_PROMPT, SamplingConfig(max_new_tokens=30, eos_token_id=())).rows[0].token_ids
    for max_new in (2, 5, 12):
        config = SamplingConfig(max_new_tokens=max_new, eos_token_id=())
        decoder = SpeculativeDecoder(model, OracleDrafter(TINY_PROMPT + plain, length=10), TINY_PROMPT, config, num_draft_tokens=4)
        decoder.prefill()
        drafted = [len(decoder.round().drafted) for _ in range(max_new) if not decoder.finished]
        assert drafted[0] == min(4, max_new - 2)  # the ceiling, or what max_new_tokens leaves
        assert decoder.state.token_ids == plain[:max_new]


def test_eos_inside_an_accepted_branch_stops_there(tiny):
    _, model = tiny
    lookahead, plain = warmed(model, TINY_PROMPT, 30, SamplingConfig(max_new_tokens=30, eos_token_id=()))
    eos = plain[12]
    first = plain.index(eos)
    out = speculative_generate(model, TINY_PROMPT, lookahead, num_draft_tokens=12, max_new_tokens=30,
                               eos_token_id=eos).rows[0]
    assert out.token_ids == plain[:first + 1] and out.finish_reason == "eos"


def cached_keys(cache, layer: int, length: int) -> torch.Tensor:
    keys = cache.k[layer] if hasattr(cache, "k") else cache.keys[layer]
    return keys[0, :, :length]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_after_each_round_the_cache_holds_exactly_the_accepted_sequence(tiny, cache):
    _, model = tiny
    lookahead, _ = warmed(model, TINY_PROMPT, 24, SamplingConfig(max_new_tokens=24, eos_token_id=()))
    decoder = SpeculativeDecoder(model, lookahead, TINY_PROMPT, SamplingConfig(max_new_tokens=24, eos_token_id=()),
                                 num_draft_tokens=12, cache=cache)
    decoder.prefill()
    rejected_siblings = 0
    while not decoder.finished:
        result = decoder.round()
        rejected_siblings += len(result.drafted) > result.accepted
        held = decoder.sequence[:-1]
        assert decoder.runner.held(decoder.seq) == held
        fresh = DecodeSession(model, cache, max_len=64)
        fresh.prefill([held])
        for layer in range(model.config.n_layer):
            torch.testing.assert_close(cached_keys(decoder.cache, layer, len(held)),
                                       cached_keys(fresh.cache, layer, len(held)), rtol=1e-5, atol=1e-5)
    assert rejected_siblings > 0


def test_sampled_lookahead_draws_what_plain_sampling_draws(tiny):
    """The target chooses every emitted token itself, with plain sampling's random stream, so with one
    seed the two give the same tokens (in float64, where the tree and sequential forwards agree to
    far below any draw's margin): the output distribution is exactly the target's."""
    _, model = tiny
    model = model.double()
    for seed in range(12):
        config = SamplingConfig(max_new_tokens=20, do_sample=True, temperature=1.3, top_k=20, seed=seed,
                                eos_token_id=())
        lookahead, plain = warmed(model, TINY_PROMPT, 20, config)
        out = speculative_generate(model, TINY_PROMPT, lookahead, config, num_draft_tokens=12)
        assert out.rows[0].token_ids == plain, seed


def test_sampled_lookahead_matches_the_target_distribution_statistically():
    """The second token (the first one a tree round emits) over many seeds, against its exact
    marginal sum over t1 of p(t1) p(t2 | t1); the memory offers every t1 a branch of siblings."""
    _, model = tiny_pair("llama")
    config = SamplingConfig(max_new_tokens=4, do_sample=True, eos_token_id=())  # the first round drafts 2 nodes
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = model(torch.tensor([TINY_PROMPT]), torch.arange(len(TINY_PROMPT))[None])[0, -1].softmax(-1)  # [V]
        rows = torch.tensor([TINY_PROMPT + [t] for t in range(V)])  # [V, L + 1]
        p2 = model(rows, torch.arange(rows.shape[1]).expand_as(rows))[:, -1].softmax(-1)  # [V, V]: p(t2 | t1)
    marginal = p1 @ p2  # [V]
    lookahead = Lookahead(decoding_length=4, branch_length=2)
    lookahead.warm([[t, int(p2[t].argmax()), 1] for t in range(V)] + [[t, (t * 7) % V] for t in range(V)])
    target = int(marginal.argmax())
    n, hits, drafted = 500, 0, 0
    for seed in range(n):
        out = speculative_generate(model, TINY_PROMPT, lookahead, config.with_(seed=seed), num_draft_tokens=4,
                                   adaptive=False)  # a fixed budget: the first round drafts, whatever it matches
        hits += out.rows[0].token_ids[1] == target
        drafted += out.stats.extra["drafted"]
    assert drafted >= 2 * n  # every first round verified a real tree
    sigma = (marginal[target] * (1 - marginal[target]) / n).sqrt()
    assert abs(hits / n - marginal[target]) < 4 * sigma


def test_lengths_below_one_are_refused():
    with pytest.raises(ValueError, match="decoding_length=0 is invalid"):
        Lookahead(decoding_length=0)
    with pytest.raises(ValueError, match="branch_length=-1 is invalid"):
        Lookahead(branch_length=-1)
    with pytest.raises(ValueError, match="max_match=0 is invalid"):
        Lookahead(max_match=0)


def test_the_decoder_takes_lookahead_budget_and_adaptivity_from_the_drafter(tiny):
    """Left unset, the budget is the drafter's decoding length and it adapts; set, the caller's value wins."""
    model = tiny[1]
    decoder = SpeculativeDecoder(model, Lookahead(decoding_length=12), TINY_PROMPT, SamplingConfig(max_new_tokens=8))
    assert (decoder.k, decoder.budget, decoder.adaptive) == (12, 12, True)
    decoder = SpeculativeDecoder(model, Lookahead(decoding_length=12), TINY_PROMPT, SamplingConfig(max_new_tokens=8),
                                 num_draft_tokens=3, adaptive=False)
    assert (decoder.k, decoder.adaptive) == (3, False)


def test_greedy_lookahead_on_the_default_model(default_model):
    """A grounded prompt on the real model: the same tokens as plain greedy, in fewer forwards; a stop
    string inside an accepted branch ends the text exactly where plain decoding ends it."""
    model, tok = default_model
    passage = ("The lighthouse stood on a rock at the edge of the bay. Every night the keeper climbed the "
               "ninety steps, lit the lamp and wrote the weather in a book.")
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {passage}"}])
    plain = generate(model, prompt, tokenizer=tok, max_new_tokens=48)
    out = speculative_generate(model, prompt, Lookahead(), tokenizer=tok, num_draft_tokens=16, max_new_tokens=48,
                               adaptive=True)
    assert out.rows[0].token_ids == plain.rows[0].token_ids
    assert out.stats.extra["tokens_per_target_forward"] > 1.5
    stop = "ninety"
    plain_stop = generate(model, prompt, tokenizer=tok, max_new_tokens=48, stop=(stop,)).rows[0]
    out_stop = speculative_generate(model, prompt, Lookahead(), tokenizer=tok, num_draft_tokens=16,
                                    max_new_tokens=48, stop=(stop,)).rows[0]
    assert plain_stop.finish_reason == out_stop.finish_reason == "stop"
    assert out_stop.text == plain_stop.text and stop not in out_stop.text


class WrongDrafter:
    """Proposes, at each step, n copies of a token different from what greedy (`plain`) emits next."""

    def __init__(self, plain: list[int], vocab_size: int):
        self.plain, self.vocab_size = plain, vocab_size

    def begin(self, target, tokenizer, max_len):
        pass

    def propose(self, sequence, n, config, history, generator):
        return Draft([(self.plain[len(sequence) - len(TINY_PROMPT)] + 1) % self.vocab_size] * n)

    def rollback(self, sequence):
        pass


def drafted_per_round(model, drafter, n_new: int) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of TINY_PROMPT with `drafter`: (tokens drafted per round, the output)."""
    decoder = SpeculativeDecoder(model, drafter, TINY_PROMPT, SamplingConfig(max_new_tokens=n_new, eos_token_id=()),
                                 num_draft_tokens=8, adaptive=True)
    decoder.prefill()
    drafted = []
    while not decoder.finished:
        drafted.append(len(decoder.round().drafted))
    return drafted, decoder.sequence[len(TINY_PROMPT):]


def test_the_adaptive_budget_halves_then_pauses_longer_and_longer_when_drafts_fail(tiny):
    """A drafter that is always wrong: the budget halves to 1, then drafting pauses for 1, 2, 4 ... plain
    steps; a drafter that is always right doubles it back up to the ceiling. The tokens stay plain greedy's."""
    model = tiny[1]
    n_new = 54  # the tiny models hold 64 positions
    plain = generate(model, TINY_PROMPT, max_new_tokens=n_new, eos_token_id=()).rows[0].token_ids
    drafted, output = drafted_per_round(model, WrongDrafter(plain, model.config.vocab_size), n_new)
    assert output == plain
    expected = [8, 4, 2, 1] + [0, 1] + [0] * 2 + [1] + [0] * 4 + [1] + [0] * 8 + [1] + [0] * 16 + [1]
    assert drafted[:len(expected)] == expected

    class Right(WrongDrafter):
        def propose(self, sequence, n, config, history, generator):
            done = len(sequence) - len(TINY_PROMPT)
            return Draft(plain[done:done + n])

    decoder = SpeculativeDecoder(model, Right(plain, model.config.vocab_size), TINY_PROMPT,
                                 SamplingConfig(max_new_tokens=n_new, eos_token_id=()), num_draft_tokens=8,
                                 adaptive=True)
    decoder.budget = 1
    decoder.prefill()
    sizes = [len(decoder.round().drafted) for _ in range(5)]
    assert sizes == [1, 2, 4, 8, 8] and decoder.sequence[len(TINY_PROMPT):] == plain[:len(decoder.sequence) - len(TINY_PROMPT)]


def test_a_free_drafter_drafts_its_min_draft_then_pauses_and_a_confident_one_drafts_only_when_confident(tiny):
    """A drafter that says drafting costs nothing (`min_draft`, as lookahead's `FREE_DRAFT`): when its drafts
    keep failing the budget halves down to that floor, then drafting pauses as for any drafter. One that can say
    when it is `confident` starts cold: it drafts only when confident until a round pays, then every round; its
    failing confident drafts are paced by the same pauses."""
    model = tiny[1]
    n_new = 40
    plain = generate(model, TINY_PROMPT, max_new_tokens=n_new, eos_token_id=()).rows[0].token_ids

    class FreeButWrong(WrongDrafter):
        min_draft = 3

    drafted, output = drafted_per_round(model, FreeButWrong(plain, model.config.vocab_size), n_new)
    assert output == plain
    expected = [8, 4, 3] + [0, 3] + [0] * 2 + [3] + [0] * 4 + [3] + [0] * 8 + [3] + [0] * 16
    assert drafted[:len(expected)] == expected

    class ConfidentButWrong(FreeButWrong):
        def confident(self, sequence):
            return True

    drafted, output = drafted_per_round(model, ConfidentButWrong(plain, model.config.vocab_size), n_new)
    assert output == plain and drafted[:len(expected)] == expected

    class RightOnceConfident(FreeButWrong):
        def propose(self, sequence, n, config, history, generator):
            done = len(sequence) - len(TINY_PROMPT)
            return Draft(plain[done:done + n])

        def confident(self, sequence):
            return len(sequence) - len(TINY_PROMPT) >= 6  # from the sixth token of output on

    drafted, output = drafted_per_round(model, RightOnceConfident(plain, model.config.vocab_size), n_new)
    assert output == plain
    assert drafted == [0] * 5 + [8, 8, 8, 6]  # cold until confident; the first round pays, then warm to the end


def test_prompt_lookup_and_lookahead_are_confident_on_a_copy_only():
    """When a cold run drafts: prompt lookup's longest n-gram found earlier in the context; lookahead's copy
    pointer following a copy (`max_match` tokens in a row found earlier), or its memory continuing them."""
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert PromptLookup(max_ngram=3).confident(text) and not PromptLookup(max_ngram=3).confident(text[:-1])
    assert not PromptLookup(max_ngram=3).confident(text[:3])  # no earlier text at all
    lookahead = Lookahead(max_match=3)
    lookahead.begin(None, None, 64)
    assert not lookahead.confident(text[:-1]) and lookahead.confident(text)
    remembered = Lookahead(max_match=3)
    remembered.warm([[1, 2, 3, 4]])  # an earlier output: what follows 1 2 3
    remembered.begin(None, None, 64)
    assert remembered.confident([9, 1, 2, 3]) and not remembered.confident([9, 8, 2, 3])


def test_notebook_runs(run_notebook):
    run_notebook("11_lookahead.ipynb", timeout=600)
