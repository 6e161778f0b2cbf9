"""Which nodes of a drafted token tree to verify, by the same cost model that chooses K.

The drafter offers candidates: a primary chain (its first choice) and
branches (older n-gram matches, a model's second choices), as a token tree
(``specsplit.lmkit.token_tree``). Each node i gets an acceptance estimate a_i =
P(node i accepted | its parent accepted): for first children the per-position
acceptance of chains (``AdaptiveK.acceptance``), for later siblings
``BranchStats``. The node is accepted with its path probability P_i, the
product of a along its root path, so a tree yields on average

    E(T) = 1 + sum_{i in T} P_i

committed tokens per target pass (Leviathan et al. 2023's E(k) when T is a
chain; the tree form as in SpecInfer, Miao et al. 2024, and Sequoia, Chen et
al. 2024). Since a <= 1, P never grows down a path: the n nodes with the
largest P always form a tree (EAGLE-2, Li et al. 2024, selects its tree the
same way), and it is the tree of n nodes with the largest E. Of those we keep
the n that maximises, as ``AdaptiveK.rate`` does for a chain,

    (G_o + E(T_n)) / t(n),

with t(n) the predicted time of a verify carrying n draft tokens under the
target's current load and G_o what the other sessions commit from the same
forward. When verifying is dear (a loaded target, a steep t) the best tree
shrinks to the primary chain, and to nothing.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from specsplit.lmkit import token_tree


def path_probabilities(parents: Sequence[int], accept: Sequence[float]) -> list[float]:
    """P_i: the probability that node i and all its ancestors are accepted."""
    out: list[float] = []
    for parent, a in zip(parents, accept):
        out.append(a * (1.0 if parent == token_tree.ROOT else out[parent]))
    return out


def choose_nodes(
    parents: Sequence[int],
    accept: Sequence[float],  # [n] a_i, each in [0, 1]
    verify_s: Callable[[int], float],  # predicted seconds of a verify carrying this many draft tokens
    others_committed: float = 0.0,
) -> list[int]:
    """The nodes worth verifying (closed under ancestors, ascending); empty when no draft pays."""
    if len(accept) != len(parents):
        raise ValueError(f"{len(accept)} acceptance estimates for {len(parents)} nodes")
    if any(not 0.0 <= a <= 1.0 for a in accept):
        raise ValueError("acceptance estimates must be probabilities in [0, 1]")
    probs = path_probabilities(parents, accept)
    order = sorted(range(len(parents)), key=lambda i: (-probs[i], i))  # a parent before its equally likely child
    best_n, best_rate, expected = 0, (others_committed + 1.0) / verify_s(0), 1.0
    for n, node in enumerate(order, start=1):
        expected += probs[node]
        rate = (others_committed + expected) / verify_s(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return sorted(order[:best_n])


@dataclass
class BranchStats:
    """P(a later sibling is accepted | its parent was), by sibling rank and depth, learned from verdicts.

    Shared by every session of a drafter kind on this orchestrator: a new
    session draws on what earlier ones measured. First children are the
    chain's business (``AdaptiveK``).
    """

    prior: float = 0.1
    prior_weight: float = 4.0  # pseudo-observations behind the prior
    decay: float = 0.995  # forget slowly: many sessions feed it
    max_depth: int = 8  # deeper positions share the last entry
    _passed: dict[tuple[int, int], float] = field(default_factory=dict)
    _reached: dict[tuple[int, int], float] = field(default_factory=dict)

    def acceptance(self, rank: int, depth: int) -> float:
        key = (rank, min(depth, self.max_depth))
        return (self._passed.get(key, 0.0) + self.prior * self.prior_weight) / (
            self._reached.get(key, 0.0) + self.prior_weight
        )

    def observe(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """One verdict: the target walked ``path`` (node indices, root first) down the verified tree."""
        kids = token_tree.children(parents)
        ranks = token_tree.ranks(parents)
        depth_of = token_tree.depths(parents)
        # every node whose children the target looked at, and the child it took (None: it stopped there)
        following = dict(zip([token_tree.ROOT, *path], [*path, None]))
        for parent, accepted_child in following.items():
            for child in kids[parent + 1]:
                if ranks[child] == 0:
                    continue
                key = (ranks[child], min(depth_of[child], self.max_depth))
                self._reached[key] = self._reached.get(key, 0.0) * self.decay + 1.0
                self._passed[key] = self._passed.get(key, 0.0) * self.decay + (child == accepted_child)


def node_acceptance(parents: Sequence[int], chain: Sequence[float], branches: BranchStats) -> list[float]:
    """a_i for each node: ``chain[depth]`` for a first child (the last entry beyond), ``branches`` otherwise."""
    ranks = token_tree.ranks(parents)
    out = []
    for rank, depth in zip(ranks, token_tree.depths(parents)):
        if rank == 0:
            out.append(chain[min(depth, len(chain) - 1)] if chain else branches.prior)
        else:
            out.append(branches.acceptance(rank, depth))
    return out
