"""The n-gram memory lookahead drafts from (lesson 11): every n-gram of the texts fed in, counted in a trie.

Lookahead (`minillm.strategies.lookahead`) needs, for the context's last few tokens, the
likeliest ways text went on after them before. A trie answers that in one walk: the path
from the root spells an n-gram, each node counts how often it occurred, and the children
of the node the context's suffix leads to are what followed it, their counts saying how
often. `continuations` finds that node (the longest suffix that matches) and walks below
it best first (`likeliest_paths`), returning ancestor-closed paths with scores that the
drafter merges into one draft tree.

    texts "the cat sat on", "the cat is on"  (depth 3)
    root -> the (2) -> cat (2) -> sat (1)
                               -> is (1)
         -> cat (2) -> sat (1) -> on (1)
                    -> is (1)  -> on (1)   ...

The same class serves as the request's context (rebuilt per request, fed token by token)
and as the memory across requests (pruned to a node budget, so what recurs survives).
"""

from __future__ import annotations

import heapq
import itertools


class TrieNode:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, TrieNode] = {}
        self.count = 0.0  # how often the n-gram spelled by the path to this node occurred


class NGramTrie:
    """Every n-gram (n <= depth) of the texts fed to it, with its count, as a trie.

    The path from the root to a node spells an n-gram; `node.count` is how many times
    it occurred. Texts arrive whole (`add_text`) or token by token (`extend`, then
    `end_text`): each new token adds the n-grams that end at it, so a text fed in
    pieces counts exactly what it counts fed at once. With a `node_budget`, `prune`
    keeps the most frequent n-grams: what recurs survives, one-offs go.
    """

    def __init__(self, depth: int, node_budget: int | None = None):
        if depth < 2:
            raise ValueError(f"trie depth={depth} is invalid: n-grams need at least 2 tokens to draft from")
        self.depth, self.node_budget = depth, node_budget
        self.root = TrieNode()
        self.nodes = 0
        self.frontier: list[TrieNode] = []  # nodes of the current text's suffixes, lengths 1 .. depth - 1

    def extend(self, tokens) -> None:
        """Continue the current text with `tokens`, counting each n-gram that ends at one of them."""
        for token in tokens:
            grown = []
            for node in [self.root, *self.frontier]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = TrieNode()
                    self.nodes += 1
                child.count += 1
                grown.append(child)
            self.frontier = grown[: self.depth - 1]

    def end_text(self) -> None:
        """The current text is over: the next token starts a new one (no n-gram spans two texts)."""
        self.frontier = []

    def add_text(self, tokens) -> None:
        self.end_text()
        self.extend(tokens)
        self.end_text()

    def prune(self) -> None:
        """Keep the `node_budget` most frequent n-grams (shorter first among equals), drop the rest.

        A child never occurs more often than its parent and is longer, so the kept set
        is closed under taking prefixes: pruning leaves a trie.
        """
        self.end_text()
        if self.node_budget is None or self.nodes <= self.node_budget:
            return
        ranked = sorted(self.walk(), key=lambda item: (-item[1].count, len(item[0]), item[0]))
        keep = {path for path, _ in ranked[: self.node_budget]}
        for path, node in ranked[self.node_budget:]:
            if path[:-1] in keep or len(path) == 1:
                del (self.find(path[:-1]) or self.root).children[path[-1]]
        self.nodes = len(keep)

    def walk(self):
        """(path, node) for every node, parents before children."""
        stack = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for token, child in node.children.items():
                yield path + (token,), child
                stack.append((path + (token,), child))

    def find(self, ngram) -> TrieNode | None:
        node = self.root
        for token in ngram:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def continuations(self, context, max_nodes: int, max_depth: int, max_match: int) -> list[tuple[tuple, float]]:
        """The likeliest continuations of the context's longest matching suffix.

        Tries suffixes of `max_match` tokens down to 1 and keeps the first that yields
        `min(max_nodes, max_depth)` continuations (a long match is the more reliable
        one), else the one that yields most. Returns (path, score) pairs, a path being
        the tokens after the context, best first; every path's parent path is in the
        list too (a child never scores above its parent). The score is the path's
        estimated probability scaled by the match's share of `max_match`: what follows
        one matching token is a weaker guess than what follows three, which matters
        when two tries' paths compete for the draft (`share_draft`).
        """
        best: list = []
        for size in range(min(max_match, len(context)), 0, -1):
            node = self.find(context[len(context) - size:])
            if node is None or not node.children:
                continue
            found = [(path, p * size / max_match)
                     for path, p in likeliest_paths(node, max_nodes, min(max_depth, self.depth - size))]
            if len(found) >= min(max_nodes, max_depth):
                return found
            if len(found) > len(best):
                best = found
        return best


def likeliest_paths(node: TrieNode, max_nodes: int, max_depth: int) -> list[tuple[tuple, float]]:
    """Best-first walk below `node`: the `max_nodes` paths of at most `max_depth` tokens with the
    highest estimated probability, the product of count(child) / count(parent) along the path."""
    tie = itertools.count()  # equal probabilities: the earlier-found path first
    heap = [(-child.count / node.count, next(tie), (token,), child) for token, child in node.children.items()]
    heapq.heapify(heap)
    found = []
    while heap and len(found) < max_nodes:
        negative, _, path, child = heapq.heappop(heap)
        found.append((path, -negative))
        if len(path) < max_depth:
            for token, grandchild in child.children.items():
                heapq.heappush(heap, (negative * grandchild.count / child.count, next(tie), path + (token,), grandchild))
    return found


__all__ = ["NGramTrie", "TrieNode", "likeliest_paths"]
