"""A forward's cost as a function of its tokens, fitted online: t(x) = a + s x.

Both sides use it: the orchestrator to choose k (how much a longer block
costs), the target to decide whether a batch is cheaper split in two (how many
padded tokens one more forward is worth). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LinearCost:
    """Least-squares fit of t(x) = a + s x with s >= 0, forgetting old samples at ``decay`` per sample."""

    decay: float = 0.98  # load and context lengths drift
    _n: float = 0.0
    _sx: float = 0.0
    _sxx: float = 0.0
    _st: float = 0.0
    _sxt: float = 0.0

    @property
    def samples(self) -> float:
        return self._n

    def observe(self, tokens: int, seconds: float) -> None:
        d, x = self.decay, tokens
        self._n = self._n * d + 1
        self._sx = self._sx * d + x
        self._sxx = self._sxx * d + x * x
        self._st = self._st * d + seconds
        self._sxt = self._sxt * d + x * seconds

    def predict(self, tokens: int) -> float:
        """Predicted seconds for ``tokens``; before any sample, relative units with ~10 % per token."""
        if self._n == 0:
            return 1.0 + 0.1 * tokens
        return max(self._st / self._n + self.slope() * (tokens - self._sx / self._n), 1e-6)  # through the means

    def slope(self) -> float:
        """s: seconds per extra token."""
        if self._n == 0:
            return 0.1
        mean_x, mean_t = self._sx / self._n, self._st / self._n
        var_x = self._sxx / self._n - mean_x**2
        slope = (self._sxt / self._n - mean_x * mean_t) / var_x if var_x > 1e-9 else 0.1 * mean_t / max(mean_x, 1.0)
        return max(slope, 0.0)

    def intercept(self) -> float:
        """a: seconds a forward costs whatever its size."""
        if self._n == 0:
            return 1.0
        return self._st / self._n - self.slope() * self._sx / self._n
