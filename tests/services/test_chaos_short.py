"""The short CI variant of bench/chaos: load and every fault kind at once, then the history is checked.

Where hosts can be built (``specsplit.bench.hosts``: root, as CI runs) it runs across them: two target and
two draft replicas, the orchestrator and the clients each on a host of their own, replicas killed (each a
leave and a re-join of its pool) and cut off by partitions besides the loopback run's kinds; elsewhere it
runs on loopback. It fails on any lost, duplicated or contradicted token, an undocumented status, a hang or
a leaked session (bench.chaos.checker); the long runs and their figures are in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specsplit.bench import hosts
from specsplit.bench.chaos import schedule
from specsplit.bench.chaos.__main__ import build_parser, run

pytestmark = pytest.mark.services

WHY_NOT = hosts.unavailable()


def assert_every_promise_kept(report: dict, kinds) -> None:
    problems = {key: report[key] for key in ("mismatches", "contradicted", "undocumented_failures",
                                             "wrong_failures", "hangs") if report[key]}
    assert not problems, problems
    assert report["leaked_sessions"] == {"target": 0, "draft": 0}
    # The run really exercised what it claims: faults of every kind drawn, completed generations checked.
    injected = set(report["faults_by_kind"])
    assert injected == set(kinds), injected
    assert report["requests_by_outcome"].get("generate:OK", 0) >= 10
    assert report["tokens_checked"] >= 200
    assert report["ok"]


@pytest.mark.skipif(WHY_NOT is None, reason="hosts can be built here: the run across them lands every kind and more")
def test_a_short_chaos_soak_keeps_every_promise(tmp_path, tiny_target_dir, tiny_draft_dir):
    args = build_parser().parse_args([
        "--model", str(tiny_target_dir), "--draft-model", str(tiny_draft_dir), "--duration-s", "36",
        "--clients", "6", "--fault-every-s", "3", "--max-new-tokens", "24", "--deadline-s", "60",
        "--grace-s", "3", "--seed", "4",
    ])
    assert_every_promise_kept(run(args, tmp_path), schedule.KINDS)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no hosts here: {WHY_NOT}")
def test_a_short_chaos_soak_across_hosts_with_pools_keeps_every_promise(tmp_path, tiny_target_dir, tiny_draft_dir):
    """Run as a process of its own: the run enters the clients' host, which a test worker must not."""
    report_path = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, "-m", "specsplit.bench.chaos", "--hosts", "--replicas", "2",
         "--model", str(tiny_target_dir), "--draft-model", str(tiny_draft_dir), "--duration-s", "40",
         "--clients", "6", "--fault-every-s", "3", "--max-new-tokens", "24", "--deadline-s", "60",
         "--grace-s", "3", "--seed", "4", "--json", str(report_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert report_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["topology"].startswith("across hosts: 2 target and 2 draft replicas"), report["topology"]
    assert_every_promise_kept(report, schedule.HOSTS_KINDS)
    assert result.returncode == 0, result.stdout[-3000:]
