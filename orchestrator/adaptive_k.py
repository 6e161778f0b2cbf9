"""Choosing K per round from measured acceptance and measured costs (Leviathan et al. 2023, sec. 3.3-3.4).

With per-token acceptance rate alpha, a block of k draft tokens yields on
average E(k) = (1 - alpha^(k+1)) / (1 - alpha) committed tokens per target
pass. The round costs T(k) = t_verify(k) + k * t_draft, where t_verify grows
with k on CPUs (verifying 8 tokens costs ~2 decode steps there, unlike a GPU
at batch 1). We pick the k in [0, k_max] maximising E(k) / T(k); k = 0 is
plain decoding, so speculation that does not pay for itself switches off.

Pure: no I/O. The orchestrator feeds it the services' reported compute times.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CostModel:
    """Least-squares fit of t_verify(k) = a + b k and the mean draft time per token, over all sessions."""

    decay: float = 0.98  # forget old samples slowly: load and context length drift
    _n: float = 0.0
    _sk: float = 0.0
    _skk: float = 0.0
    _st: float = 0.0
    _skt: float = 0.0
    _draft_s: float = 0.0
    _draft_tokens: float = 0.0

    def observe_verify(self, k: int, seconds: float) -> None:
        d = self.decay
        self._n = self._n * d + 1
        self._sk = self._sk * d + k
        self._skk = self._skk * d + k * k
        self._st = self._st * d + seconds
        self._skt = self._skt * d + k * seconds

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._draft_s = self._draft_s * self.decay + seconds
            self._draft_tokens = self._draft_tokens * self.decay + tokens

    def verify_s(self, k: int) -> float:
        """Predicted target time for a block of k; a + b k with b >= 0."""
        if self._n == 0:
            return 1.0 + 0.1 * k  # no data yet: relative units, verification ~10 % per token
        mean_k, mean_t = self._sk / self._n, self._st / self._n
        var_k = self._skk / self._n - mean_k**2
        slope = (self._skt / self._n - mean_k * mean_t) / var_k if var_k > 1e-9 else 0.1 * mean_t
        slope = max(slope, 0.0)
        return max(mean_t + slope * (k - mean_k), 1e-6)

    def draft_s_per_token(self) -> float:
        return self._draft_s / self._draft_tokens if self._draft_tokens else 0.0


def expected_tokens(alpha: float, k: int) -> float:
    """E(k): committed tokens per target pass for i.i.d. acceptance alpha (Leviathan eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveK:
    """Per-session K controller."""

    k_max: int
    costs: CostModel
    prior_alpha: float = 0.6
    prior_weight: float = 2.0  # pseudo-observations behind the prior
    decay: float = 0.8  # recent rounds dominate: acceptance comes in runs (copy spans)
    probe_every: int = 8  # after this many k = 0 rounds, try k = 1 to re-measure acceptance
    _accepted: float = field(default=0.0, init=False)
    _trials: float = field(default=0.0, init=False)
    _rounds_at_zero: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")

    @property
    def alpha(self) -> float:
        a = self.prior_alpha * self.prior_weight
        return (self._accepted + a) / (self._trials + self.prior_weight)

    def observe(self, drafted: int, accepted: int) -> None:
        """One round: ``accepted`` of ``drafted`` passed (a rejection ends the block)."""
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        self._accepted = self._accepted * self.decay + accepted
        self._trials = self._trials * self.decay + trials

    def choose(self) -> int:
        alpha, draft_s = self.alpha, self.costs.draft_s_per_token()
        best_k, best_rate = 0, 1.0 / self.costs.verify_s(0)
        for k in range(1, self.k_max + 1):
            rate = expected_tokens(alpha, k) / (self.costs.verify_s(k) + k * draft_s)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self._rounds_at_zero += 1
            if self._rounds_at_zero >= self.probe_every:
                self._rounds_at_zero = 0
                return min(1, self.k_max)
        else:
            self._rounds_at_zero = 0
        return best_k
