"""The short CI variant of bench/chaos: load and every fault kind at once, then the history is checked.

It fails on any lost, duplicated or contradicted token, an undocumented status, a hang or a leaked
session (bench.chaos.checker); the long run and its figures are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

from specsplit.bench.chaos import schedule
from specsplit.bench.chaos.__main__ import build_parser, run

pytestmark = pytest.mark.services


def test_a_short_chaos_soak_keeps_every_promise(tmp_path, tiny_target_dir, tiny_draft_dir):
    args = build_parser().parse_args([
        "--model", str(tiny_target_dir), "--draft-model", str(tiny_draft_dir), "--duration-s", "36",
        "--clients", "6", "--fault-every-s", "3", "--max-new-tokens", "24", "--deadline-s", "60",
        "--grace-s", "3", "--seed", "4",
    ])
    report = run(args, tmp_path)
    problems = {key: report[key] for key in ("mismatches", "contradicted", "undocumented_failures",
                                             "wrong_failures", "hangs") if report[key]}
    assert not problems, problems
    assert report["leaked_sessions"] == {"target": 0, "draft": 0}
    # The run really exercised what it claims: faults of every kind drawn, completed generations checked.
    injected = set(report["faults_by_kind"])
    assert injected == set(schedule.KINDS), injected
    assert report["requests_by_outcome"].get("generate:OK", 0) >= 10
    assert report["tokens_checked"] >= 200
    assert report["ok"]
