"""The round model: what a speculative round costs, what it brings, and the block size that pays best.

Leviathan et al. 2023 (sec. 3.3-3.4): with per-token acceptance rate alpha, a
block of k draft tokens yields on average E(k) = (1 - alpha^(k+1)) / (1 - alpha)
committed tokens per target pass. With acceptance measured per position
(p_i: position i passes given all before it did), E(k) = 1 + sum_i prod_{j<=i} p_j,
which is Leviathan's E(k) when every p_i = alpha. A target forward over x
tokens costs t(x) = a + s x (the target's own fit of every forward it ran, or
the orchestrator's fit of the times it reported; on CPUs s matters: verifying
8 tokens costs ~2 decode steps there).

One token is not the start of the line: on a CPU a forward over one token
runs matrix-vector products, and any wider forward matrix-matrix ones, so the
step from 1 to 2 tokens can cost most of a decode step while each token after
it costs little (t(1) = 65 ms, t(2) = 120 ms, t(9) = 142 ms for SmolLM2 on
this machine's two threads). A line through every width prices a one-token
block far below its cost and a long one above it. ``CostModel`` therefore
keeps one-token forwards apart (a mean) from wider ones (a line over x >= 2),
each from the forwards this orchestrator measured, and uses the target's
reported line only until it has measured forwards of that kind.

Load (continuous batching): the target reports the forward that verified the
last block: B sessions, the tokens G_o the other sessions committed from it,
and whether its rows were packed end to end or padded to the longest. Packed
(the target's own forward, ``specsplit.lmkit.packed_rows``), a block of k adds its k + 1
tokens to the X_o the other rows took: the forward costs t(X_o + k + 1).
Padded (models that forward cannot run), a block of k makes every row k + 1
wide: t(B (k + 1)). A round's rate is the tokens everyone gets per unit time,

    (G_o + E(k)) / round_seconds,    round_seconds = t(X(k)) + drafting not hidden.

Alone (B = 1, G_o = 0) this is Leviathan's E(k) / T(k). Under load a block
pays for the tokens it adds to a forward every session waits for: when the
target is saturated (s x >> a) a drafted token costs nearly what a committed
one does, so speculation stops unless drafts pass nearly always; it never
makes everyone slower, and it returns when the load falls.

Overlap: when drafting runs during verification, drafting the next block is
hidden unless it takes longer than the verification, and paid in full only
when the speculation misses (the block is not accepted whole, or the bonus
token was guessed wrong: probability 1 - prod p_i over the k + 1 positions).

Draft asks during a forward: where the draft, the orchestrator and the target
share CPU cores, handling an ask sent ahead takes cycles from the forward it
overlaps (on 2 cores a few milliseconds a forward, far more than the draft's
own compute). ``CostModel`` measures it: the mean excess of the forwards that
ran with one of this orchestrator's asks on its way over its fit of forwards
without (``ahead_excess_s``; 0 on separate devices, and until both are
measured). An overlapped round pays it on top of the forward, and so does a
free drafter's ask sent ahead (``LinkCosts.ask_s``). So that the quiet fit
stays current, after ``QUIET_EVERY`` forwards with an ask in a row the next
one runs without (``quiet_due``).

Links: a round also pays the draft's and the target's round trips, measured
per link with their jitter (``CostModel.links``, ``specsplit.orchestrator.link_cost``,
which gives the time of a round); a long target round trip favours longer
blocks, a long draft round trip favours overlap, and where neither pays the
choice is k = 0. With no samples the links cost nothing.

Other shapes (token trees) reuse the same parts: ``expected_tokens_by_position``
for a path, ``CostModel.verify_s`` for a forward of any size, ``round_seconds``
for a round and ``rate``. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specsplit.lmkit.costs import LinearCost
from specsplit.orchestrator.link_cost import LinkCosts


@dataclass(frozen=True)
class Load:
    """The target's forward that verified a session's last block (``VerifyResult.forward``)."""

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


@dataclass
class _PerUnit:
    """Decayed seconds over decayed units (tokens drafted, context tokens read); made at its first unit."""

    seconds: float = 0.0
    units: float = 0.0

    def add(self, units: int, seconds: float, decay: float) -> None:
        self.seconds = self.seconds * decay + seconds
        self.units = self.units * decay + units


QUIET_EVERY = 32  # forwards with a draft ask on its way in a row, after which one runs without (quiet_due)


@dataclass
class CostModel:
    """The target's forward cost t(x) = a + s x over x tokens, each drafter's time per token, and the
    target's latest load. One per target, shared by the sessions on it."""

    decay: float = 0.98  # forget old samples slowly: load and context length drift
    verify: LinearCost = field(default_factory=LinearCost)  # every forward
    one: LinearCost = field(default_factory=LinearCost)  # forwards of one token (its mean: x is always 1)
    wide: LinearCost = field(default_factory=LinearCost)  # forwards of two tokens or more
    min_samples: float = 3.0  # forwards of a kind (decayed count) before this orchestrator's own figure is used
    load: Load = ALONE  # the target's last decode forward as any session saw it; where new sessions start
    reported: tuple[float, float] | None = None  # (a, s) as the target last reported its own fit
    links: LinkCosts = field(default_factory=LinkCosts)  # the draft and target links' round trips
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
        ``ahead``: a draft ask of this orchestrator was on its way meanwhile (it feeds ``ahead_excess_s``,
        not the fit of forwards)."""
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
        """Seconds a forward takes longer with a draft ask on its way (the module docstring); 0 until measured."""
        if self._excess_n < self.min_samples:
            return 0.0
        return max(self._excess_s / self._excess_n, 0.0)

    def quiet_due(self) -> bool:
        """Whether the next forward should run without a draft ask on its way, to keep the quiet fit current."""
        return self.ahead_streak >= QUIET_EVERY

    def observe_target_fit(self, base_s: float, per_token_s: float) -> None:
        """The target's own fit of t(x) (``VerifyResult.forward.cost_base_us``, ``cost_per_token_us``); 0, 0 = none yet."""
        if base_s > 0 or per_token_s > 0:
            self.reported = (max(base_s, 0.0), max(per_token_s, 0.0))

    def observe_draft(self, tokens: int, seconds: float, drafter: object = None) -> None:
        """``drafter`` drafted ``tokens`` tokens in ``seconds``."""
        if tokens > 0:
            self._draft.setdefault(drafter, _PerUnit()).add(tokens, seconds, self.decay)

    def observe_read(self, context: int, seconds: float, drafter: object = None) -> None:
        """``drafter`` read a new draft session's ``context`` tokens in ``seconds`` (``DraftBlock.timing.read_us``; from
        a service that does not report it, the session's first proposal's whole time)."""
        if context > 0:
            self._read.setdefault(drafter, _PerUnit()).add(context, seconds, self.decay)

    def read_s(self, context: int, drafter: object = None) -> float | None:
        """Predicted time of the draft's read of a new session's ``context`` tokens (None before one was
        measured)."""
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
        """A one-token target forward's seconds, once measured here or reported by the target; before either,
        the line through the forwards of every width measured so far (rough: from wider forwards it prices one
        token high); None before any forward was measured."""
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


def expected_tokens(alpha: float, k: int) -> float:
    """E(k): committed tokens per target pass for i.i.d. acceptance alpha (Leviathan eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_by_position(accept: Sequence[float], k: int) -> float:
    """E(k) when position i is accepted with probability accept[i-1] given all before it were:
    1 + sum_{i<=k} prod_{j<=i} accept[j-1]. Equal to ``expected_tokens`` when every entry is alpha."""
    total, run = 1.0, 1.0
    for p in accept[:k]:
        run *= p
        total += run
    return total


def whole_probability(accept: Sequence[float], n: int) -> float:
    """P(the first n positions all pass); positions past the list repeat its last entry."""
    whole = 1.0
    for i in range(n):
        whole *= accept[min(i, len(accept) - 1)] if accept else 0.0
    return whole


def round_seconds(costs: CostModel, forward_tokens: int, draft_s_per_token: float, k: int, overlap: bool,
                  hit: float, in_hand: bool = False) -> float:
    """Seconds of a round whose forward holds ``forward_tokens`` tokens and whose block has k drafted tokens.

    Sync: drafting k tokens, then the forward. Overlap: the next block (k + 1
    tokens with the bonus guess) is drafted during the forward, so only the part
    longer than the forward shows, plus a fresh block when the speculation
    misses (probability 1 - ``hit``). Both include the links' round trips
    (``LinkCosts.round_s``; nothing before a link has samples). ``in_hand``: the
    block is drafted already (a free block being cut), its draft round trip paid.
    """
    return costs.links.round_s(k, costs.verify_s(forward_tokens), draft_s_per_token, hit, overlap, in_hand,
                               costs.ahead_excess_s())


def rate(expected: float, seconds: float, load: Load = ALONE) -> float:
    """Committed tokens per second over every session in the forward."""
    return (load.others_committed + expected) / seconds


def chain_rate(k: int, accept: Sequence[float], costs: CostModel, load: Load = ALONE, overlap: bool = False,
               draft_s_per_token: float = 0.0, in_hand: bool = False) -> float:
    """The rate of a chain block of k tokens with per-position acceptance ``accept``."""
    hit = whole_probability(accept, k + 1)
    seconds = round_seconds(costs, load.tokens(k), draft_s_per_token, k, overlap, hit, in_hand)
    return rate(expected_tokens_by_position(accept, k), seconds, load)


def best_k(accept: Sequence[float], k_max: int, costs: CostModel, load: Load = ALONE, overlap: bool = False,
           draft_s_per_token: float = 0.0, in_hand: bool = False) -> int:
    """The block size in [0, k_max] with the highest rate (ties: the smaller); ``in_hand``: of a block drafted
    already, whose draft round trip every k pays alike."""
    rates = [chain_rate(k, accept, costs, load, overlap, draft_s_per_token, in_hand) for k in range(k_max + 1)]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))
