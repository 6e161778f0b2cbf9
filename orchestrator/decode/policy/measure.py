"""What an orchestrator measures for its round decisions: costs, links, acceptance, and probe back-off.

One ``Measurements`` per orchestrator, shared by every session: the target's
forward cost t(x) over x tokens and its load, each drafter's time per token,
each link's round trip (RFC 6298), acceptance per drafter, acceptance rule and
match quality (per block position), what asks of a free drafter returned, and
token-tree siblings' acceptance. Everything here is an online estimate updated
from what the services report; ``policy.model`` prices rounds from it and
``policy.controller`` decides. The estimators and their priors are described in
docs/design.md, "The round model". Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from specsplit.lmkit import token_tree
from specsplit.lmkit.costs import LinearCost
from specsplit.lmkit.kinds import DrafterKind, VerificationMode


# -- the target's load ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """The target's forward that verified a session's last block (B sessions, what the others took of it)."""

    sessions: int = 1
    others_committed: float = 0.0  # tokens the other sessions committed from that forward
    others_tokens: int | None = None  # tokens the other rows took in it, where rows were packed (None: padded)

    def tokens(self, k: int) -> int:
        """Tokens in the forward with this session's block of k: packed rows, the others' and its own k + 1;
        padded rows, every row k + 1 wide."""
        if self.others_tokens is not None:
            return self.others_tokens + k + 1
        return max(self.sessions, 1) * (k + 1)


ALONE = Load()


@dataclass(frozen=True)
class Forward:
    """What the target reported of the forward that verified one block."""

    seconds: float  # the whole (shared) forward's compute time
    tokens: int  # tokens it computed over, every row's (padding included)
    load: Load
    fit: tuple[float, float] = (0.0, 0.0)  # the target's own fit of t(x) = a + s x, seconds; (0, 0): none yet
    prefill: bool = False  # it re-read the context (a session's first round, a reopen): alone by design
    ahead: bool = False  # a draft ask of this session was on its way meanwhile


# -- links ---------------------------------------------------------------------------------------------------------
_SIGMA_PER_MEAN_DEVIATION = math.sqrt(math.pi / 2)  # for a normal variable


@dataclass
class RttEstimator:
    """Smoothed round-trip time and its mean deviation (Jacobson 1988; RFC 6298, sec. 2), in seconds.

    One difference: a sample counts as at most ``bound_s`` (twice the smoothed time plus four deviations, at least
    ``min_bound_s``). A reply that waited out an outage (a partition, a paused process) would otherwise raise the
    estimate by an eighth of the outage, and with it every round's predicted cost: speculation would stay off, and
    with no draft asks no sample would bring it back. A lasting change is still learned: clamped samples at least
    double the bound within a few samples."""

    gain: float = 1 / 8  # alpha in RFC 6298
    var_gain: float = 1 / 4  # beta
    min_bound_s: float = 0.001
    srtt: float = 0.0
    rttvar: float = 0.0
    samples: int = 0

    @property
    def bound_s(self) -> float:
        """The largest a sample counts as."""
        return max(2 * self.srtt + 4 * self.rttvar, self.min_bound_s)

    def observe(self, sample_s: float) -> None:
        r = max(sample_s, 0.0)
        if self.samples == 0:
            self.srtt, self.rttvar = r, r / 2
        else:
            r = min(r, self.bound_s)
            self.rttvar += self.var_gain * (abs(self.srtt - r) - self.rttvar)
            self.srtt += self.gain * (r - self.srtt)
        self.samples += 1

    @property
    def sigma(self) -> float:
        """Standard deviation of a round trip, were it normal."""
        return _SIGMA_PER_MEAN_DEVIATION * self.rttvar


@dataclass
class Links:
    """The draft and target links of one orchestrator: a sample is a call's wall time less the time the service
    says it spent on it (the network and both gRPC stacks)."""

    draft: RttEstimator = field(default_factory=RttEstimator)
    target: RttEstimator = field(default_factory=RttEstimator)


# -- costs ---------------------------------------------------------------------------------------------------------
SAMPLE_BOUND = 4.0  # a cost sample counts as at most this many times the mean so far, per unit
SEED_SAMPLES = 3  # a cost's first samples, whose lower median starts it


@dataclass
class _PerUnit:
    """Decayed seconds over decayed units (tokens drafted, context tokens read); made at its first unit.

    A sample counts as at most ``SAMPLE_BOUND`` times the mean so far, as ``RttEstimator`` bounds a round trip:
    a draft paused or cut off mid-proposal reports the outage as compute, and one such sample would price every
    token of that drafter above a target step; no ask would then go out, and no sample would ever bring the
    price back. A lasting slowdown is still learned, a bounded sample at a time. Before there is a mean to bound
    against, the first ``SEED_SAMPLES`` samples price a unit at their lower median, so an outage in a fresh
    orchestrator's first proposal is not where the price starts; until then the price is not ``settled``
    (``AdaptiveK.ask`` then probes with a whole block, whatever the price says)."""

    seconds: float = 0.0
    units: float = 0.0
    _seeds: list = field(default_factory=list)  # (units, seconds) of the first samples

    @property
    def settled(self) -> bool:
        """Whether the figure rests on ``SEED_SAMPLES`` samples or more."""
        return len(self._seeds) >= SEED_SAMPLES

    def add(self, units: int, seconds: float, decay: float) -> None:
        if not self.settled:
            self._seeds.append((units, seconds))
            self.units = float(sum(u for u, _ in self._seeds))
            self.seconds = statistics.median_low([s / u for u, s in self._seeds]) * self.units
            return
        seconds = min(seconds, SAMPLE_BOUND * units * self.seconds / self.units)
        self.seconds = self.seconds * decay + seconds
        self.units = self.units * decay + units


QUIET_EVERY = 32  # forwards with a draft ask on its way in a row, after which one runs without (quiet_due)


@dataclass
class Costs:
    """The target's forward cost t(x) over x tokens (one-token forwards apart from wider ones), what a draft ask
    on its way adds to a forward, each drafter's time per token and per context token read, the target's latest
    load and the links. One per target, shared by the sessions on it."""

    decay: float = 0.98  # forget old samples slowly: load and context length drift
    verify: LinearCost = field(default_factory=LinearCost)  # every forward
    one: LinearCost = field(default_factory=LinearCost)  # forwards of one token (its mean: x is always 1)
    wide: LinearCost = field(default_factory=LinearCost)  # forwards of two tokens or more
    min_samples: float = 3.0  # forwards of a kind (decayed count) before this orchestrator's own figure is used
    load: Load = ALONE  # the target's last decode forward as any session saw it; where new sessions start
    reported: tuple[float, float] | None = None  # (a, s) as the target last reported its own fit
    links: Links = field(default_factory=Links)
    _draft: dict = field(default_factory=dict)  # drafter -> _PerUnit over the tokens it drafted
    _read: dict = field(default_factory=dict)  # drafter -> _PerUnit over the context tokens it read at opens
    ahead_streak: int = 0  # forwards in a row that ran with a draft ask on its way (quiet_due)
    _excess_s: float = 0.0  # decayed sum of those forwards' seconds over the quiet fit's prediction
    _excess_n: float = 0.0  # decayed count of them

    def __post_init__(self) -> None:
        for fit in (self.verify, self.one, self.wide):
            fit.decay = self.decay

    def observe_verify(self, tokens: int, seconds: float, ahead: bool = False) -> None:
        """A target forward over ``tokens`` tokens (all rows of a batch, padding included) took ``seconds``;
        ``ahead``: a draft ask was on its way meanwhile (it feeds ``ahead_excess_s``, not the fit)."""
        if ahead:
            self.ahead_streak += 1
            if self._quiet_measured(tokens):
                self._excess_s = self._excess_s * self.decay + seconds - self.verify_s(tokens)
                self._excess_n = self._excess_n * self.decay + 1.0
            return
        self.ahead_streak = 0
        self.verify.observe(tokens, seconds)
        self._own(tokens).observe(tokens, seconds)

    def _own(self, tokens: int) -> LinearCost:
        """The fit of forwards of this kind: one token (a mean), or wider (a line over x >= 2)."""
        return self.one if tokens <= 1 else self.wide

    def _quiet_measured(self, tokens: int) -> bool:
        return self._own(tokens).samples >= self.min_samples

    def ahead_excess_s(self) -> float:
        """Seconds a forward takes longer with a draft ask on its way; 0 until measured."""
        if self._excess_n < self.min_samples:
            return 0.0
        return max(self._excess_s / self._excess_n, 0.0)

    def quiet_due(self) -> bool:
        """Whether the next forward should run without a draft ask on its way, to keep the quiet fit current."""
        return self.ahead_streak >= QUIET_EVERY

    def observe_target_fit(self, base_s: float, per_token_s: float) -> None:
        """The target's own fit of t(x); 0, 0 = none yet."""
        if base_s > 0 or per_token_s > 0:
            self.reported = (max(base_s, 0.0), max(per_token_s, 0.0))

    def observe_draft(self, tokens: int, seconds: float, drafter: object = None) -> None:
        """``drafter`` drafted ``tokens`` tokens in ``seconds``."""
        if tokens > 0:
            self._draft.setdefault(drafter, _PerUnit()).add(tokens, seconds, self.decay)

    def observe_read(self, context: int, seconds: float, drafter: object = None) -> None:
        """``drafter`` read a new draft session's ``context`` tokens in ``seconds``."""
        if context > 0:
            self._read.setdefault(drafter, _PerUnit()).add(context, seconds, self.decay)

    def read_s(self, context: int, drafter: object = None) -> float | None:
        """Predicted time of the draft's read of a new session's ``context`` tokens (None before one)."""
        read = self._read.get(drafter)
        return read.seconds / read.units * context if read else None

    def verify_s(self, tokens: int) -> float:
        """Predicted time of a target forward over ``tokens`` tokens: the mean of measured one-token forwards, or
        the line through measured wider ones; before ``min_samples`` of that kind, a + s x as the target fitted
        it (when it sent a fit), else this orchestrator's line through every width."""
        if self._quiet_measured(tokens):
            return self._own(tokens).predict(tokens)
        if self.reported is not None:
            base, slope = self.reported
            return max(base + slope * tokens, 1e-6)
        return self.verify.predict(tokens)

    def step_s(self) -> float | None:
        """A one-token target forward's seconds, once measured or reported; before either, the line through the
        forwards of every width so far (rough: it prices one token high); None before any forward."""
        if self._quiet_measured(1) or self.reported is not None:
            return self.verify_s(1)
        if self.verify.samples > 0:
            return self.verify.predict(1)
        return None

    @property
    def draft_measured(self) -> bool:
        """Whether any drafter has reported its cost yet."""
        return bool(self._draft)

    def draft_s_per_token(self, drafter: object = None) -> float:
        draft = self._draft.get(drafter)
        return draft.seconds / draft.units if draft else 0.0

    def draft_unsettled(self, drafter: object = None) -> bool:
        """Whether ``drafter``'s price per token rests on some proposals but too few to rule it out on price alone
        (before any, it is priced at nothing)."""
        draft = self._draft.get(drafter)
        return draft is not None and not draft.settled


# -- acceptance ----------------------------------------------------------------------------------------------------
LENGTH_BUCKETS = (1, 2, 3, 5, 11)  # match length buckets: 1, 2, 3, 4-5, 6-11, 12+
OCCURRENCE_BUCKETS = (1,)  # one earlier occurrence, or several
MAX_DEPTH = 64  # positions kept per key


def _bucket(value: int, bounds: tuple[int, ...]) -> int:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return len(bounds)


@dataclass(frozen=True)
class AcceptRule:
    """How the target accepts a draft token, as far as acceptance rates go: the verification mode and (when
    sampling) the temperature; sampled verification accepts a copied token with p(x), not when it is the argmax."""

    mode: VerificationMode
    temperature: float = 0.0  # rounded to 0.1 for the key

    @classmethod
    def of(cls, mode: VerificationMode, temperature: float) -> AcceptRule:
        return cls(mode, 0.0 if mode is VerificationMode.GREEDY else round(temperature, 1))


@dataclass(frozen=True)
class Quality:
    """A copied block's match quality in buckets (``quality_of``)."""

    length: int
    occurrences: int


def quality_of(length: int, occurrences: int) -> Quality:
    """Bucket a reported match (length of the match behind the copy, earlier occurrences of the n-gram)."""
    return Quality(_bucket(max(length, 1), LENGTH_BUCKETS), _bucket(max(occurrences, 1), OCCURRENCE_BUCKETS))


NO_BLOCK = None  # an ask of a free drafter that returned no block (nothing in the context matched)


@dataclass(frozen=True)
class StatsKey:
    drafter: DrafterKind
    rule: AcceptRule
    quality: Quality | None = None  # None: blocks without a reported quality (model drafters)

    @property
    def pool(self) -> StatsKey:
        return StatsKey(self.drafter, self.rule)


@dataclass
class Backoff:
    """Rounds a drafter was not asked (or a quality's blocks not verified) since it last was, and the interval
    before the next probe; counted over every session's rounds, since sessions may be short."""

    skipped: int = 0
    interval: int = 0  # rounds before the next probe; 0: not set yet (the caller's first interval)

    def skip(self, every: int, sessions: int) -> bool:
        """Count one more round without it; True when a probe is due (``sessions``: a probe widens every row of
        a batched forward, so the interval is per session)."""
        self.skipped += 1
        self.interval = self.interval or every
        return self.skipped >= self.interval * max(sessions, 1)

    def probed(self, every: int, longest: int) -> None:
        """A probe goes out: count afresh, and wait twice as long before the next one, up to ``longest``."""
        self.skipped = 0
        self.interval = min(2 * (self.interval or every), longest)

    def paid(self, every: int) -> None:
        """Drafting pays again: count afresh from the first interval."""
        self.skipped, self.interval = 0, every


@dataclass
class QualityMix:
    """Decayed counts of what asks of a free drafter returned: a ``Quality``, or ``NO_BLOCK``."""

    decay: float
    counts: dict[Quality | None, float] = field(default_factory=dict)

    def add(self, quality: Quality | None) -> None:
        for key in self.counts:
            self.counts[key] *= self.decay
        self.counts[quality] = self.counts.get(quality, 0.0) + 1.0

    @property
    def total(self) -> float:
        return sum(self.counts.values())

    def shares(self, anchor: QualityMix | None = None, weight: float = 0.0) -> dict[Quality | None, float]:
        """Each return's share, these counts shrunk towards ``anchor``'s shares by ``weight`` pseudo-asks (empty
        when neither has counts)."""
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


@dataclass
class _Counts:
    """Decayed counts per position: blocks that reached it, and of those, how many passed it."""

    reached: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    passed: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    blocks: float = 0.0

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self.blocks = self.blocks * decay + 1
        for i in range(min(drafted, accepted + 1, MAX_DEPTH)):  # the positions the verifier looked at
            self.reached[i] = self.reached[i] * decay + 1
            self.passed[i] = self.passed[i] * decay + (1 if i < accepted else 0)


@dataclass
class AcceptanceStats:
    """P(position i passes | the positions before it passed) per key, from every verified block of every session.

    Thin evidence is shrunk: a key's position i leans on its pool's position i (same drafter and rule, all
    qualities), and the pool's position i on its position i - 1 (the first on ``prior``)."""

    prior: float = 0.5  # P(first position passes) before any evidence
    pool_weight: float = 2.0  # pseudo-observations behind a pool's anchor, per position
    key_weight: float = 4.0  # pseudo-observations behind a key's anchor (its pool), per position
    decay: float = 0.998  # per block of the same key: traffic drifts, slowly
    _counts: dict[StatsKey, _Counts] = field(default_factory=dict, init=False)
    _asked: dict[StatsKey, QualityMix] = field(default_factory=dict, init=False)  # pool -> what asks returned
    _backoffs: dict[StatsKey, Backoff] = field(default_factory=dict, init=False)  # blocks of a key not verified
    _ask_backoffs: dict[StatsKey, Backoff] = field(default_factory=dict, init=False)  # pool -> rounds not asked
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
        for counted in (key, key.pool) if key.quality is not None else (key,):
            self._counts.setdefault(counted, _Counts()).add(drafted, accepted, self.decay)
            self.backoff(counted).skipped = 0
        self._acceptance.clear()

    def acceptance(self, key: StatsKey, depth: int) -> list[float]:
        """P(position i passes | the positions before it passed), i = 1..depth (a new list each call)."""
        depth = min(depth, MAX_DEPTH)
        known = self._acceptance.get((key, depth))
        if known is None:
            known = self._acceptance[(key, depth)] = self._estimate(key, depth)
        return list(known)

    def _estimate(self, key: StatsKey, depth: int) -> list[float]:
        pool = _shrunk(self._counts.get(key.pool), [self.prior] * depth, self.pool_weight, chained=True)
        if key.quality is None:
            return pool
        return _shrunk(self._counts.get(key), pool, self.key_weight, chained=False)

    def blocks(self, key: StatsKey) -> float:
        """Decayed number of verified blocks of ``key`` (its evidence)."""
        counts = self._counts.get(key)
        return counts.blocks if counts else 0.0

    def backoff(self, key: StatsKey) -> Backoff:
        """The probe back-off of blocks of ``key`` (a paid drafter's pool, or a free drafter's quality)."""
        return self._backoffs.setdefault(key, Backoff())

    def ask_backoff(self, pool: StatsKey) -> Backoff:
        """The probe back-off of asks of the free drafter of ``pool``."""
        return self._ask_backoffs.setdefault(pool, Backoff())

    def asked(self, pool: StatsKey, quality: Quality | None) -> None:
        """An ask of the free drafter of ``pool`` returned a block of ``quality`` (``NO_BLOCK``: none)."""
        self.returns(pool).add(quality)

    def returns(self, pool: StatsKey) -> QualityMix:
        """What asks of the free drafter of ``pool`` returned, every session's."""
        mix = self._asked.get(pool)
        if mix is None:
            mix = self._asked[pool] = QualityMix(self.decay)
        return mix


def _shrunk(counts: _Counts | None, anchors: list[float], weight: float, chained: bool) -> list[float]:
    """Each position's rate, shrunk towards its anchor (``chained``: the previous position's estimate, the first
    one's anchor being ``anchors[0]``)."""
    out: list[float] = []
    for i, anchor in enumerate(anchors):
        if chained and i > 0:
            anchor = out[-1]
        passed, reached = (counts.passed[i], counts.reached[i]) if counts else (0.0, 0.0)
        out.append((passed + anchor * weight) / (reached + weight))
    return out


@dataclass
class SiblingStats:
    """P(a later sibling in a token tree is accepted | its parent was), by sibling rank and depth, learned from
    verdicts; first children are the chain's (``AcceptanceStats``). Shared by a drafter kind's sessions."""

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


@dataclass
class Measurements:
    """Everything one orchestrator measures for its round decisions, shared by its sessions."""

    costs: Costs = field(default_factory=Costs)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    siblings: dict[DrafterKind, SiblingStats] = field(default_factory=dict)  # per drafter kind

    def siblings_of(self, drafter: DrafterKind | None) -> SiblingStats:
        return self.siblings.setdefault(drafter, SiblingStats())
