"""Choosing K per round from server-wide acceptance statistics, the round model and the target's load.

Two choices, both maximising the round model's rate (``specsplit.orchestrator.rate``):

* **ask**: how many tokens to ask of a drafter that pays per token (a model),
  before it drafts. Acceptance is the session's own per-position record, shrunk
  towards what every session measured for that drafter and verification
  (``specsplit.orchestrator.acceptance``): a new session starts from the server's
  figures, and its own rounds take over as they come (acceptance comes in runs).
* **cut**: how many tokens of a block that cost nothing to make (prompt lookup
  drafts up to the free bound) to verify. Acceptance is the server-wide
  record of blocks of the same match quality, so a new session cuts as well
  as a warm one, scaled by how this session's own blocks passed against what
  that record predicted for them (traffic whose copies fail at qualities where
  others' pass, such as records reformatted with new values after copied keys,
  stops verifying them after a few misses). The cut depends only on the
  block's quality (a function of the committed context) and the statistics
  (of blocks already verified), never on the draws of the positions it
  covers, so sampled verification stays lossless.

* **ask_free**: whether to ask a free drafter at all this round. Its block
  costs nothing to make, but the ask costs the draft link's round trip in
  sync (and a fresh ask after a miss with overlap), or what of it outlasts the
  verification when sent ahead. It is asked when the block its asks have
  returned (this session's recent returns shrunk towards every session's:
  ``specsplit.orchestrator.free_ask``) is expected to save more than that, priced by the
  same server-wide acceptance per match quality and ``free_scale`` as ``cut``.
  Not asked, the round is a target-only step: no draft request at all. The
  decision depends only on what earlier asks returned and on blocks already
  verified, never on the draws of the positions it covers: lossless.

A choice of 0 stops measuring what it skips. A drafter asked for nothing is
asked for one token after ``probe_every`` such rounds (times the batch size: a
probe widens every row of a batched forward; the interval doubles after each
probe that leaves the choice at 0, up to ``probe_backoff`` times, and is reset
when drafting pays again: a drafter that never pays here, such as an EAGLE head
on a CPU target, costs ever fewer probes). Those rounds and the interval are
counted server-wide, over every session's rounds: sessions may be short, and
a probe measures the drafter for all of them (a model drafter reads a new
session's context right after the open, so a probe finds it read unless it
comes first). A quality cut to nothing is verified for one token after
``probe_every`` such blocks server-wide; a free drafter not asked is asked
again on the same backoff as a paid one's probes, counted over every session's
rounds (before a verification only). None probes where even drafts passing
``probe_alpha`` of the time would not pay in the session's best mode: a
session that may overlap probes in its sync rounds too, since where overlap
stopped because acceptance fell, only a probe can start it again.

Overlap: ``ahead_pays`` says whether drafting the next block during the
verification beats drafting it after, from the same round model with the
links' round trips and jitter (``CostModel.links``): a long draft round trip
favours overlap, a draft slower than the verification does not.

Pure: no I/O. The loop feeds it the services' reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.acceptance import AcceptanceStats, Quality, StatsKey, Verification
from specsplit.orchestrator.free_ask import QualityMix, best_saving_s
from specsplit.orchestrator.rate import ALONE, CostModel, Load, best_k, chain_rate


@dataclass
class AdaptiveK:
    """Per-session K controller over the orchestrator's shared statistics and costs."""

    k_max: int
    costs: CostModel
    stats: AcceptanceStats
    verification: Verification
    paid: DrafterKind | None = None  # the session's drafter that pays per token (None: all its drafters are free)
    overlap: bool = False  # the session may draft a block during the verification before it (LoopConfig.overlap)
    session_weight: float = 4.0  # pseudo-observations behind the server-wide figures, per position
    decay: float = 0.8  # this session's own record: recent rounds dominate (acceptance comes in runs)
    probe_every: int = 8
    probe_alpha: float = 0.9  # probe only where drafts this good would pay
    probe_backoff: int = 8  # the probe interval grows to at most this many times probe_every
    free_weight: float = 2.0  # pseudo-positions behind the server's figures for this session's free blocks
    free_decay: float = 0.95  # per position of this session's free blocks
    returns_decay: float = 0.7  # this session's record of what its asks of a free drafter returned: recent ones
    returns_weight: float = 2.0  # pseudo-asks behind every session's record of those returns
    _passed: list[float] = field(default_factory=list, init=False)
    _reached: list[float] = field(default_factory=list, init=False)
    _free_passed: float = field(default=0.0, init=False)  # positions of this session's free blocks that passed
    _free_expected: float = field(default=0.0, init=False)  # how many the server-wide figures predicted would
    _returns: QualityMix = field(default=None, init=False)  # what this session's asks of a free drafter returned

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        self._passed = [0.0] * self.k_max
        self._reached = [0.0] * self.k_max
        self._returns = QualityMix(self.returns_decay)

    def key(self, drafter: DrafterKind, quality=None) -> StatsKey:
        return StatsKey(drafter, self.verification, quality)

    # -- a drafter that pays per token ------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """P(position i passes | the positions before it passed), i = 1..k_max, for the paid drafter's blocks:
        this session's record shrunk towards the server-wide one."""
        if self.paid is None:
            return [0.0] * self.k_max
        server = self.stats.acceptance(self.key(self.paid), self.k_max)
        w = self.session_weight
        return [(p + s * w) / (r + w) for p, r, s in zip(self._passed, self._reached, server)]

    def ask(self, limit: int, load: Load = ALONE, overlap: bool = False) -> int:
        """Tokens to ask of the paid drafter this round, in [0, min(k_max, limit)]."""
        limit = min(limit, self.k_max)
        if self.paid is None or limit <= 0:
            return 0
        accept = self.acceptance()
        draft_s = self.costs.draft_s_per_token(self.paid)
        k = best_k(accept, limit, self.costs, load, overlap, draft_s)
        key = self.key(self.paid)  # its rounds at 0 and probe interval are every session's (module docstring)
        if k > 0:
            self.stats.probe(key, interval=self.probe_every)
            return k
        interval = self.stats.probe_interval(key) or self.probe_every
        due = self.stats.skip(key) >= interval * max(load.sessions, 1)
        # in the session's best mode, not only this round's (module docstring)
        if due and best_k([self.probe_alpha] * limit, limit, self.costs, load, overlap or self.overlap, draft_s) > 0:
            self.stats.probe(key, interval=min(2 * interval, self.probe_backoff * self.probe_every))
            return 1
        return 0

    def ahead_pays(self, load: Load = ALONE) -> bool:
        """Whether drafting the next block during verification beats drafting it after (overlap depth 1 vs 0).
        Free drafters cost nothing to draft ahead: a session with no paid drafter always does."""
        if self.paid is None:
            return True
        accept, draft_s = self.acceptance(), self.costs.draft_s_per_token(self.paid)
        ahead = best_k(accept, self.k_max, self.costs, load, True, draft_s)
        return ahead > 0 and chain_rate(ahead, accept, self.costs, load, True, draft_s) >= max(
            chain_rate(k, accept, self.costs, load, False, draft_s) for k in range(self.k_max + 1))

    # -- a block drafted for free -----------------------------------------------------------------------
    def cut(self, key: StatsKey, available: int, load: Load = ALONE) -> int:
        """Tokens to verify of a free block of ``key`` with ``available`` tokens, in [0, available].

        The block is in hand: the draft's round trip is paid whatever the cut, so only the target's forward
        weighs against the tokens it may add."""
        available = min(available, self.k_max)
        if available <= 0:
            return 0
        k = best_k(self.free_acceptance(key, available), available, self.costs, load, in_hand=True)
        if k > 0:
            return k
        due = self.stats.skip(key) >= self.probe_every * max(load.sessions, 1)
        if due and best_k([self.probe_alpha] * available, available, self.costs, load, in_hand=True) > 0:
            self.stats.probe(key)
            return 1
        return 0

    def ask_free(self, drafter: DrafterKind, limit: int, load: Load = ALONE, during: int | None = None,
                 hit: float = 1.0) -> bool:
        """Whether to ask the free ``drafter`` for a block of up to ``limit`` tokens (the module docstring).

        ``during``: the ask goes ahead, during the verification of a block of this many tokens, and its block is
        used with probability ``hit``; None: it goes before this round's verification, and a no counts towards
        the next probe."""
        limit = min(limit, self.k_max)
        if limit <= 0:
            return False
        compute_s = limit * self.costs.draft_s_per_token(drafter)
        during_s = None if during is None else self.costs.verify_s(load.tokens(during)) + self.costs.links.target.srtt
        cost = self.costs.links.ask_s(compute_s, during_s, self.costs.ahead_excess_s())
        needed = cost if during is None else (cost / hit if hit > 0 else float("inf"))
        saving = self.free_saving_s(drafter, limit, load, needed)
        server = self.stats.returns(self.key(drafter))  # probes are counted server-wide: sessions may be short
        if during is not None:  # ahead only where cheaper than asking after the verification (module docstring)
            return (saving is None or hit * saving > cost) and cost <= hit * self.costs.links.ask_s(compute_s)
        if saving is None or saving > cost:
            server.unasked, server.interval = 0, self.probe_every
            return True
        server.unasked += 1
        server.interval = server.interval or self.probe_every
        if server.unasked < server.interval * max(load.sessions, 1):
            return False
        if self.saving_s([self.probe_alpha] * limit, limit, load) <= cost:
            return False
        server.unasked = 0
        server.interval = min(2 * server.interval, self.probe_backoff * self.probe_every)
        return True

    def free_saving_s(self, drafter: DrafterKind, limit: int, load: Load = ALONE,
                      needed: float | None = None) -> float | None:
        """Expected seconds an ask of the free ``drafter`` saves against a target-only step: the mean over what
        asks returned of each block's best cut (``free_ask.best_saving_s``); None before any ask returned.

        ``needed``: the caller only asks whether the saving exceeds this. Where even blocks that passed whole,
        at every return's share, would not save more (a loaded target, where drafting is off), that bound is
        returned instead, without pricing each quality: the same answer for one saving's price, not a dozen."""
        shares = self._returns.shares(self.stats.returns(self.key(drafter)), self.returns_weight)
        if not shares:
            return None
        found = {quality: share for quality, share in shares.items() if quality is not None and share > 1e-3}
        rounds = self._rounds_in_hand_s(limit, load)  # the same for every quality: computed once a decision
        if needed is not None:
            bound = sum(found.values()) * self.saving_s([1.0] * limit, limit, load, rounds)
            if bound <= needed:
                return bound
        return sum(share * self.saving_s(self.free_acceptance(self.key(drafter, quality), limit), limit, load, rounds)
                   for quality, share in found.items())

    def saving_s(self, accept: list[float], limit: int, load: Load, rounds: list[float] | None = None) -> float:
        """Seconds a block in hand with acceptance ``accept`` saves at its best cut against a target-only step;
        ``rounds``: ``_rounds_in_hand_s(limit, load)`` when the caller has it."""
        rounds = rounds if rounds is not None else self._rounds_in_hand_s(limit, load)
        return best_saving_s(accept[:limit], rounds[0], rounds.__getitem__, load.others_committed)

    def _rounds_in_hand_s(self, limit: int, load: Load) -> list[float]:
        """The round with a block in hand cut to k, for k = 0..limit."""
        links, costs = self.costs.links, self.costs
        return [links.round_s(k, costs.verify_s(load.tokens(k)), 0.0, 1.0, False, in_hand=True)
                for k in range(limit + 1)]

    def asked_free(self, drafter: DrafterKind, quality: Quality | None) -> None:
        """An ask of the free ``drafter`` returned a block of ``quality`` (``free_ask.NO_BLOCK``: none)."""
        self._returns.add(quality)
        self.stats.asked(self.key(drafter), quality)

    def free_acceptance(self, key: StatsKey, n: int) -> list[float]:
        """Acceptance of positions 1..n of a free block of ``key``: the server-wide figures scaled by
        ``free_scale``."""
        scale = self.free_scale()
        return [min(p * scale, 1.0) for p in self.stats.acceptance(key, n)]

    def free_scale(self) -> float:
        """This session's free blocks: positions passed over positions the server-wide figures predicted would
        pass, both shrunk by ``free_weight`` (1 before any block)."""
        w = self.free_weight
        return (self._free_passed + w) / (self._free_expected + w)

    # -- every verified block -------------------------------------------------------------------------------
    def observe(self, key: StatsKey, drafted: int, accepted: int) -> None:
        """A verified block: ``accepted`` of its ``drafted`` tokens passed (a rejection ends it)."""
        if key.quality is not None and drafted > 0:  # a free block: how it did against the server's figures
            predicted = self.stats.acceptance(key, drafted)
            for i in range(min(drafted, accepted + 1)):
                self._free_expected = self._free_expected * self.free_decay + predicted[i]
                self._free_passed = self._free_passed * self.free_decay + (1 if i < accepted else 0)
        self.stats.observe(key, drafted, accepted)
        if key.drafter is not self.paid or key.quality is not None:
            return
        for i in range(min(drafted, accepted + 1, self.k_max)):  # positions the verifier looked at
            self._reached[i] = self._reached[i] * self.decay + 1
            self._passed[i] = self._passed[i] * self.decay + (1 if i < accepted else 0)
