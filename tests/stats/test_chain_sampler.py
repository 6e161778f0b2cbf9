"""The chain step's on-device sampler (``chain_step.choose``: Gumbel-max over noise computed on the device from each
position's COUPLED key, or the inverse CDF at its DRAFT uniform) draws from q, top-k and top-p applied: chi-square over
20,000 positions of one seed; the negative controls (one key for every position, the wrong temperature, the
truncation left out) fail the same test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.lmkit import chain_step, draws
from specsplit.lmkit.sampling import SamplingParams, logits_to_probs

pytestmark = pytest.mark.stats

TRIALS = 20_000
LOGITS = torch.tensor([2.0, 0.5, -1.0, 1.2, -3.0, 0.0, -float("inf"), 1.9])
VOCAB = torch.arange(LOGITS.numel())


def _keys(coupled: bool) -> torch.Tensor:
    stream = draws.Stream.COUPLED if coupled else draws.Stream.DRAFT
    return draws.key_tensor(draws.position_keys(20261207, stream, range(TRIALS)))


def _counts(draw: chain_step.Draw, keys: torch.Tensor) -> np.ndarray:
    settings = chain_step.settings_of(draw)
    picks, *_ = chain_step.choose(LOGITS.expand(TRIALS, -1), settings, keys, VOCAB)  # a row a position
    return np.bincount(picks.numpy(), minlength=LOGITS.numel())


def _pvalue(counts: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> float:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    q = logits_to_probs(LOGITS[None], params)[0].double().numpy()
    if counts[q == 0].sum():
        return 0.0  # a token q bans was drawn
    keep = q > 0
    return float(chisquare(counts[keep], TRIALS * q[keep] / q[keep].sum()).pvalue)


@pytest.mark.parametrize("coupled", [True, False])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 0, 1.0), (1.0, 0, 1.0), (2.0, 0, 1.0), (1.0, 4, 1.0),
                                                       (1.5, 0, 0.8), (1.2, 5, 0.9)])
def test_the_on_device_sampler_draws_from_q(coupled, temperature, top_k, top_p):
    draw = chain_step.Draw(0, temperature, top_k, top_p, coupled=coupled)
    assert _pvalue(_counts(draw, _keys(coupled)), temperature, top_k, top_p) > 1e-3


@pytest.mark.parametrize("coupled", [True, False])
def test_negative_controls_fail(coupled):
    keys = _keys(coupled)
    plain = chain_step.Draw(0, 1.0, coupled=coupled)
    assert _pvalue(_counts(plain, keys), 1.3) < 1e-6  # drawn at temperature 1, tested against 1.3
    one_key = keys[:1].expand(TRIALS).contiguous()  # the same noise at every position
    assert _pvalue(_counts(plain, one_key), 1.0) < 1e-6
    assert _pvalue(_counts(plain, keys), 1.0, top_k=3) < 1e-6  # drawn whole, tested against its top 3
