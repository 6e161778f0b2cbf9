"""``bench/gpu_check`` runs green on the CPU in its tiny mode, so it cannot rot before a GPU comes: the same
command, stages and report as on a GPU, with exact greedy equality (fp32) where the GPU run counts flips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = gpu_check("--out", str(out), "--size", "tiny", "--device", "cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "gpu_check.json").read_text()), done.stdout


def test_every_stage_runs_and_the_report_is_written(tiny_run):
    out, report, stdout = tiny_run
    assert report["errors"] == [] and report["size"] == "tiny"
    assert report["skipped"] == ["device (copy bandwidth and host-sync audit need CUDA)"]
    for stage in ("services", "target_steps", "draft_steps", "end_to_end", "batched_verify", "greedy_equality"):
        assert stage in report, stage
    assert (out / "gpu_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["service_exit_codes"] == {"draft": 0, "target": 0}  # both drained and stopped on SIGTERM
    assert "== bench/gpu_check (tiny)" in stdout and "goals:" in stdout


def test_step_costs_are_measured_for_every_width(tiny_run):
    steps = tiny_run[1]["target_steps"]
    assert set(steps["verify_over_step"]) == {"1", "2", "5", "8", "16"}
    assert steps["verify_over_step"]["1"] == 1.0 and steps["decode_step_ms"] > 0
    assert all(v > 0 for v in steps["verify_ms"].values())
    draft = tiny_run[1]["draft_steps"]
    assert draft["cost_ratio_c"] > 0
    assert set(draft["draft_token_ms_token_by_token"]) == set(draft["draft_token_ms"]) == {"1", str(draft["k"])}
    assert all(v > 0 for v in draft["draft_token_ms_token_by_token"].values())
    contexts = tiny_run[1]["static_contexts"]  # the static step at each context, spans as held
    assert [row["context"] for row in contexts["contexts"]] == [16, 64]
    assert [row["span_blocks"] for row in contexts["contexts"]] == [2, 5] and contexts["spans_blocks"][-1] == 5
    assert all(ms > 0 for row in contexts["contexts"] for ms in (*row["verify_ms"].values(),
                                                                  *row["verify_ms_full_span"].values()))


def test_the_oracle_drafter_controls_acceptance_and_output_stays_the_targets(tiny_run):
    e2e = tiny_run[1]["end_to_end"]
    assert e2e["target_only"]["tokens"] == e2e["prompts"] * e2e["new_tokens"]
    runs = {run["alpha"]: run for run in e2e["runs"]}
    assert set(runs) == {0.8, 1.0}
    for run in runs.values():
        assert run["equal_to_target_only"]["identical"] == f"{e2e['prompts']}/{e2e['prompts']}"  # fp32: exact
        assert run["draft_fallback_rounds"] == 0 and run["drafted"] > 0
        assert run["leviathan_bound"] > 0 and run["bound_with_measured_verify"] > 0
    assert runs[1.0]["accepted"] == runs[1.0]["drafted"]  # alpha 1: every draft token is the target's
    assert runs[0.8]["accepted"] < runs[0.8]["drafted"]


def test_batched_verification_batches_and_changes_no_token(tiny_run):
    levels = tiny_run[1]["batched_verify"]["levels"]
    assert [lv["sessions"] for lv in levels] == [1, 2, 4]
    assert levels[0]["mean_batch_size"] == 1 and levels[-1]["mean_batch_size"] > 1
    equality = tiny_run[1]["greedy_equality"]
    assert equality["identical"] == "4/4" and equality["tokens_differing"] == 0
    assert equality["mean_batch_size"] > 1  # the concurrent run really shared forwards


def test_a_missing_or_old_package_stops_the_check_with_what_to_carry(tmp_path):
    fake = tmp_path / "site" / "grpc_reflection"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "1.0.0"\n')
    done = gpu_check("--out", str(tmp_path / "out"), "--size", "tiny", "--device", "cpu",
                     env={"PYTHONPATH": str(tmp_path / "site")}, timeout=120)
    assert done.returncode == 2
    assert "grpcio-reflection 1.0.0" in done.stderr and "bench/gpu_wheels.sh" in done.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert any("grpcio-reflection" in e for e in report["errors"])
