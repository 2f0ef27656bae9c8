"""Lookahead decoding (lesson 11): draft a tree of continuations from an n-gram trie, verify it in one forward.

Prompt lookup (lesson 08) copies one continuation of the context's last n-gram. Text
that repeats usually offers several: the passage being edited continues one way, an
earlier answer of the same kind another. Lookahead (Zhao et al., KDD 2024, Ant Group's
PainlessInferenceAcceleration) keeps every n-gram it has seen in a trie with counts
(`NGramTrie`, in `minillm.strategies.ngram_trie`) and drafts the most frequent
continuations of the context's suffix *as a tree*: the branches share their common
prefixes, and one forward with a tree attention mask (each node sees the cached
prefix, its ancestors and itself) scores all of them.

    context ... the cat          trie under "the cat":  sat -> on -> the
                                                          is -> on
    draft tree (root = "cat"):   cat -> sat -> on -> the
                                     -> is -> on
    flattened: [cat, sat, is, on, on, the]   parents [-1, 0, 0, 1, 2, 3]

Two tries feed the drafts: the request's own *context* (prompt and accepted output,
rebuilt per request) and a *memory* of earlier outputs kept across requests, counted
and pruned to a node budget; each gets a share of the draft, and the rest goes to
the likeliest continuations of either. The two knobs of the
original: `branch_length` (how deep a branch goes) and `decoding_length` (how many
draft tokens one forward may verify in total).

Text that is being copied needs no statistics: a `CopyPointer` follows the place in the
request that the output copies, through the small edits a correction makes, and while
it copies the draft is simply the next branch of that text.

`SpeculativeDecoder` (lesson 08) verifies the tree: it follows, from the root, the
child whose token the target itself chooses at each node, so the output is exactly
the target's (greedy: its argmax; sampling: its draw), and keeps the accepted path in
the cache with the session's `keep_positions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

from .drafters import FREE_DRAFT, Draft, latest_earlier_occurrence
from .ngram_trie import NGramTrie


@dataclass
class DraftTree:
    """A flattened token tree: tokens[0] is the root (the last accepted token), parents[i] the index
    of node i's parent (-1 for the root), parents before children (breadth first)."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def from_paths(cls, root: int, paths) -> "DraftTree":
        """Merge continuation paths (token tuples, each path's parent path included) into one tree."""
        index = {(): 0}
        tokens, parents = [root], [-1]
        for path in sorted(dict.fromkeys(paths), key=len):  # breadth first (a parent before its children), best first
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
        return cls(tokens, parents)


def share_draft(context_paths, memory_paths, budget: int) -> list[tuple]:
    """Up to `budget` draft nodes from both sources: each source's best path first, so that both get a
    share, then the best-scoring of the rest, whichever source they come from (the context first among
    equals). A path both offer counts once.

    Each source's list is best first and a path never scores above its parent, so the parent comes
    first in its own list and in the merge: every chosen path's parent is chosen too."""
    chosen: dict[tuple, None] = {}
    for paths in (context_paths, memory_paths):
        if paths and len(chosen) < budget:
            chosen.setdefault(paths[0][0])
    rest = sorted([*context_paths[1:], *memory_paths[1:]], key=lambda item: -item[1])  # stable: context first
    for path, _ in rest:
        if len(chosen) >= budget:
            break
        chosen.setdefault(path)
    return list(chosen)


def context_first(context_paths, memory_paths, budget: int) -> list[tuple]:
    """Up to `budget` draft nodes, the context's first and the memory's after them (while the output
    copies its context, what the context continues with beats what earlier outputs did). Both lists are
    ancestor-closed and best first, so every prefix of the two in a row is a tree."""
    return list(dict.fromkeys(path for path, _ in [*context_paths, *memory_paths]))[:budget]


class CopyPointer:
    """Which earlier text the output is copying, followed token by token through small edits.

    `source` is the index in the sequence of the token a copy would continue with; `edit` the output
    tokens since the last one that continued it (0: copying). A new token that equals the token at
    `source` continues the copy, and so does one that equals one of the `skips - 1` tokens after it:
    the edit replaced those (a corrected "bilt" -> " built" skips the passage's " b", "ilt" and goes
    on at " in"). Any other token lengthens the edit, and an edit longer than `max_edit` tokens ends
    the copy. While there is no copy, or an edit is under way, each new token may (re)start one:
    where the last `max_match` tokens occurred most recently before.

        passage ... was  b  ilt  in ...        output ... was  built  in
        after " was":   source at " b", edit 0 (copying)
        after " built": source at " b", edit 1 (" built" is none of " b", "ilt", " in", " ")
        after " in":    source at " " (" in" was 2 past " b"), edit 0 (copying again)

    Given the tokenizer's `decode`, the pointer ranks those places by how alike the edit's text is to
    the text it skips (" built" is most like " bilt", so " in" comes first); without it, in order.
    """

    def __init__(self, max_match: int, skips: int = 4, max_edit: int = 4, decode=None):
        self.max_match, self.skips, self.max_edit, self.decode = max_match, skips, max_edit, decode
        self.source: int | None = None
        self.edit = 0

    @property
    def copying(self) -> bool:
        return self.source is not None and self.edit == 0

    @property
    def resuming(self) -> bool:
        return self.source is not None and self.edit > 0

    def follow(self, sequence, start: int) -> None:
        """Move along sequence[start:], the tokens since the last call (the first call: start=0, and
        only the last token is walked, since the prompt before it is no output that copies)."""
        for position in range(start or len(sequence) - 1, len(sequence)):
            if self.source is not None:
                ahead = sequence[self.source:min(self.source + self.skips, position)]
                if sequence[position] in ahead:
                    self.source += ahead.index(sequence[position]) + 1
                    self.edit = 0
                    continue
                if self.edit < self.max_edit:
                    self.edit += 1
                else:
                    self.source = None
            if not self.copying and position >= self.max_match:
                begin = latest_earlier_occurrence(sequence, self.max_match, end=position + 1)
                if begin is not None:
                    self.source, self.edit = begin + self.max_match, 0

    def places(self, sequence) -> list[int]:
        """How many tokens after `source` the copy may go on at (0 .. skips - 1), likeliest first."""
        skips = list(range(self.skips))
        if self.decode is not None and self.resuming:
            edit = self.decode(sequence[len(sequence) - self.edit:])

            def likeness(skip):
                return SequenceMatcher(None, edit, self.decode(sequence[self.source:self.source + skip])).ratio()
            skips.sort(key=likeness, reverse=True)  # stable: among equals, fewer skipped tokens first
        return skips

    def paths(self, sequence, depth: int) -> list[tuple]:
        """Draft paths (ancestor-closed, best first). Copying: the `depth` tokens from the source on.
        Resuming after an edit: `depth` nodes over the places the copy may go on at, the likeliest
        place `depth - (skips - 1)` tokens deep (at least one) and each other place one token."""
        if self.source is None:
            return []
        if self.copying:
            branches = [sequence[self.source:self.source + depth]]
        else:
            first, *others = self.places(sequence)
            deepest = max(1, depth - len(others))
            branches = [sequence[self.source + first:self.source + first + deepest],
                        *(sequence[self.source + skip:self.source + skip + 1] for skip in others)]
        paths: dict[tuple, None] = {}
        for branch in branches:
            paths.update(dict.fromkeys(tuple(branch[:i]) for i in range(1, len(branch) + 1)))
        return list(paths)


class Lookahead:
    """The lookahead drafter: a context trie per request, a memory trie across requests.

    `propose` feeds the tokens accepted since its last call into the context trie,
    then drafts up to n nodes (the decoder's current budget, at most `decoding_length`)
    from both tries' continuations of the sequence's suffix, `branch_length` deep at
    most. While the output copies earlier text (`CopyPointer`), the draft is one
    whole branch of that text, whatever the budget; right after an edit in a copy,
    the places the copy may go on at lead the draft. `end` adds the finished output
    to the memory; `warm` adds texts of the kind to come (the original builds its
    memory from a training split).

    The decoder reads `max_draft` (its budget's ceiling), `adaptive` (shrink the
    budget where drafts fail, and pause drafting where even the smallest fails, so
    open-ended text costs little), `min_draft` (the floor the budget shrinks to:
    `FREE_DRAFT`, as drafting costs nothing) and `confident` (a copy under way: what a
    run whose drafts have not paid waits for) from the drafter. The time `propose`
    takes is the decoder's `draft_seconds`: retrieval, for lookahead.
    """

    adaptive = True
    min_draft = FREE_DRAFT

    def __init__(self, decoding_length: int = 16, branch_length: int = 8, max_match: int = 3,
                 memory_budget: int = 65536):
        check_lookahead_lengths(decoding_length, branch_length, max_match=max_match)
        self.decoding_length, self.branch_length, self.max_match = decoding_length, branch_length, max_match
        self.memory = NGramTrie(max_match + branch_length, node_budget=memory_budget)
        self.context = NGramTrie(max_match + branch_length)
        self.pointer = CopyPointer(max_match)
        self.fed = 0  # tokens of the current sequence in the context trie and the pointer

    @property
    def max_draft(self) -> int:
        return self.decoding_length

    def warm(self, texts) -> None:
        """Add token lists (earlier outputs of the same kind) to the memory."""
        for tokens in texts:
            self.memory.add_text(tokens)
        self.memory.prune()

    def begin(self, target, tokenizer, max_len):
        self.context = NGramTrie(self.max_match + self.branch_length)
        self.pointer = CopyPointer(self.max_match, decode=None if tokenizer is None else tokenizer.decode)
        self.fed = 0

    def _catch_up(self, sequence) -> None:
        """Feed the tokens accepted since the last call to the copy pointer and the context trie."""
        self.pointer.follow(sequence, self.fed)
        self.context.extend(sequence[self.fed:])
        self.fed = len(sequence)

    def confident(self, sequence) -> bool:
        """The output is copying earlier text (`CopyPointer`), or a trie continues the last `max_match` tokens
        (the context's earlier text, the memory's earlier outputs): worth a verify forward even where drafts
        have not paid. A continuation of a shorter suffix is too common to count."""
        self._catch_up(sequence)
        suffix = sequence[-self.max_match:]
        return self.pointer.copying or len(sequence) > self.max_match and any(
            (node := trie.find(suffix)) is not None and bool(node.children) for trie in (self.context, self.memory))

    def propose(self, sequence, n, config, history, generator) -> Draft:
        self._catch_up(sequence)
        budget, lead = min(n, self.decoding_length), []
        if self.pointer.copying:  # a copy tends to go on: a whole branch, even where the budget shrank
            budget = min(self.branch_length, self.decoding_length)
            lead = self.pointer.paths(sequence, self.branch_length)
        elif self.pointer.resuming:  # where the copy goes on after an edit leads, the tries' guesses get half
            budget = min(max(budget, self.branch_length), self.decoding_length)
            lead = self.pointer.paths(sequence, self.branch_length)[:budget // 2]
        context, memory = [trie.continuations(sequence, budget, self.branch_length, self.max_match)
                           for trie in (self.context, self.memory)]
        share = context_first if self.pointer.copying else share_draft
        paths = list(dict.fromkeys([*lead, *share(context, memory, budget)]))[:budget]
        tree = DraftTree.from_paths(sequence[-1], paths)
        return Draft(tree.tokens[1:], parents=tree.parents[1:])

    def rollback(self, sequence):
        pass  # the context trie holds accepted tokens only

    def end(self, sequence, prompt_length: int) -> None:
        """The request is over: remember its output."""
        self.memory.add_text(sequence[prompt_length:])
        self.memory.prune()


def check_lookahead_lengths(decoding_length=1, branch_length=1, as_flags: bool = False, max_match=1) -> None:
    """Refuse a length below 1, named as the API (decoding_length=0) or the CLI (--decoding-length 0) spells it.
    Each length left out is a valid one: a caller checks only what it was given."""
    for name, value, what in (("decoding_length", decoding_length, "draft tokens verified per forward"),
                              ("branch_length", branch_length, "tokens in one branch"),
                              ("max_match", max_match, "context tokens a retrieval matches")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            setting = f"--{name.replace('_', '-')} {value}" if as_flags else f"{name}={value!r}"
            raise ValueError(f"{setting} is invalid: must be an integer >= 1 ({what})")


__all__ = ["Lookahead", "CopyPointer", "DraftTree", "share_draft", "context_first", "check_lookahead_lengths"]
