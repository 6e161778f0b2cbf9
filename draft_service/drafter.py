"""The drafter interface every proposer implements.

A drafter is per session: it holds the session's committed context (prompt plus committed output)
and proposes the next block. The draft service drives it with two calls per round:
``commit(position, tokens)`` (the committed tokens from ``position`` on; its own speculative tokens
past ``position`` are rolled back first), then ``propose(k)`` (up to ``k`` draft tokens) or
``propose_tree`` (several continuations merged into a token tree; by default the chain). A feature
drafter (``needs_features``, e.g. EAGLE) also takes the target's hidden features of committed
positions between the two (``add_features``). A drafter whose proposals cost nothing (prompt
lookup) says so with ``free``: it may propose up to the orchestrator's ``free_k``, which cuts the
block by the ``quality`` it reports (a function of the committed context, never of random draws).

Adding a drafter means one module implementing this class and one entry in
``specsplit.draft_service.registry`` (its ``DrafterKind``, traits and how to build it).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch

from specsplit.lmkit.features import FeatureBlock
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.successors import Successors


@dataclass(frozen=True)
class MatchQuality:
    """How well a copied block's source matches the context (prompt lookup): what its acceptance depends on."""

    length: int  # tokens the context's suffix shares with the text before the copied span (capped)
    occurrences: int  # earlier occurrences of the matched suffix n-gram (1 = unique)


@dataclass(frozen=True)
class Proposal:
    """One proposal.

    ``tokens`` may be shorter than the ``k`` asked for (an n-gram drafter with
    no match proposes nothing). ``probs`` is set only when the drafter sampled
    the tokens and was asked for its distributions (probability mode): row i is
    the distribution token i was drawn from. ``parents`` is set for a token
    tree (``specsplit.lmkit.token_tree``), None for a chain. ``second_guess`` (chains only)
    is the drafter's second guess where it is least sure: (index into ``tokens``,
    the token it would put there instead); the orchestrator may draft past that
    outcome too.
    """

    tokens: list[int]  # [k']
    probs: torch.Tensor | None = None  # [k', vocab] float32, rows sum to 1
    parents: list[int] | None = None  # [k'] parent index of each token, -1 = the context
    second_guess: tuple[int, int] | None = None  # (index < k', runner-up token)
    quality: MatchQuality | None = None  # set by drafters that copy from the context
    drafter: DrafterKind | None = None  # the member that drafted it, in a chain


class Drafter(abc.ABC):
    """Per-session proposer over a committed context."""

    needs_features = False  # drafts from the target's hidden features (they arrive through add_features)
    free = False  # proposals cost ~nothing to make: it may draft up to the free bound

    def propose_within(self, k: int, free_k: int) -> Proposal:
        """Up to ``k`` tokens, or up to ``free_k`` (when larger) for a free drafter."""
        return self.propose(max(k, free_k) if self.free else k)

    @property
    @abc.abstractmethod
    def position(self) -> int:
        """Number of committed tokens the drafter holds (prompt included)."""

    @abc.abstractmethod
    def rollback(self, position: int) -> None:
        """Forget every committed token at index >= ``position``."""

    @abc.abstractmethod
    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens to the context."""

    @abc.abstractmethod
    def propose(self, k: int) -> Proposal:
        """Propose up to ``k`` tokens that continue the committed context."""

    def propose_tree(self, k: int, max_branches: int, max_nodes: int) -> Proposal:
        """Up to ``max_branches`` continuations of up to ``k`` tokens, at most ``max_nodes`` tokens in all.

        Drafters with alternatives override it; the default is the chain of ``propose(k)``.
        """
        return self.propose(min(k, max_nodes))

    def propose_tree_within(self, k: int, free_k: int, max_branches: int, max_nodes: int) -> Proposal:
        """``propose_tree`` up to ``k`` tokens deep, or up to ``free_k`` (when larger) for a free drafter."""
        return self.propose_tree(max(k, free_k) if self.free else k, max_branches, max_nodes)

    def commit(self, position: int, tokens: Sequence[int]) -> None:
        """Roll back to ``position``, then append ``tokens`` (the committed ones)."""
        if position > self.position:
            raise ValueError(f"commit at position {position} is past the drafter's context ({self.position} tokens)")
        self.rollback(position)
        self.extend(tokens)

    def prepare(self, budget: int = 0) -> bool:
        """Read the committed context ahead of the first proposal (drafters that keep a cache of it), so that
        the first proposal is as quick as the ones after it: at most ``budget`` more tokens of it (0: all).
        Whether all of it is read now (a drafter that keeps no cache has nothing to read)."""
        return True

    def add_features(self, block: FeatureBlock) -> None:
        """Take the target's hidden features of committed positions (feature drafters only)."""
        raise ValueError(f"{type(self).__name__} takes no hidden features")

    def add_successors(self, successors: Successors) -> None:  # noqa: B027 - optional hook
        """Take the target's best successors of verified positions (drafters that recycle them; others ignore them)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release per-session resources (caches)."""


class ContextDrafter(Drafter):
    """A drafter that holds its committed context as a list of token ids (``_tokens``)."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self._tokens = [int(t) for t in prompt]

    @property
    def position(self) -> int:
        return len(self._tokens)

    def rollback(self, position: int) -> None:
        if not 0 <= position <= len(self._tokens):
            raise ValueError(f"rollback to {position} is outside the context [0, {len(self._tokens)}]")
        del self._tokens[position:]

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(int(t) for t in tokens)
