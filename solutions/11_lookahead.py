"""Worked answers for lesson 11's exercises (lessons/11-lookahead/exercises.py).

Check them: `pytest lessons/11-lookahead --solutions`.
"""

from __future__ import annotations

import torch

from minillm.strategies.drafters import Draft

# ------------------------------------------------------------------ Exercise 1


def tree_attention_mask(parents: list[int], prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 1: The tree attention mask"""
    T, P = len(parents), prefix_length
    mask = torch.zeros(T, P + T, dtype=torch.bool)
    mask[:, :P] = True  # every node sees the whole cached prefix
    depth = [0] * T
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"tree node {i} has parent {parent}: parents must come before their children")
        node = i
        while node >= 0:  # itself, its parent, its parent's parent, ... up to the root
            mask[i, P + node] = True
            node = parents[node]
        depth[i] = 0 if parent < 0 else depth[parent] + 1
    # A node at depth d is the (d + 1)-th token after the prefix on its own branch: position P + d.
    # Siblings share a position: each is "the next token" of the same path.
    positions = P + torch.tensor(depth, dtype=torch.long)
    return mask, positions


def predicted_exact_nodes() -> dict[str, list[int]]:
    """Exercise 1: The tree attention mask"""
    # A node's logits are exact when it sees exactly its path (the prefix, its ancestors, itself) and every one of
    # those keys sits at its true position. The flattened order here is root, a, b, c, d, e with depths
    # 0, 1, 2, 2, 1, 2: it is a single chain up to b and branches from c on.
    # Causal mask: node i sees every node before it. Up to b those are exactly its ancestors; c also sees its
    # sibling b, d sees a, b and c, e sees all of them: their logits mix in other branches' tokens.
    # Positions by index: RoPE scores depend on the distance between positions. Up to b index = depth, so nothing
    # moves; c sits one too far from the prefix and from a, d three too far, e (index 5, depth 2) three too far,
    # and e's parent d was rotated at the wrong place as well.
    # Both breaks keep the nodes before the first node that is not its predecessor's child: the tree is a
    # sequence up to there, and a sequence needs neither the tree mask nor tree positions.
    return {"causal mask": [0, 1, 2], "positions by index": [0, 1, 2]}


# ------------------------------------------------------------------ Exercise 2


def branches_from_prompt(sequence: list[int], n: int, depth: int) -> Draft:
    """Exercise 2: Branches from the prompt"""
    last = len(sequence) - 1
    candidates = []
    for i in range(last):  # every earlier occurrence of the last token
        if sequence[i] != sequence[last]:
            continue
        match = 0  # how far back the occurrence agrees with the end of the sequence, at most 3 tokens
        while match < 3 and i - match >= 0 and sequence[i - match] == sequence[last - match]:
            match += 1
        candidates.append((-match, -i, i))  # longest match first, then the most recent
    index = {(): 0}  # path (tokens after the root) -> node index in [root, *tokens]
    tokens, parents = [], []
    for _, _, i in sorted(candidates):
        continuation = sequence[i + 1:i + 1 + depth]
        for j in range(1, len(continuation) + 1):
            path = tuple(continuation[:j])
            if path in index:  # shared with an earlier branch: walk on
                continue
            if len(tokens) == n:  # the budget is spent
                return Draft(tokens, parents=parents)
            index[path] = len(tokens) + 1
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
    return Draft(tokens, parents=parents)


# ------------------------------------------------------------------ Exercise 3


def verify_tree_greedy(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Exercise 3: Verify a token tree"""
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], {})[tokens[node]] = node
    path, emitted, node = [], [], 0
    while node is not None:
        path.append(node)
        choice = int(logits[node].argmax())  # the target's own next token after the path to `node`
        emitted.append(choice)
        node = children.get(node, {}).get(choice)  # a drafted child holds it: its logits are already computed
    return path, emitted


# ------------------------------------------------------------------ Exercise 4


def prune_to_budget(counts: dict[tuple, float], budget: int) -> dict[tuple, float]:
    """Exercise 4: Prune the memory to a budget"""
    if len(counts) <= budget:
        return dict(counts)
    # An n-gram never occurs more often than its prefix, and the prefix is shorter: ranked by
    # (count down, length up), every prefix comes before its extensions, so the kept set is a trie.
    ranked = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))
    return dict(ranked[:budget])
