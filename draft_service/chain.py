"""A drafter chain: several drafters over one session, tried in a fixed order each round.

Rule: each round the members are asked in order and the first non-empty
proposal is the block (e.g. ``[NGRAM, LAYERSKIP]``: copy from the context when
the suffix matches, otherwise run the layer-skip model). Every member sees every
committed token, so whichever answers next round starts from the same context;
model members crop their caches lazily, so a member that sat out a few rounds
only catches up (one forward over the missed tokens) when it is next asked.

Chains send token ids only (no draft probabilities): a block's distribution
would depend on which member answered. Each block names the member that drafted
it and carries its match quality; a free member (prompt lookup) may draft up to
the free bound while a model member drafts k.
"""

from __future__ import annotations

from typing import Sequence

from specsplit.draft_service.drafter import Drafter, Proposal
from specsplit.lmkit.features import FeatureBlock
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.successors import Successors


class ChainDrafter(Drafter):
    def __init__(self, members: Sequence[tuple[DrafterKind, Drafter]]) -> None:
        if not members:
            raise ValueError("a drafter chain needs at least one member")
        positions = {drafter.position for _, drafter in members}
        if len(positions) != 1:
            raise ValueError(f"chain members hold different contexts: {sorted(positions)}")
        self.members = list(members)
        self.last_kind: DrafterKind | None = None  # which member drafted the latest block
        self.blocks_by_kind: dict[DrafterKind, int] = {kind: 0 for kind, _ in members}
        self.needs_features = any(drafter.needs_features for _, drafter in members)

    @property
    def position(self) -> int:
        return self.members[0][1].position

    @property
    def cached_tokens(self) -> int:
        return max((getattr(d, "cached_tokens", 0) for _, d in self.members), default=0)

    def rollback(self, position: int) -> None:
        for _, drafter in self.members:
            drafter.rollback(position)

    def extend(self, tokens: Sequence[int]) -> None:
        for _, drafter in self.members:
            drafter.extend(tokens)

    def prepare(self, budget: int = 0) -> bool:
        read = [drafter.prepare(budget) for _, drafter in self.members]  # each member reads up to ``budget``
        return all(read)

    def add_features(self, block: FeatureBlock) -> None:
        for _, drafter in self.members:
            if drafter.needs_features:
                drafter.add_features(block)

    def add_successors(self, successors: Successors) -> None:
        for _, drafter in self.members:
            drafter.add_successors(successors)

    def propose(self, k: int) -> Proposal:
        return self.propose_within(k, 0)

    def propose_within(self, k: int, free_k: int) -> Proposal:
        if k < 0 or free_k < 0:
            raise ValueError(f"k and free_k must be >= 0, got {k}, {free_k}")
        return self._first(lambda drafter: drafter.propose(max(k, free_k) if drafter.free else k))

    def propose_tree(self, k: int, max_branches: int, max_nodes: int) -> Proposal:
        return self.propose_tree_within(k, 0, max_branches, max_nodes)

    def propose_tree_within(self, k: int, free_k: int, max_branches: int, max_nodes: int) -> Proposal:
        """The first member's non-empty proposal (a free member's up to ``free_k`` deep when larger), as a tree
        when that member drafts trees."""
        if k < 0 or free_k < 0:
            raise ValueError(f"k and free_k must be >= 0, got {k}, {free_k}")
        return self._first(lambda drafter: drafter.propose_tree_within(k, free_k, max_branches, max_nodes))

    def _first(self, ask) -> Proposal:
        self.last_kind = None
        for kind, drafter in self.members:
            block = ask(drafter)
            if block.tokens:
                self.last_kind = kind
                self.blocks_by_kind[kind] += 1
                return Proposal(
                    tokens=list(block.tokens), parents=block.parents, second_guess=block.second_guess,
                    quality=block.quality, drafter=kind,
                )
        return Proposal(tokens=[])

    def close(self) -> None:
        for _, drafter in self.members:
            drafter.close()
