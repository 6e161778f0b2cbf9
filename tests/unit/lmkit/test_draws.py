"""Tests for lmkit.draws: each draw is a pure function of (seed, stream, position, index), and uniform."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from scipy import stats

from specsplit.lmkit.draws import SEED_LIMIT, Stream, gumbel, inverse_cdf, position_keys, sample_seed, uniforms

pytestmark = pytest.mark.unit


def test_a_draw_depends_on_seed_stream_position_and_index_and_nothing_else():
    base = uniforms(7, Stream.TARGET, [10, 11, 12], 4)
    assert base.shape == (3, 4) and base.dtype == torch.float64
    assert torch.equal(uniforms(7, Stream.TARGET, [10, 11, 12], 4), base)
    # Asking for fewer positions or draws, or in another order, gives the same numbers for the same keys.
    assert torch.equal(uniforms(7, Stream.TARGET, [12, 10], 2), base[[2, 0], :2])
    assert torch.equal(uniforms(7, Stream.TARGET, range(11, 12), 4), base[1:2])
    # Every coordinate matters.
    assert not torch.equal(uniforms(8, Stream.TARGET, [10, 11, 12], 4), base)
    assert not torch.equal(uniforms(7, Stream.DRAFT, [10, 11, 12], 4), base)
    assert len(set(base.flatten().tolist())) == 12


def test_the_key_is_a_stable_hash_not_pythons_hash():
    # Python's hash() changes per process (PYTHONHASHSEED); BLAKE2b of the packed tuple does not.
    digest = hashlib.blake2b(struct.pack("<QBQ", 7, 1, 10), digest_size=8, person=b"specsplit.draws").digest()
    assert int(position_keys(7, Stream.TARGET, [10])[0]) == int.from_bytes(digest, "little")


def test_a_known_draw_is_pinned():
    # SplitMix64 of key + GAMMA, top 53 bits: a change of construction would silently change every seeded output.
    key = int(position_keys(0, Stream.TARGET, [0])[0])
    z = (key + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    assert float(uniforms(0, Stream.TARGET, [0], 1)[0, 0]) == ((z >> 11) + 0.5) * 2.0**-53


def test_draws_are_uniform_and_adjacent_positions_independent():
    u = uniforms(3, Stream.TARGET, range(20_000), 2)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert stats.kstest(u[:, 0].numpy(), "uniform").pvalue > 1e-3
    assert stats.kstest(u[:, 1].numpy(), "uniform").pvalue > 1e-3
    # Pairs of consecutive positions fill the unit square evenly (10 x 10 cells).
    cells = (np.floor(u[:-1, 0].numpy() * 10) * 10 + np.floor(u[1:, 0].numpy() * 10)).astype(int)
    assert stats.chisquare(np.bincount(cells, minlength=100)).pvalue > 1e-3
    assert abs(float(np.corrcoef(u[:, 0], u[:, 1])[0, 1])) < 0.03


def test_gumbel_noise_of_a_token_does_not_depend_on_the_other_tokens_asked_for():
    ids = torch.tensor([5, 900, 49151, 0])
    noise = gumbel(11, Stream.COUPLED, 42, ids)
    assert torch.equal(gumbel(11, Stream.COUPLED, 42, ids[[2, 0]]), noise[[2, 0]])
    u = uniforms(11, Stream.COUPLED, [42], 49152)[0, ids]
    assert torch.allclose(noise, -torch.log(-torch.log(u)), rtol=0, atol=1e-12)
    assert not torch.equal(gumbel(11, Stream.COUPLED, 43, ids), noise)


def test_gumbel_max_samples_the_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    ids = torch.arange(4)
    picks = [int(torch.argmax(p.log() + gumbel(1, Stream.COUPLED, n, ids))) for n in range(8000)]
    counts = np.bincount(picks, minlength=4)
    assert stats.chisquare(counts, 8000 * p.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    "call",
    [
        lambda: uniforms(-1, Stream.TARGET, [0], 1),
        lambda: uniforms(2**63, Stream.TARGET, [0], 1),
        lambda: uniforms(True, Stream.TARGET, [0], 1),
        lambda: uniforms(0, "target", [0], 1),
        lambda: uniforms(0, Stream.TARGET, [-1], 1),
        lambda: uniforms(0, Stream.TARGET, [0], -1),
        lambda: gumbel(0, Stream.COUPLED, 0, torch.tensor([1.0])),
        lambda: gumbel(0, Stream.COUPLED, 0, torch.tensor([-1])),
    ],
)
def test_bad_arguments_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_inverse_cdf_picks_the_cell_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75], dtype=torch.float64)
    assert inverse_cdf(probs, 0.1) == 1
    assert inverse_cdf(probs, 0.25) == 3
    assert inverse_cdf(probs, 1 - 2**-53) == 3
    assert inverse_cdf(probs * 4, 0.2) == 1  # unnormalised is fine
    assert inverse_cdf(torch.zeros(4, dtype=torch.float64), 0.5, fallback=probs) == 3


def test_sample_seeds_keep_the_seed_for_sample_0_and_differ_reproducibly_for_the_others():
    seeds = [sample_seed(7, i) for i in range(16)]
    assert seeds[0] == 7 and len(set(seeds)) == 16 and seeds == [sample_seed(7, i) for i in range(16)]
    assert all(0 <= s < SEED_LIMIT for s in seeds) and sample_seed(2**63 - 1, 3) < SEED_LIMIT
    assert sample_seed(8, 1) != seeds[1]
    with pytest.raises(ValueError):
        sample_seed(-1, 1)
    with pytest.raises(ValueError):
        sample_seed(7, -1)
