"""The chain step's on-device coupled sampler (``chain_step.choose``, Gumbel-max over noise computed on the device
from each position's key) draws from q: chi-square over 20,000 positions of one seed; the negative controls (one
key for every position, the wrong temperature) fail the same test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.lmkit import chain_step

pytestmark = pytest.mark.stats

TRIALS = 20_000
LOGITS = torch.tensor([2.0, 0.5, -1.0, 1.2, -3.0, 0.0, -float("inf"), 1.9])
VOCAB = torch.arange(LOGITS.numel())


def _counts(temperature: float, keys: torch.Tensor) -> np.ndarray:
    t = torch.tensor(temperature)
    picks = [int(chain_step.choose(chain_step.GUMBEL, LOGITS, t, keys[i : i + 1], VOCAB)) for i in range(TRIALS)]
    return np.bincount(picks, minlength=LOGITS.numel())


def _pvalue(counts: np.ndarray, temperature: float) -> float:
    q = torch.softmax(LOGITS / temperature, dim=-1).double().numpy()
    assert counts[q == 0].sum() == 0  # a banned token is never drawn
    keep = q > 0
    return float(chisquare(counts[keep], TRIALS * q[keep] / q[keep].sum()).pvalue)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_the_on_device_coupled_sampler_draws_from_q(temperature):
    keys = chain_step.coupled_keys(seed=20261207, first=0, k=TRIALS)
    assert _pvalue(_counts(temperature, keys), temperature) > 1e-3


def test_negative_controls_fail():
    keys = chain_step.coupled_keys(seed=20261207, first=0, k=TRIALS)
    assert _pvalue(_counts(1.0, keys), 1.3) < 1e-6  # drawn at temperature 1, tested against 1.3
    one_key = keys[:1].expand(TRIALS).contiguous()  # the same noise at every position
    assert _pvalue(_counts(1.0, one_key), 1.0) < 1e-6
