"""Acceptance statistics kept server-wide: per drafter, per verification, per match quality, per block position.

Leviathan et al. 2023 model a drafter by one acceptance rate alpha. Measured
here instead, for each key, is P(position i passes | positions before it
passed), i = 1..depth, from every verified block of every session of the
orchestrator, updated online. A key is:

* the drafter that drafted the block (a chain's member, not the chain);
* the verification: greedy, or a sampling mode at a temperature (sampled
  verification accepts a copied token with p(x), not when it is the argmax);
* the block's match quality when the drafter copies from the context (prompt
  lookup, Saxena 2023): the length of the match behind the copied span and the
  number of earlier occurrences of the matched n-gram, in buckets. Measured on
  the target's own greedy answers, a copy whose source matches the context by
  one token passes about 1 time in 4, one matching 12 tokens or more 9 times in
  10, and the conditional rate of deeper positions is ~0.8 for all.

A new session therefore starts from what every session before it measured,
and sizes a block by its quality before it has any history of its own.

Estimates are shrunk where evidence is thin: a key's position i leans on its
pool's position i (the same drafter and verification, all qualities), and the
pool's position i leans on its position i - 1 (the first on ``prior``); a
deep position is reached rarely and a run that passed so far tends to go on.
Counts decay slowly (traffic drifts). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.free_ask import QualityMix

LENGTH_BUCKETS = (1, 2, 3, 5, 11)  # match length buckets: 1, 2, 3, 4-5, 6-11, 12+
OCCURRENCE_BUCKETS = (1,)  # one earlier occurrence, or several
MAX_DEPTH = 64  # positions kept per key


def _bucket(value: int, bounds: tuple[int, ...]) -> int:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return len(bounds)


@dataclass(frozen=True)
class Verification:
    """How blocks are checked, as far as acceptance goes: the mode and (sampling) the temperature."""

    mode: VerificationMode
    temperature: float = 0.0  # rounded to 0.1 for the key

    @classmethod
    def of(cls, mode: VerificationMode, temperature: float) -> Verification:
        return cls(mode, 0.0 if mode is VerificationMode.GREEDY else round(temperature, 1))


@dataclass(frozen=True)
class Quality:
    """A block's match quality in buckets (``quality_of``)."""

    length: int
    occurrences: int


def quality_of(length: int, occurrences: int) -> Quality:
    """Bucket a reported match (length of the match behind the copy, earlier occurrences of the n-gram)."""
    return Quality(_bucket(max(length, 1), LENGTH_BUCKETS), _bucket(max(occurrences, 1), OCCURRENCE_BUCKETS))


@dataclass(frozen=True)
class StatsKey:
    drafter: DrafterKind
    verification: Verification
    quality: Quality | None = None  # None: blocks without a reported quality (model drafters)

    @property
    def pool(self) -> StatsKey:
        return StatsKey(self.drafter, self.verification)


@dataclass
class _Counts:
    """Decayed counts per position: blocks that reached it, and of those, how many passed it."""

    reached: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    passed: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    blocks: float = 0.0
    skipped: int = 0  # blocks of this key not verified since the last one that was (probing)
    interval: int = 0  # skipped blocks before the next probe, where the controller backs off (0: not set)

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self.blocks = self.blocks * decay + 1
        for i in range(min(drafted, accepted + 1, MAX_DEPTH)):  # the positions the verifier looked at
            self.reached[i] = self.reached[i] * decay + 1
            self.passed[i] = self.passed[i] * decay + (1 if i < accepted else 0)
        self.skipped = 0


@dataclass
class AcceptanceStats:
    """Per-position acceptance by key, shared by every session of an orchestrator."""

    prior: float = 0.5  # P(first position passes) before any evidence
    pool_weight: float = 2.0  # pseudo-observations behind a pool's anchor, per position
    key_weight: float = 4.0  # pseudo-observations behind a key's anchor (its pool), per position
    decay: float = 0.998  # per block of the same key: traffic drifts, slowly
    _counts: dict[StatsKey, _Counts] = field(default_factory=dict, init=False)
    _asked: dict[StatsKey, QualityMix] = field(default_factory=dict, init=False)  # pool -> what asks returned
    # (key, depth) -> its acceptance until the next verified block: every session asks each round, blocks are rarer
    _acceptance: dict[tuple[StatsKey, int], list[float]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.prior < 1.0:
            raise ValueError(f"prior must be in (0, 1), got {self.prior}")
        if self.pool_weight <= 0 or self.key_weight <= 0:
            raise ValueError("pool_weight and key_weight must be > 0")

    def observe(self, key: StatsKey, drafted: int, accepted: int) -> None:
        """A verified block of ``key``: ``accepted`` of its ``drafted`` tokens passed (a rejection ends it)."""
        if drafted <= 0:
            return  # an empty block says nothing about acceptance
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in [0, drafted = {drafted}], got {accepted}")
        self._get(key).add(drafted, accepted, self.decay)
        if key.quality is not None:
            self._get(key.pool).add(drafted, accepted, self.decay)
        self._acceptance.clear()

    def acceptance(self, key: StatsKey, depth: int) -> list[float]:
        """P(position i passes | the positions before it passed), i = 1..depth."""
        depth = min(depth, MAX_DEPTH)
        known = self._acceptance.get((key, depth))
        if known is None:
            known = self._acceptance[(key, depth)] = self._estimate(key, depth)
        return list(known)

    def _estimate(self, key: StatsKey, depth: int) -> list[float]:
        pool = self._shrunk(self._counts.get(key.pool), [self.prior] * depth, self.pool_weight, chained=True)
        if key.quality is None:
            return pool
        return self._shrunk(self._counts.get(key), pool, self.key_weight, chained=False)

    def blocks(self, key: StatsKey) -> float:
        """Decayed number of verified blocks of ``key`` (its evidence)."""
        counts = self._counts.get(key)
        return counts.blocks if counts else 0.0

    def skip(self, key: StatsKey) -> int:
        """Count a block of ``key`` that was not verified; returns how many since one was (or was probed)."""
        counts = self._get(key)
        counts.skipped += 1
        return counts.skipped

    def probe(self, key: StatsKey, interval: int | None = None) -> None:
        """A block of ``key`` is verified to re-measure it: start counting skipped blocks anew (``interval``:
        the next probe's, when the caller backs off)."""
        counts = self._get(key)
        counts.skipped = 0
        if interval is not None:
            counts.interval = interval

    def probe_interval(self, key: StatsKey) -> int:
        """The interval set by the last ``probe`` of ``key`` that set one (0: none)."""
        counts = self._counts.get(key)
        return counts.interval if counts else 0

    def asked(self, pool: StatsKey, quality: Quality | None) -> None:
        """An ask of the free drafter of ``pool`` returned a block of ``quality`` (``free_ask.NO_BLOCK``: none)."""
        self.returns(pool).add(quality)

    def returns(self, pool: StatsKey) -> QualityMix:
        """What asks of the free drafter of ``pool`` returned, every session's (``specsplit.orchestrator.free_ask``)."""
        mix = self._asked.get(pool)
        if mix is None:
            mix = self._asked[pool] = QualityMix(self.decay)
        return mix

    def _get(self, key: StatsKey) -> _Counts:
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = _Counts()
        return counts

    @staticmethod
    def _shrunk(counts: _Counts | None, anchors: list[float], weight: float, chained: bool) -> list[float]:
        """Each position's rate, shrunk towards its anchor (``chained``: the previous position's estimate,
        the first one's anchor being ``anchors[0]``)."""
        out: list[float] = []
        for i, anchor in enumerate(anchors):
            if chained and i > 0:
                anchor = out[-1]
            passed, reached = (counts.passed[i], counts.reached[i]) if counts else (0.0, 0.0)
            out.append((passed + anchor * weight) / (reached + weight))
        return out
