"""Whether to ask a free drafter at all: what its asks return, and what a block of each return saves.

A free drafter (prompt lookup, Saxena 2023) costs nothing to draft, but
asking it does: in sync mode the round waits for the draft link's round trip
before the target can verify; with overlap a block drafted ahead costs only
the part of its round trip that the verification does not hide. Whether to
ask is decided before the answer is known, so it is priced by what asks
returned before: the mix of match qualities (``specsplit.orchestrator.acceptance``'s
buckets, or no block when nothing matched), this session's recent asks shrunk
towards every session's.

A block of quality q in hand saves, against a target-only step of T_0
seconds, the best over k of

    (G + E_q(k)) T_0 / (G + 1) - T(k)

seconds, where E_q(k) is Leviathan's expected tokens per pass from the
quality's acceptance, T(k) the round with the block cut to k (its draft round
trip paid) and G the tokens the other rows of the target's batch commit
(``specsplit.orchestrator.rate``); k = 0 saves nothing, so a block never saves less
than 0. The expected saving of an ask is the mix's mean of that, and the ask
pays when it exceeds what asking costs (``LinkCosts.ask_s``).

An ask sent ahead, during a verification, is used with probability h (the
outcome it assumed came true); otherwise the next round asks again, before its
verification. So it goes ahead only when that is cheaper than asking after
the verification: cost_ahead + (1 - h) cost_before < cost_before, that is
cost_ahead < h cost_before. On separate machines an ask ahead costs nearly
nothing and one before pays the draft's round trip; on one shared CPU the ask
ahead slows the verification it overlaps (``CostModel.ahead_excess_s``) by more
than a loopback round trip, and the ask waits for the round.

The mix changes only with what asks returned (qualities: functions of the
committed context) and the acceptance statistics with blocks already
verified, never with the draws of the positions a block covers, so the
decision keeps sampled verification lossless.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specsplit.orchestrator.acceptance import Quality

NO_BLOCK = None  # an ask that returned no block of the free drafter (nothing in the context matched)


@dataclass
class QualityMix:
    """Decayed counts of what asks of a free drafter returned: a ``Quality``, or ``NO_BLOCK``."""

    decay: float
    counts: dict[Quality | None, float] = field(default_factory=dict)
    unasked: int = 0  # rounds not asked since the last ask (probing; every session's rounds, server-wide)
    interval: int = 0  # rounds not asked before the next probe (0: not set yet)

    def add(self, quality: Quality | None) -> None:
        for key in self.counts:
            self.counts[key] *= self.decay
        self.counts[quality] = self.counts.get(quality, 0.0) + 1.0

    @property
    def total(self) -> float:
        return sum(self.counts.values())

    def shares(self, anchor: QualityMix | None = None, weight: float = 0.0) -> dict[Quality | None, float]:
        """Each return's share, these counts shrunk towards ``anchor``'s shares by ``weight`` pseudo-asks
        (empty when neither has counts)."""
        anchor_total = anchor.total if anchor is not None else 0.0
        weight = weight if anchor_total > 0 else 0.0
        total = self.total + weight
        if total <= 0:
            return {}
        shares = {q: c / total for q, c in self.counts.items()}
        if weight:
            for q, c in anchor.counts.items():
                shares[q] = shares.get(q, 0.0) + weight * c / anchor_total / total
        return shares


def best_saving_s(accept: list[float], step_s: float, round_s, others: float) -> float:
    """Seconds a block with per-position acceptance ``accept`` saves at its best cut against a target-only step
    of ``step_s`` seconds; ``round_s(k)``: the round with it cut to k; ``others``: G (module docstring)."""
    best, expected, run = 0.0, 1.0, 1.0
    for k, p in enumerate(accept, start=1):
        run *= p
        expected += run
        best = max(best, (others + expected) * step_s / (others + 1.0) - round_s(k))
    return best
