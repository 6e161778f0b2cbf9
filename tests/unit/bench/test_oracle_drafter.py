"""The bench's ORACLE drafter: α is exact, its rounds cost the draft model's forwards, it knows when it is lost."""

from __future__ import annotations

import math
import random

import pytest

from specsplit.bench import gpu_models
from specsplit.bench.oracle_drafter import Oracle, OracleDrafter
from specsplit.lmkit import models

pytestmark = pytest.mark.unit

V = gpu_models.TINY_VOCAB
PROMPT = [11, 300, 4000, 27, 9]
TRUTH = [random.Random(5).randrange(V) for _ in range(40)]


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    _, draft_dir = gpu_models.write_pair(tmp_path_factory.mktemp("pair"), gpu_models.TINY)
    return models.load_model(models.ModelSpec(str(draft_dir)))


def drafter(model, alpha: float, seed: int = 0) -> OracleDrafter:
    return OracleDrafter(model, PROMPT, Oracle(alpha, {tuple(PROMPT): TRUTH}, seed), V)


def test_alpha_one_drafts_the_truth_and_pays_a_forward_per_token(draft_model):
    d = drafter(draft_model, 1.0)
    assert d.propose(4).tokens == TRUTH[:4]
    assert len(d._cache) == len(PROMPT) + 3  # fed the prompt and every drafted token but the last
    d.commit(len(PROMPT), TRUTH[:2])  # two accepted, then the truth continues
    assert d.propose(3).tokens == TRUTH[2:5]


def test_alpha_zero_never_drafts_the_truth(draft_model):
    d = drafter(draft_model, 0.0)
    for start in range(0, 12, 4):
        d.commit(len(PROMPT) + start, TRUTH[start : start + 4])
        block = d.propose(4).tokens
        assert all(0 <= t < V and t != want for t, want in zip(block, TRUTH[start + 4 :]))


def test_each_token_is_the_truth_with_probability_alpha():
    d = OracleDrafter.__new__(OracleDrafter)
    d._alpha, d._vocab, d._rng = 0.7, V, random.Random(1)
    n = 20000
    hits = sum(d._choose(17) == 17 for _ in range(n))
    assert abs(hits / n - 0.7) < 5 * math.sqrt(0.7 * 0.3 / n)


def test_off_the_known_continuation_it_drafts_at_random(draft_model):
    d = drafter(draft_model, 1.0)
    wrong = (TRUTH[0] + 1) % V  # the target committed something else than the known continuation
    d.commit(len(PROMPT), [wrong])
    block = d.propose(4).tokens
    assert block != TRUTH[1:5] and all(0 <= t < V for t in block)


def test_the_oracle_file_round_trips_and_alpha_is_checked(tmp_path):
    oracle = Oracle(0.8, {(1, 2): [3, 4], (5,): [6]}, seed=9)
    oracle.write(tmp_path / "o.json")
    assert Oracle.read(tmp_path / "o.json") == oracle
    with pytest.raises(ValueError, match="alpha"):
        Oracle(1.5)
