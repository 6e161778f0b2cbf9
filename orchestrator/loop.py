"""The speculative loop: draft K, verify in one target pass, commit accepted + 1, repeat.

The orchestrator's ``committed`` list is the source of truth. Each round the
draft receives the tokens committed since it last heard (the accepted prefix of
its own block plus the target's correction or bonus token) and rolls back the
rest; the target commits the same accepted + 1 tokens itself, so both caches
stay in step without re-reading the prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from orchestrator.adaptive_k import AdaptiveK, CostModel
from orchestrator.links import DraftLink, TargetLink


class Finish(enum.Enum):
    LENGTH = 1
    EOS = 2
    STOP_STRING = 3
    CONTEXT = 4


@dataclass(frozen=True)
class LoopConfig:
    k: int  # draft tokens per round (the bound when adaptive); 0 = target-only decoding
    max_new_tokens: int
    eos_ids: frozenset[int]
    max_context: int  # positions the target accepts


@dataclass
class LoopStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    draft_compute_s: float = 0.0
    target_compute_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward pass (accepted + 1)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        return sum(self.k_per_round) / len(self.k_per_round) if self.k_per_round else 0.0


def cut_at_finish(new: Sequence[int], eos_ids: frozenset[int], budget: int) -> tuple[list[int], Finish | None]:
    """Truncate a round's tokens after the first EOS, or at the token budget."""
    for i, token in enumerate(new[:budget]):
        if token in eos_ids:
            return list(new[: i + 1]), Finish.EOS
    if len(new) >= budget:
        return list(new[:budget]), Finish.LENGTH
    return list(new), None


async def speculative_decode(
    prompt: Sequence[int],
    config: LoopConfig,
    target: TargetLink,
    draft: DraftLink | None,
    stats: LoopStats,
    controller: AdaptiveK | None = None,
    costs: CostModel | None = None,
) -> AsyncIterator[tuple[list[int], Finish | None]]:
    """Yield (newly committed tokens, finish reason or None) once per round.

    With a ``controller``, each round's k is chosen in [0, config.k]; ``costs``
    learns from every round but the first (which carries the prompt's prefill).
    """
    committed = list(prompt)
    while True:
        budget = config.max_new_tokens - stats.committed
        room = config.max_context - len(committed)
        if room <= 0:
            yield [], Finish.CONTEXT
            return
        # accepted + 1 tokens are committed, so k + 1 must fit the budget and the context.
        wanted = controller.choose() if controller is not None else config.k
        k = max(0, min(wanted, config.k, budget - 1, room - 1))
        block_tokens: list[int] = []
        block_probs = None
        draft_s = 0.0
        block = await draft.propose(committed, k) if draft is not None and k > 0 else None
        if block is not None:
            block_tokens = list(block.tokens)
            block_probs = block.probs if block.HasField("probs") else None
            draft_s = block.compute_us / 1e6
        result = await target.verify(committed, block_tokens, block_probs)
        target_s = result.compute_us / 1e6
        stats.draft_compute_s += draft_s
        stats.target_compute_s += target_s
        if controller is not None:
            controller.observe(len(block_tokens), result.accepted)
        if costs is not None and stats.rounds > 0:
            costs.observe_verify(len(block_tokens), target_s)
            costs.observe_draft(len(block_tokens), draft_s)
        new, finish = cut_at_finish([*block_tokens[: result.accepted], result.next_token], config.eos_ids, budget)
        committed.extend(new)
        stats.rounds += 1
        stats.drafted += len(block_tokens)
        stats.accepted += result.accepted
        stats.committed += len(new)
        stats.accepted_per_round.append(result.accepted)
        stats.k_per_round.append(k)
        stats.drafted_per_round.append(len(block_tokens))
        if finish is None and len(committed) >= config.max_context:
            finish = Finish.CONTEXT
        yield new, finish
        if finish is not None:
            return
