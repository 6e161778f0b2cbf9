"""Choosing K per round from measured acceptance, measured costs and the target's load.

Leviathan et al. 2023 (sec. 3.3-3.4): with per-token acceptance rate alpha, a
block of k draft tokens yields on average E(k) = (1 - alpha^(k+1)) / (1 - alpha)
committed tokens per target pass. We measure acceptance per position instead
(p_i: position i passes given all before it did), E(k) = 1 + sum_i prod_{j<=i} p_j,
which is Leviathan's E(k) when every p_i = alpha. A target forward over x tokens costs
t(x) = a + s x (fitted from reported compute times; on CPUs s matters:
verifying 8 tokens costs ~2 decode steps there).

Load (continuous batching): the target reports the forward that verified the
last block: B sessions, and the tokens G_o the other sessions committed from
it. A session starts from the load the orchestrator last saw on the target
(its own prefill runs alone and says nothing about the batch). Rows are
padded to the longest, so a block of k makes every row k + 1 wide: the
forward costs t(B (k + 1)). We pick the k in [0, k_max] that
maximises the tokens everyone gets per unit time,

    (G_o + E(k)) / (t(B (k + 1)) + draft time(k)).

Alone (B = 1, G_o = 0) this is Leviathan's E(k) / T(k). Under load, a block
must pay for the padding it puts on every other row: when the target is
saturated (t = a + s x with s x >> a) speculation stops unless drafts pass
nearly always, so it never makes everyone slower, and it returns when the
load falls. (Costing a block against the others' current width instead makes
a block within it look free, and a batch stays stuck with everyone
speculating; docs/performance.md has the figures.)

Overlap: when drafting runs during verification, drafting the next block is
hidden unless it takes longer than the verification, and paid in full only
when the speculation misses (the block is not accepted whole, or the bonus
token was guessed wrong: probability 1 - alpha^(k+1)).

Links: a round also pays the draft's and the target's round trips, measured
per link with their jitter (``orchestrator.link_cost``, which gives the time
of a round); a long target round trip favours longer blocks, a long draft
round trip favours overlap, and where neither pays the choice is k = 0.

Pure: no I/O. The orchestrator feeds it the services' reported compute times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from lmkit.costs import LinearCost
from orchestrator.link_cost import LinkCosts


@dataclass(frozen=True)
class Load:
    """The target's forward that verified a session's last block (``VerifyResult.batch_size``)."""

    sessions: int = 1
    others_committed: float = 0.0  # tokens the other sessions committed from that forward

    def tokens(self, k: int) -> int:
        """Tokens in the forward when this session's block of k sets the (padded) row width."""
        return max(self.sessions, 1) * (k + 1)


ALONE = Load()


@dataclass
class CostModel:
    """The target's forward cost t(x) = a + s x over x tokens, the draft's time per token, and the
    target's latest load. One per target, shared by the sessions on it."""

    decay: float = 0.98  # forget old samples slowly: load and context length drift
    verify: LinearCost = field(default_factory=LinearCost)
    load: Load = ALONE  # the target's last decode forward as any session saw it; where new sessions start
    links: LinkCosts = field(default_factory=LinkCosts)  # the draft and target links' round trips
    _draft_s: float = 0.0
    _draft_tokens: float = 0.0

    def __post_init__(self) -> None:
        self.verify.decay = self.decay

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A target forward over ``tokens`` tokens (all rows of a batch, padding included) took ``seconds``."""
        self.verify.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._draft_s = self._draft_s * self.decay + seconds
            self._draft_tokens = self._draft_tokens * self.decay + tokens

    def verify_s(self, tokens: int) -> float:
        """Predicted time of a target forward over ``tokens`` tokens; a + s x with s >= 0."""
        return self.verify.predict(tokens)

    @property
    def draft_measured(self) -> bool:
        """Whether a draft has reported its cost yet."""
        return self._draft_tokens > 0

    def draft_s_per_token(self) -> float:
        return self._draft_s / self._draft_tokens if self._draft_tokens else 0.0


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


@dataclass
class AdaptiveK:
    """Per-session K controller.

    Acceptance is measured per draft position, conditional on the positions
    before it having passed: drafts come in runs (a copy span accepts token
    after token; no match proposes nothing), so the i.i.d. alpha of Leviathan's
    model underrates long blocks exactly where they pay.
    """

    k_max: int
    costs: CostModel
    prior_alpha: float = 0.6
    prior_weight: float = 2.0  # pseudo-observations behind the prior, per position
    decay: float = 0.8  # recent rounds dominate: acceptance comes in runs (copy spans)
    probe_every: int = 8  # after this many k = 0 rounds (times the batch size), try k = 1 to re-measure acceptance
    probe_alpha: float = 0.9  # probe only where drafts this good would pay
    _passed: list[float] = field(default_factory=list, init=False)
    _reached: list[float] = field(default_factory=list, init=False)
    _rounds_at_zero: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        self._passed = [0.0] * self.k_max
        self._reached = [0.0] * self.k_max

    def acceptance(self) -> list[float]:
        """P(position i passes | positions before it passed), i = 1..k_max.

        Each position is shrunk towards the one before it (the first towards
        ``prior_alpha``): deep positions are reached rarely, and a run that
        has passed so far tends to go on.
        """
        w, prior, out = self.prior_weight, self.prior_alpha, []
        for passed, reached in zip(self._passed, self._reached):
            prior = (passed + prior * w) / (reached + w)
            out.append(prior)
        return out

    @property
    def alpha(self) -> float:
        """Acceptance of the first draft position."""
        return self.acceptance()[0] if self.k_max else self.prior_alpha

    def observe(self, drafted: int, accepted: int) -> None:
        """One round: ``accepted`` of ``drafted`` passed (a rejection ends the block)."""
        for i in range(min(drafted, accepted + 1, self.k_max)):  # positions the verifier looked at
            self._reached[i] = self._reached[i] * self.decay + 1
            self._passed[i] = self._passed[i] * self.decay + (1 if i < accepted else 0)

    def rate(self, k: int, accept: Sequence[float], load: Load = ALONE, overlap: bool = False) -> float:
        """Expected committed tokens per second, over all sessions in the forward, for a block of k."""
        verify = self.costs.verify_s(load.tokens(k))
        whole = 1.0
        for p in accept[:k]:
            whole *= p
        hit = whole * accept[min(k, len(accept) - 1)] if accept else 0.0  # block whole and bonus guessed
        round_s = self.costs.links.round_s(k, verify, self.costs.draft_s_per_token(), hit, overlap)
        return (load.others_committed + expected_tokens_by_position(accept, k)) / round_s

    def best(self, accept: Sequence[float], load: Load = ALONE, overlap: bool = False) -> int:
        rates = [self.rate(k, accept, load, overlap) for k in range(self.k_max + 1)]
        return max(range(len(rates)), key=lambda k: (rates[k], -k))  # ties: the smaller block

    def ahead_pays(self, load: Load = ALONE) -> bool:
        """Whether drafting the next block during verification beats drafting it after (overlap depth 1 vs 0)."""
        accept = self.acceptance()
        best = self.best(accept, load, overlap=True)
        return best > 0 and self.rate(best, accept, load, True) >= max(
            self.rate(k, accept, load, False) for k in range(self.k_max + 1))

    def choose(self, load: Load = ALONE, overlap: bool = False) -> int:
        best_k = self.best(self.acceptance(), load, overlap)
        if best_k > 0:
            self._rounds_at_zero = 0
            return best_k
        # Re-measure acceptance now and then. A probe widens every row of a batched forward (rows are
        # padded), so under load probe less often, and not at all where even good drafts would not pay.
        self._rounds_at_zero += 1
        due = self._rounds_at_zero >= self.probe_every * max(load.sessions, 1)
        if due and self.best([self.probe_alpha] * self.k_max, load, overlap) > 0:
            self._rounds_at_zero = 0
            return min(1, self.k_max)
        return 0
