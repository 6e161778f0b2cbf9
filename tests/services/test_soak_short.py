"""The short CI variant of bench/soak.py: load above the admission limit, nothing but RESOURCE_EXHAUSTED, no leaks."""

import pytest

from specsplit.bench.soak import run

pytestmark = pytest.mark.services


def test_short_soak_above_the_admission_limit(tmp_path, tiny_target_dir, tiny_draft_dir):
    report = run(str(tiny_target_dir), str(tiny_draft_dir), clients=6, max_concurrent=3, duration_s=6.0,
                 workdir=tmp_path)
    assert report["requests_ok"] > 0
    assert report["unexpected_errors"] == {}
    assert report["errors_by_code"].get("RESOURCE_EXHAUSTED", 0) > 0  # the limit was really exceeded
    assert report["leaked_sessions"] == {"target": 0, "draft": 0}
