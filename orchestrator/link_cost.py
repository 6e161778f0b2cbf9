"""What the network adds to a speculative round: each link's round-trip time and jitter.

A round pays two links: orchestrator <-> draft and orchestrator <-> target.
Each link's round trip is estimated as TCP estimates it (Jacobson 1988;
RFC 6298, sec. 2): from samples r,

    srtt   <- (1 - 1/8) srtt + r / 8
    rttvar <- (1 - 1/4) rttvar + |srtt - r| / 4

where a sample is a call's wall time minus the time the service says it spent
on it (the target's ``service_us``): the network plus both gRPC stacks, not the
model. For the draft a sample leaves out only its compute (``compute_us``):
waiting behind other sessions' proposals on the draft's compute thread counts
as link time, since no load model covers the draft and a deadline must allow
for it.

The time of one round, given the target's forward t_v and the draft's time per
token c (both from the K controller's cost model), a block of k, and the links'
round trips R_t, R_d:

    k = 0:    T = t_v + R_t                                  (no draft call at all)
    sync:     T + R_d + k c                                  (draft, then verify)
    overlap:  E[max(T + e, R_d + (k + 1) c)] + (1 - h)(R_d + k c)
    in hand:  T                                  (a free block already drafted, cut to k)

Whether to ask a free drafter at all (``specsplit.orchestrator.free_ask``) weighs what a
block saves against what the ask adds: R_d + c + rttvar before the
verification (sync, or a fresh ask after a miss with overlap), and with
overlap E[max(T + e, R_d + c)] - T for an ask sent ahead during it, where e is
what an ask slows the forward it overlaps by (``CostModel.ahead_excess_s``: on
a CPU shared with the target its handling takes the target's cores).

With overlap the next block (k + 1 tokens: a guess of the bonus token, then k)
is drafted while the target verifies; it is used with probability h (the
block accepted whole and the bonus guessed), else drafted again after the
verification. Jitter enters through E[max] of the two parallel legs, taken as
independent normals with sigma = sqrt(pi / 2) rttvar (Clark 1961): the more the
legs jitter, the more often the slower one sets the pace. With no samples the
links cost nothing, and the round is the controller's loopback model.

A draft reply has a deadline: its expected time plus 4 rttvar (RFC 6298's
RTO), with a floor. A round waits for a draft no longer than that; a later
reply is dropped and the target steps alone.

Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEADLINE_FLOOR_S = 0.002  # a deadline is never shorter: scheduling noise on a busy host is ~1 ms
DEADLINE_SLACK = 0.5  # and allows half the expected time again (draft compute varies with context)
_SIGMA_PER_MEAN_DEVIATION = math.sqrt(math.pi / 2)  # for a normal variable


@dataclass
class RttEstimator:
    """Smoothed round-trip time and its mean deviation (RFC 6298, sec. 2), in seconds."""

    gain: float = 1 / 8  # alpha in RFC 6298
    var_gain: float = 1 / 4  # beta
    srtt: float = 0.0
    rttvar: float = 0.0
    samples: int = 0

    def observe(self, sample_s: float) -> None:
        r = max(sample_s, 0.0)
        if self.samples == 0:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar += self.var_gain * (abs(self.srtt - r) - self.rttvar)
            self.srtt += self.gain * (r - self.srtt)
        self.samples += 1

    @property
    def sigma(self) -> float:
        """Standard deviation of a round trip, were it normal."""
        return _SIGMA_PER_MEAN_DEVIATION * self.rttvar

    def timeout(self, expected_s: float, slack: float = DEADLINE_SLACK) -> float:
        """How long to wait for a call expected to take ``expected_s`` beyond this link's round trip (allowing
        ``slack`` of it again)."""
        return max(self.srtt + expected_s * (1 + slack) + 4 * self.rttvar, DEADLINE_FLOOR_S)


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def expected_max(mean_a: float, sigma_a: float, mean_b: float, sigma_b: float) -> float:
    """E[max(A, B)] for independent normal A and B (Clark 1961, eq. 2)."""
    theta = math.hypot(sigma_a, sigma_b)
    if theta < 1e-12:
        return max(mean_a, mean_b)
    alpha = (mean_a - mean_b) / theta
    density = math.exp(-alpha * alpha / 2) / math.sqrt(2 * math.pi)
    return mean_a * normal_cdf(alpha) + mean_b * normal_cdf(-alpha) + theta * density


@dataclass
class LinkCosts:
    """The draft and target links of one orchestrator, shared by its sessions."""

    draft: RttEstimator = field(default_factory=RttEstimator)
    target: RttEstimator = field(default_factory=RttEstimator)

    def round_s(self, k: int, verify_s: float, draft_token_s: float, hit: float, overlap: bool,
                in_hand: bool = False, excess_s: float = 0.0) -> float:
        """Expected wall time of a round with a block of k (the module docstring's formulas).

        ``in_hand``: the block is already drafted (a free drafter's, asked for in any case, to be cut to k): its
        draft round trip is paid whatever k is, so the round is the target's alone. ``excess_s``: what an ask
        during the forward adds to it (``CostModel.ahead_excess_s``), paid with overlap."""
        target = verify_s + self.target.srtt
        if k == 0 or in_hand:
            return target
        if not overlap:
            return target + self.draft.srtt + k * draft_token_s
        ahead = self.draft.srtt + (k + 1) * draft_token_s
        paced = expected_max(target + excess_s, self.target.sigma, ahead, self.draft.sigma)
        return paced + (1.0 - hit) * (self.draft.srtt + k * draft_token_s)

    def ask_s(self, compute_s: float, during_s: float | None = None, excess_s: float = 0.0) -> float:
        """Expected seconds an ask of a drafter computing for ``compute_s`` adds to a round: in the round before
        its verification (``during_s`` None), the draft's round trip and its deviation (a round waits out the
        jitter); sent ahead during a verification whose leg takes ``during_s`` (the target's round trip
        included), what it slows that verification by (``excess_s``, ``CostModel.ahead_excess_s``) and what
        outlasts it (Clark's E[max] as in ``round_s``)."""
        ask = self.draft.srtt + compute_s
        if during_s is None:
            return ask + self.draft.rttvar
        return expected_max(during_s + excess_s, self.target.sigma, ask, self.draft.sigma) - during_s

    def two_requests_fit(self, tokens: int, verify_s: float, draft_token_s: float) -> bool:
        """Whether two draft requests in a row, ``tokens`` tokens in all, come back before a verification
        (then a second one costs the round nothing: the draft would otherwise wait)."""
        return 2 * self.draft.srtt + tokens * draft_token_s <= verify_s + self.target.srtt

    def draft_deadline_s(self, tokens: int, draft_token_s: float) -> float:
        """How long a round waits for a draft reply of ``tokens`` tokens."""
        return self.draft.timeout(tokens * draft_token_s)
