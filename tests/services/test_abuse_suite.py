"""``specsplit bench --suite abuse`` end to end, small: real services, every probe, a JSON that says what each got."""

import json
import subprocess
import sys

import pytest

from specsplit.bench.abuse import PROBES

pytestmark = pytest.mark.services


def test_the_abuse_suite_measures_health_and_memory_under_every_probe(tmp_path, tiny_target_dir, tiny_draft_dir):
    out = tmp_path / "abuse.json"
    run = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "bench", "--suite", "abuse", "--json", str(out),
         "--model", str(tiny_target_dir), "--draft-model", str(tiny_draft_dir), "--abuse-s", "2",
         "--abuse-connections", "8", "--abuse-stalled-send-s", "1", "--abuse-health-every-s", "0.1"],
        capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    phases = {p["phase"]: p for p in report["phases"]}
    assert list(phases) == ["quiet", *PROBES]
    for phase in phases.values():
        assert phase["health_ms"]["asked"] > 0 and phase["health_ms"]["p99"] is not None, phase
        assert set(phase["rss_peak_mb"]) == {"target", "draft", "orchestrator"}, phase
        assert phase["legit"]["failed"] == 0 and phase["legit"]["completed"] > 0, phase  # nothing legitimate lost
    assert not phases["quiet"]["probe"]
    probe = {name: phases[name]["probe"] for name in PROBES}
    assert {"tokenized 400", "at the body limit 400", "over the body limit 413"} == set(probe["large_prompts"]), probe
    assert probe["chunked_bodies"].get("413", 0) > 0, probe
    assert probe["unauthenticated_flood"].get("401", 0) > 0 and set(probe["unauthenticated_flood"]) == {"401"}, probe
    assert probe["slowloris"]["opened"] >= 8, probe
    assert probe["stalled_readers"]["streams opened"] >= 4, probe
    assert report["goals"]["legit_failures"] == 0
    assert out.with_suffix(".png").exists()
