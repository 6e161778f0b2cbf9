"""`specsplit up` on a local cluster of 2 CPUs that it starts itself, as a new user runs it.

With default resource flags it fits everything (fractional CPUs), serves the target's own greedy
output over gRPC and HTTP, and after that traffic, on a SIGTERM to its whole process group (as
`timeout`, systemd or `kill -- -PGID` send it), stops in order, exits 0 and leaves no process or port
behind (a SIGTERM to `up` alone: tests/ray/test_placement.py). A request the cluster can never hold is
refused at once with the numbers and flags, exit 2, nothing left running. Each test starts (and
stops) its own local Ray cluster, so they cost tens of seconds each.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import psutil
import pytest

from specsplit.target_service.ranks import free_port
from specsplit.v1 import specsplit_pb2 as pb
from tests.conftest import TINY_PROMPTS, run_async
from tests.ray.conftest import start_cli
from tests.ray.test_serve import generate

pytestmark = pytest.mark.ray

LOCAL_CPUS = "2"  # the CI machine's size, whatever machine runs the test
GROUP_STOP_BOUND_S = 15.0  # a stop after traffic, signalled to the whole group: ~5 s here
RAY_ERRORS = re.compile(
    r"Failed to connect to GCS|Failed to push error|SIGTERM received|Traceback|ERROR|^\[[^\]]* E \d+ \d+\]", re.M
)


@pytest.fixture
def ray_tmpdir(monkeypatch):
    """A Ray temp dir of its own: every process of the local cluster names it in its command line.

    Short, under /tmp: Ray's unix socket paths must fit in 107 bytes.
    """
    path = Path(tempfile.mkdtemp(prefix="rayup-", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def naming(text: str) -> set[int]:
    """Processes whose command line mentions ``text``."""
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in process.info["cmdline"] or ()) and process.status() != psutil.STATUS_ZOMBIE:
                found.add(process.pid)
        except psutil.Error:
            pass
    return found


def listening(pids: set[int]) -> set[int]:
    ports = set()
    for connection in psutil.net_connections("inet"):
        if connection.status == psutil.CONN_LISTEN and connection.pid in pids:
            ports.add(connection.laddr.port)
    return ports


def gone_within(pids: set[int], ray_tmpdir: Path, timeout_s: float = 20.0) -> set[int]:
    """What is still running after ``timeout_s``: Ray's workers exit a moment after their raylet."""
    deadline = time.monotonic() + timeout_s
    while (left := running(pids) | naming(str(ray_tmpdir))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop_group(up, timeout_s: float) -> tuple[int | None, float]:
    """SIGTERM to ``up``'s whole process group; (exit code or None if still running after ``timeout_s``, seconds)."""
    began = time.monotonic()
    os.killpg(up.process.pid, signal.SIGTERM)
    try:
        code = up.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - began


def test_up_with_default_resources_serves_grpc_and_http_then_stops_in_order_on_a_group_sigterm(
    ray_tmpdir, tiny_target_dir, tiny_draft_dir, tiny_reference, tmp_path
):
    http_port = free_port()
    up = start_cli(["up", "--ray-local-cpus", LOCAL_CPUS, "--http-port", str(http_port), "--served-model-name", "tiny",
                    "--target-args", f"--model {tiny_target_dir}", "--draft-args", f"--model {tiny_draft_dir}"],
                   tmp_path, timeout_s=300, own_group=True)
    try:
        log = up.log_path.read_text()
        assert "Ray CPUs target 0.66, draft 0.66, each of 1 orchestrator replicas 0.66" in log, log
        assert "target serving at 127.0.0.1:" in log  # a local cluster stays on loopback
        prompts_ids, expected = tiny_reference
        texts = {}
        for i in (0, 2):
            msg = pb.GenerateRequest(prompt=TINY_PROMPTS[i], chat=False, max_new_tokens=24, return_token_ids=True,
                                     k=4, drafter=pb.DRAFTER_KIND_MODEL)
            texts[i], ids, code = run_async(generate(up.address, msg))
            assert code == "OK", texts[i]
            assert ids == expected[i], TINY_PROMPTS[i]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0) as client:
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="tiny", prompt=TINY_PROMPTS[0], temperature=0, max_tokens=24, stream=True, extra_body={"k": 4}))
        assert streamed == texts[0]
        ours = {up.process.pid} | {child.pid for child in psutil.Process(up.process.pid).children(recursive=True)}
        ports = listening(ours)
        assert up.port in ports and http_port in ports and len(ours) > 5  # fronts, GCS, raylet, workers, services
        exit_code, stop_s = stop_group(up, GROUP_STOP_BOUND_S)
    finally:
        up.stop(5)  # only if the group stop left it running
    log = up.log_path.read_text()
    assert exit_code == 0 and stop_s < GROUP_STOP_BOUND_S, f"exit {exit_code} after {stop_s:.1f} s:\n{log}"
    order = ["signal received", "application specsplit deleted", "services stopped", "local Ray cluster shut down"]
    positions = [log.find(step) for step in order]
    assert -1 not in positions and positions == sorted(positions), log
    assert not RAY_ERRORS.search(log), log
    assert not gone_within(ours, ray_tmpdir), log
    assert not listening(set(psutil.pids())) & ports, "a port of the stopped command is still open"


def test_up_asking_more_than_the_cluster_has_fails_fast_naming_the_flags(ray_tmpdir, tiny_target_dir):
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "up", "--ray-local-cpus", LOCAL_CPUS, "--target-num-cpus", "4",
         "--target-args", f"--model {tiny_target_dir}", "--port", "0"],
        capture_output=True, text=True, timeout=180,
    )
    elapsed = time.monotonic() - began
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "the target asks for CPU 4, more than any node of the cluster has" in message
    assert "the Ray cluster has CPU 2 in all" in message and "free now" in message
    assert "--target-num-cpus" in message and "--ray-local-cpus" in message
    assert not RAY_ERRORS.search(message), message
    assert elapsed < 120, f"{elapsed:.0f} s"  # the local cluster's start and stop, nothing waited for
    assert not gone_within(set(), ray_tmpdir), "a process of the local cluster is still running"
