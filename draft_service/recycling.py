"""Token recycling: draft from the target's own best successors of the tokens it verified.

Token Recycling (Luo et al. 2024, arXiv 2408.08696): every verifying forward ranks the vocabulary after
each position it computes, rejected draft tokens included. The best few ids after a token are kept in a
table token -> successors (``SuccessorTable``, the latest report of a token replacing the one before),
and a draft is a tree grown from the last committed token through the table: its children are the
token's successors, theirs are looked up in turn. It needs no model and costs the draft a few
dictionary lookups, and unlike prompt lookup it drafts text that never occurred before, since the
table holds what the target itself would say next.

Each session has its own table (what its own context taught) in front of one shared by every session of
the same caller (what earlier requests taught: warm from the first round). Both are bounded by tokens
held, the least recently reported going first. The target sends the successors
(``lmkit.successors.Successors``) with each verify result; the orchestrator forwards them with the next
proposal.

The tree is grown best first under the proposal's bounds (depth, nodes, branches): a node's score is
its parent's times ``RANK_PRIOR`` of its rank among the parent's successors, so the primary chain is the
chain of first successors and the other branches leave it where a second choice is likelier than going
deeper.
"""

from __future__ import annotations

import collections
from typing import Sequence

from specsplit.draft_service.drafter import ContextDrafter, Proposal
from specsplit.lmkit import token_tree
from specsplit.lmkit.successors import Successors

SUCCESSORS_K = 8  # successors per position the drafter asks the target for (DrafterInfo.successors_k)
SESSION_TABLE_TOKENS = 4096  # tokens a session's own table holds at most
# The chance that a token's r-th successor is what follows it, before anything is measured: a node's score
# is the product of its ancestors' priors. First choices are right about half the time on open text.
RANK_PRIOR = tuple(0.5 ** (r + 1) for r in range(SUCCESSORS_K))


class SuccessorTable:
    """token -> its best successors (best first), the latest report winning; at most ``capacity`` tokens, the
    least recently reported dropped first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a successor table holds at least one token, got a capacity of {capacity}")
        self.capacity = capacity
        self._rows: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, token: int) -> tuple[int, ...] | None:
        return self._rows.get(token)

    def update(self, successors: Successors) -> None:
        rows = self._rows
        for token, ids in successors.rows():
            rows[token] = ids
            rows.move_to_end(token)
        while len(rows) > self.capacity:
            rows.popitem(last=False)


class RecyclingDrafter(ContextDrafter):
    """Drafts from a session's table, then its caller's shared one (``shared``)."""

    def __init__(self, prompt: Sequence[int], shared: SuccessorTable | None = None,
                 capacity: int = SESSION_TABLE_TOKENS) -> None:
        super().__init__(prompt)
        self._own = SuccessorTable(capacity)
        self._shared = shared

    def add_successors(self, successors: Successors) -> None:
        self._own.update(successors)
        if self._shared is not None:
            self._shared.update(successors)

    def successors(self, token: int) -> tuple[int, ...]:
        """The best successors of ``token`` known: the session's own, else its caller's; () when none is."""
        found = self._own.get(token)
        if found is None and self._shared is not None:
            found = self._shared.get(token)
        return found or ()

    def propose(self, k: int) -> Proposal:
        """The chain of first successors from the last committed token, up to ``k`` tokens."""
        return self.propose_tree(k, 1, k)

    def propose_tree(self, k: int, max_branches: int, max_nodes: int) -> Proposal:
        """A tree of at most ``max_nodes`` nodes, ``max_branches`` leaves and ``k`` levels, grown best first."""
        if not self._tokens:
            return Proposal(tokens=[])

        def candidates(token: int, depth: int) -> list[tuple[int, float]]:
            return [(s, RANK_PRIOR[r]) for r, s in enumerate(self.successors(token)[: len(RANK_PRIOR)])]

        tokens, parents = token_tree.grow_best_first(self._tokens[-1], candidates, k, max_branches, max_nodes)
        return Proposal(tokens=tokens, parents=None if token_tree.is_chain(parents) else parents)
