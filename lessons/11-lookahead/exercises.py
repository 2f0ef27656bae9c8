"""Lesson 11 exercises: write your answers here; `pytest lessons/11-lookahead` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/11_lookahead.py (try first!).

Conventions (the package's, `minillm.strategies.lookahead.DraftTree`): a token tree is flattened into two lists,
`tokens` and `parents`; node 0 is the root (the sequence's last token, whose logits the verify forward
also computes), parents[0] = -1, and every other node's parent comes before it.
"""

from __future__ import annotations

import torch  # noqa: F401

from minillm.strategies.drafters import Draft


def tree_attention_mask(parents: list[int], prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 1: The tree attention mask

    The mask and positions for one forward over the T nodes of a token tree after `prefix_length` cached
    tokens. Returns (mask, positions):

    - mask: bool [T, prefix_length + T]; mask[i, j] is True when node i may attend to column j: every
      column of the prefix (j < prefix_length), and among the tree's columns (prefix_length + k for node k)
      node i itself and its ancestors (its parent, its parent's parent, ... up to the root), nothing else.
    - positions: long [T]; node i's position, prefix_length + its depth (the root has depth 0, a child
      its parent's depth + 1). Siblings share a position.

    Raise ValueError when a node's parent does not come before it (parents[i] >= i).

    The check compares with a brute-force walk and with the package (`minillm.runtime.session.Tree.from_parents`
    and `new_token_mask`), then runs a tiny model with your mask after a cached prefix: every node's logits
    must equal a plain forward over the prefix and that node's path.
    """
    raise NotImplementedError


def predicted_exact_nodes() -> dict[str, list[int]]:
    """Exercise 1: The tree attention mask

    Write your prediction as literals, before you run anything. The tree parents [-1, 0, 1, 1, 0, 4]
    (root -> a -> {b, c}, and root -> d -> e) goes through one forward of a tiny Llama after a cached prefix,
    with one part of the recipe broken:

        "causal mask":         a plain causal mask over the flattened nodes (node i sees nodes 0..i and the
                               prefix), positions prefix_length + depth as they should be
        "positions by index":  the tree mask as it should be, positions prefix_length + i (as if the nodes were
                               one sequence)

    Returns {case: the nodes (sorted) whose logits still equal a plain forward over the prefix and that node's
    path}. The check runs both cases and compares. Then say why each break spares the nodes it spares.
    """
    raise NotImplementedError


def branches_from_prompt(sequence: list[int], n: int, depth: int) -> Draft:
    """Exercise 2: Branches from the prompt

    A multi-branch drafter without a trie: every earlier occurrence of the sequence's last token offers
    a branch, the tokens that followed it.

    - Candidates: the positions i < len(sequence) - 1 with sequence[i] == sequence[-1].
    - Rank them by how far the occurrence agrees with the end of the sequence, counted backwards from
      i and from the last token, at most 3 tokens (the count of j = 0, 1, 2 with i - j >= 0 and
      sequence[i - j] == sequence[-1 - j], stopping at the first disagreement): longest first; among
      equals the most recent (larger i) first.
    - Each candidate offers the continuation sequence[i + 1 : i + 1 + depth].
    - Merge the continuations, in that order, into one tree rooted at the last token: a continuation
      walks down from the root, reusing the node of each prefix it shares with an earlier branch and
      adding a node where it diverges. Stop as soon as the tree would need more than n nodes besides
      the root (the continuation being added keeps the tokens that fit).

    Returns Draft(tokens, parents=parents): the nodes besides the root, each parent before its
    children, parents[i] the index of tokens[i]'s parent in [sequence[-1], *tokens] (0: the root).
    No candidate: Draft([], parents=[]).

    Example: sequence [7, 1, 2, 3, 9, 1, 2, 4, 1], n = 6, depth = 3: the 1s at i = 5 and i = 1 both
    agree for one token; i = 5 is more recent and offers 2 4 1, then i = 1 offers 2 3 9, sharing the 2:
    Draft([2, 4, 1, 3, 9], parents=[0, 1, 2, 1, 4]). With n = 3: Draft([2, 4, 1], parents=[0, 1, 2]).

    The check compares the tree (as a set of root-to-node paths) with a brute-force version, then wraps
    your function in a drafter for `speculative_generate` and expects plain greedy's tokens.
    """
    raise NotImplementedError


def verify_tree_greedy(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Exercise 3: Verify a token tree

    Greedy verification of a token tree from one tree-masked forward. logits: float [T, V], logits[i]
    the target's next-token logits after the prefix and the path from the root to node i (node i
    included); tokens, parents: the flattened tree (tokens[0] the root, parents[0] = -1).

    Start at the root. At each node the target chooses its own next token, the argmax of that node's
    logits; if a child of the node holds that token, move to the child (its logits are already
    computed, so the target's next choice is free too), else stop.

    Returns (path, emitted): path the node indices visited, root first ([0, ...]); emitted the target's
    choice at each of them (len(emitted) == len(path)). The drafted tokens accepted are
    tokens[path[1]], tokens[path[2]], ...: emitted[:-1]; emitted[-1] is the target's own next token.

    Example: tokens [5, 7, 8, 9], parents [-1, 0, 0, 2] (5 -> {7, 8 -> 9}); argmaxes 8 at node 0, 9 at
    node 2, 4 at node 3 -> path [0, 2, 3], emitted [8, 9, 4].

    The check compares with a brute-force search over all root-to-node paths, then decodes with your
    rule in a real session (lookahead's drafts, one tree forward per round, `keep_positions` on your
    path) and expects plain greedy's tokens and the package's rounds.
    """
    raise NotImplementedError


def prune_to_budget(counts: dict[tuple, float], budget: int) -> dict[tuple, float]:
    """Exercise 4: Prune the memory to a budget

    counts: {n-gram (a tuple of token ids): how often it occurred}, holding every prefix of every
    n-gram it holds (the nodes of a trie). Keep `budget` of them: the most frequent first; among equal
    counts the shorter first; among those the smaller tuple (Python's tuple order) first. With
    len(counts) <= budget keep them all. Returns the kept {n-gram: count}.

    Then convince yourself (the README asks why) that what you keep is still a trie: every kept
    n-gram's prefixes are kept too.

    The check compares with `NGramTrie(depth, node_budget=budget)` after `prune()` on random texts.
    """
    raise NotImplementedError
