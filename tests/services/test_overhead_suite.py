"""``specsplit bench --suite overhead`` end to end, small: real services, every mode, a JSON whose parts add up."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.services


def test_the_overhead_suite_reports_every_mode_and_process(tmp_path):
    out = tmp_path / "overhead.json"
    run = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "bench", "--suite", "overhead", "--json", str(out),
         "--overhead-rounds", "12", "--overhead-sessions", "1,3", "--overhead-tokens", "8", "--overhead-repeats", "1"],
        capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {(r["transport"], r["mode"]) for r in report["per_round"]} == {
        (t, m) for t in ("shared", "own") for m in ("k0", "ngram4-sync", "ngram4-overlap", "model4-sync")}
    modes = {r["mode"]: r for r in report["per_round"] if r["transport"] == "shared"}
    for row in modes.values():
        assert sum(row["parts_ms"].values()) == pytest.approx(row["round_wall_ms"], abs=0.01)
        assert row["parts_ms"]["target_forward"] > 0 and row["rounds"] >= 12
    assert modes["k0"]["parts_ms"]["draft_hop_waited"] == 0.0  # no draft request at k = 0
    assert modes["model4-sync"]["parts_ms"]["draft_compute_waited"] > 0
    assert {(c["transport"], c["mode"], c["sessions"]) for c in report["concurrency"]} == {
        (t, m, n) for t in ("shared", "own") for m in ("k0", "ngram4-sync", "ngram4-overlap") for n in (1, 3)}
    assert all(set(c["cpu_ms_per_token"]) == {"orchestrator", "target", "draft"} for c in report["concurrency"])
    assert len(report["against_gpu_steps"]) == 2 * (4 + 6)
    assert out.with_suffix(".png").exists()
