"""The bf16 flip experiment's counting: outputs compared up to their first divergence."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _experiment(name: str):
    """experiments/<name>/<name>.py, imported by path: experiments/ is not a package."""
    root = next(p for p in Path(__file__).resolve().parents if (p / "experiments").is_dir())
    spec = importlib.util.spec_from_file_location(name, root / "experiments" / name / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bf16_flips = _experiment("bf16_flips")
compare, first_divergence = bf16_flips.compare, bf16_flips.first_divergence

pytestmark = pytest.mark.unit


def test_first_divergence_finds_the_first_differing_token_or_none():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter output differs where it ends


def test_a_diverged_session_counts_its_tokens_up_to_the_first_flip_only():
    solo = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    batched = [[1, 2, 3, 4], [5, 0, 0, 0], [9, 9, 9, 1]]
    row = compare(solo, batched)
    assert row["sessions_differing"] == 2
    assert row["first_divergence_positions"] == [1, 3]
    assert row["tokens_compared"] == 4 + 2 + 4  # the later differences in session 1 follow from its flip
    assert row["tokens_total"] == 12
    assert row["flip_rate_per_token"] == pytest.approx(2 / 10)


def test_identical_outputs_have_no_flips_and_mismatched_counts_are_refused():
    assert compare([[1, 2]], [[1, 2]])["flip_rate_per_token"] == 0.0
    with pytest.raises(ValueError):
        compare([[1]], [[1], [2]])
