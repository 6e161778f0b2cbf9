"""libFuzzer (atheris) over the HTTP API's request parsers for a bounded time: no input may crash them."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.services

pytest.importorskip("atheris")
FUZZ_SECONDS = 10
RSS_HEADROOM_MB = 4096


def rss_limit_mb() -> int:
    """libFuzzer's memory limit for the child: its headroom above this process's peak.

    libFuzzer reads the peak RSS from getrusage, and on Linux a child starts with its parent's peak (the
    figure survives fork and exec), so a limit taken alone would count whatever earlier tests in this
    worker once held.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + RSS_HEADROOM_MB


def test_atheris_finds_no_input_that_crashes_the_request_parsers(tmp_path):
    from tests.services.fuzz_request_parsers import SEEDS

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, seed in enumerate(SEEDS):
        (corpus / f"seed-{i}").write_bytes(seed)
    run = subprocess.run(
        [sys.executable, "-m", "tests.services.fuzz_request_parsers", f"-max_total_time={FUZZ_SECONDS}", "-seed=1",
         f"-rss_limit_mb={rss_limit_mb()}", "-max_len=4096", f"-artifact_prefix={tmp_path}/", str(corpus)],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=FUZZ_SECONDS + 120,
    )
    report = run.stderr[-4000:]
    assert run.returncode == 0, report
    assert "Done" in report and list(tmp_path.glob("crash-*")) == [], report
