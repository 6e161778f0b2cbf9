"""Token trees: several draft continuations verified in one forward pass.

A tree block is ``tokens`` plus ``parents``: ``parents[i]`` is the index of token i's parent in the
block, or -1 when token i directly continues the committed context. Parents come before their
children (``parents[i] < i``), so one forward can feed a block in its order; a chain is the special
case ``parents[i] = i - 1``. Siblings are ranked by their order: a node's first child is its
drafter's first choice.

In the forward (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024; EAGLE-2, Li et al. 2024)
every node sits at position ``base + depth`` and attends to the context and its own ancestors only,
so its logits are those of the sequence on its root path, as if that path had been fed as a chain.
Pure: no I/O, no model; torch only for the mask.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import torch

ROOT = -1


def check_parents(parents: Sequence[int], n: int) -> None:
    """Raise ValueError unless ``parents`` describes a tree over n tokens with parents before children."""
    if len(parents) != n:
        raise ValueError(f"parents has {len(parents)} entries for {n} tokens; send one parent index per token")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(
                f"parents[{i}] = {parent}: a token's parent must come before it in the block (-1 = the context)"
            )


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 0 for a child of the context."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent == ROOT else out[parent] + 1)
    return out


def children(parents: Sequence[int]) -> list[list[int]]:
    """``children(parents)[i + 1]``: the children of node i in rank order; index 0 holds the context's children."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


def ranks(parents: Sequence[int]) -> list[int]:
    """Rank of each node among its siblings (0 = its parent's first child)."""
    seen = [0] * (len(parents) + 1)
    out = []
    for parent in parents:
        out.append(seen[parent + 1])
        seen[parent + 1] += 1
    return out


def primary_chain(parents: Sequence[int]) -> list[int]:
    """The nodes reached by following first children from the context: the drafter's first choice."""
    kids = children(parents)
    path, node = [], ROOT
    while kids[node + 1]:
        node = kids[node + 1][0]
        path.append(node)
    return path


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the context down to ``node`` (inclusive), root first."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:  # -> [n, n] bool
    """``mask[i, j]``: node i attends to node j, i.e. j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent != ROOT:
            mask[i] |= mask[parent]  # parents come first, so their rows are complete
    return mask


def step_layout(start: int, tail: int, parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """Positions and attention mask of a forward that feeds ``tail`` context tokens, then the tree.

    ``start`` positions are cached. The tail sits at start .. start + tail - 1,
    node i at start + tail + depth(i). Returns positions [tail + n] and the
    mask [tail + n, start + tail + n] (True = attends): the tail is causal,
    each node sees the cache, the whole tail and its ancestors.
    """
    n = len(parents)
    base = start + tail
    positions = [*range(start, base), *(base + d for d in depths(parents))]
    mask = torch.zeros(tail + n, start + tail + n, dtype=torch.bool)
    mask[:, :start] = True
    mask[:tail, start:base] = torch.ones(tail, tail, dtype=torch.bool).tril()
    mask[tail:, start:base] = True
    mask[tail:, base:] = ancestor_mask(parents)
    return positions, mask


def merge(sequences: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Continuations merged into a trie: (tokens, parents), in the order they first appear.

    The first sequence becomes the primary chain; a later one adds nodes only
    where it departs from those before it.
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in sequences:
        parent = ROOT
        for token in sequence:
            node = index.get((parent, token))
            if node is None:
                node = len(tokens)
                index[(parent, token)] = node
                tokens.append(int(token))
                parents.append(parent)
            parent = node
    return tokens, parents


def subtree(tokens: Sequence[int], parents: Sequence[int], keep: Sequence[int]) -> tuple[list[int], list[int]]:
    """The nodes ``keep`` (closed under ancestors) as a block of their own, in their original order."""
    kept = sorted(set(keep))
    new_index = {old: new for new, old in enumerate(kept)}
    out_parents = []
    for old in kept:
        parent = parents[old]
        if parent != ROOT and parent not in new_index:
            raise ValueError(f"node {old} is kept without its parent {parent}")
        out_parents.append(ROOT if parent == ROOT else new_index[parent])
    return [tokens[i] for i in kept], out_parents


def below(tokens: Sequence[int], parents: Sequence[int], node: int) -> tuple[list[int], list[int]]:
    """The descendants of ``node`` as a block of their own, ``node`` now the context (its children at ROOT)."""
    new_index = {node: ROOT}
    out_tokens, out_parents = [], []
    for i in range(node + 1, len(parents)):  # parents come first: one pass finds every descendant
        if parents[i] in new_index:
            new_index[i] = len(out_tokens)
            out_tokens.append(tokens[i])
            out_parents.append(new_index[parents[i]])
    return out_tokens, out_parents


# A node's candidate children: (token, probability) pairs, best first, given the node's token and its depth
# (0 for the context's children).
Candidates = Callable[[int, int], Sequence[tuple[int, float]]]


def grow_best_first(
    root: int, candidates: Candidates, depth: int, max_branches: int, max_nodes: int
) -> tuple[list[int], list[int]]:
    """A tree grown best first from the token ``root`` (the last committed one): (tokens, parents).

    A node's score is the product of the probabilities on its path; the next node added is the best
    candidate left whose branch fits: at most ``depth`` levels, ``max_branches`` leaves and ``max_nodes``
    nodes. A node's first child is its best candidate, so the primary chain follows first choices; siblings
    carry distinct tokens when each candidate list does.
    """
    if depth < 0 or max_branches < 1 or max_nodes < 0:
        raise ValueError(f"a tree needs depth >= 0, max_branches >= 1, max_nodes >= 0; got {depth}, {max_branches}, "
                         f"{max_nodes}")
    tokens: list[int] = []
    parents: list[int] = []
    has_child: list[bool] = []
    leaves, order = 0, 0
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent node, its depth + 1, token)

    def offer(parent: int, token: int, level: int, score: float) -> None:
        nonlocal order
        if level < depth:
            for child, probability in candidates(token, level):
                heapq.heappush(heap, (-score * probability, order, parent, level, child))
                order += 1

    offer(ROOT, root, 0, 1.0)
    while heap and len(tokens) < max_nodes:
        negative, _, parent, level, token = heapq.heappop(heap)
        branches = bool(tokens) if parent == ROOT else has_child[parent]  # adding it starts a new leaf
        if branches and leaves >= max_branches:
            continue  # a branch more than allowed; a deeper node of a kept branch may still come
        leaves += branches or not tokens
        if parent != ROOT:
            has_child[parent] = True
        tokens.append(token)
        parents.append(parent)
        has_child.append(False)
        offer(len(tokens) - 1, token, level + 1, -negative)
    return tokens, parents
