"""One real local Ray cluster for every Ray test: a head and two worker nodes on 127.0.0.1.

The worker nodes carry the custom resources ``draft_node`` and ``target_node``
(the second also two declared GPUs), so placement by resources can be checked.
No dashboard; Serve runs without its own proxies (our front is the ingress).
Its fixtures reach every test in ``tests/ray/`` (this folder's conftest).
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from specsplit.lmkit.processes import ServiceProcess

OBJECT_STORE = 80 * 1024 * 1024


@dataclass(frozen=True)
class RayCluster:
    address: str
    head_node: str  # node ids (hex)
    draft_node: str
    target_node: str


HEAD_ARGS = {"num_cpus": 2, "include_dashboard": False, "object_store_memory": OBJECT_STORE}
# Ray waits 30 s for the GCS to write its port file; a loaded 2-core CI machine
# can take longer. Allow more, and try a fresh session once before failing.
GCS_WAIT_S = "120"
START_ATTEMPTS = 2
TMP_RAY = Path(tempfile.gettempdir(), "ray")  # where Ray puts its sessions


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback, not the host's external address
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_WAIT_S)
    cluster, started = _start_cluster()
    ray.init(address=cluster.address, namespace="specsplit", log_to_driver=False)
    yield started
    ray.shutdown()
    cluster.shutdown()


def _start_cluster():
    """Head plus the draft and target nodes; a second try on a fresh session, then an error with Ray's logs."""
    from ray.cluster_utils import Cluster

    failures = []
    for _ in range(START_ATTEMPTS):
        before = set(TMP_RAY.glob("session_2*"))
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(**HEAD_ARGS)
            draft = cluster.add_node(num_cpus=1, resources={"draft_node": 1}, object_store_memory=OBJECT_STORE)
            target = cluster.add_node(num_cpus=1, num_gpus=2, resources={"target_node": 1},
                                      object_store_memory=OBJECT_STORE)
            cluster.wait_for_nodes()
            return cluster, RayCluster(cluster.address, cluster.head_node.node_id, draft.node_id, target.node_id)
        except Exception as error:  # noqa: BLE001 - reported below with the logs
            with contextlib.suppress(Exception):
                cluster.shutdown()
            sessions = sorted(set(TMP_RAY.glob("session_2*")) - before)
            for session in sessions:
                _kill_session(session)
            failures.append(f"{type(error).__name__}: {error}\n" + "".join(_diagnose(s) for s in sessions))
    raise RuntimeError("a local Ray cluster did not start:\n" + "\n".join(failures) + _machine_state())


def _kill_session(session: Path) -> None:
    """Stop what a half-started cluster left running (its processes name the session dir)."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(session.name in part for part in process.info["cmdline"] or ()):
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _diagnose(session: Path) -> str:
    """The tails of the GCS's and raylets' own logs, which Ray does not put in its exception."""
    parts = []
    for pattern in ("gcs_server.*", "raylet*.err", "raylet*.out"):
        for log in sorted((session / "logs").glob(pattern)):
            text = log.read_text(errors="replace")[-2000:]
            if text.strip():
                parts.append(f"--- {log} (last 2000 chars) ---\n{text}\n")
    logs = sorted(p.name for p in (session / "logs").glob("*"))
    return "".join(parts) or f"(no GCS or raylet logs under {session}/logs; it holds {logs})\n"


def _machine_state() -> str:
    import psutil

    processes = list(psutil.process_iter(["num_threads", "cmdline"]))
    threads = sum(p.info["num_threads"] or 0 for p in processes)
    for process in processes:
        try:
            process.cpu_percent()
        except psutil.Error:
            pass
    time.sleep(1.0)
    busy = []
    for process in processes:
        try:
            busy.append((process.cpu_percent(), " ".join(process.info["cmdline"] or ())[:160]))
        except psutil.Error:
            pass
    top = "".join(f"\n  {cpu:5.0f}% {command}" for cpu, command in sorted(busy, reverse=True)[:6])
    memory = psutil.virtual_memory()
    return (f"\nload {os.getloadavg()}, {len(psutil.pids())} processes, {threads} threads "
            f"(RLIMIT_NPROC {resource.getrlimit(resource.RLIMIT_NPROC)}), "
            f"{memory.available >> 20} MiB of {memory.total >> 20} MiB free; busiest:{top}")


def start_cli(args: list[str], workdir: Path, timeout_s: float = 180.0, own_group: bool = False) -> ServiceProcess:
    """``python -m specsplit.cli ARGS --port 0 --port-file F``, returned once it serves; with ``own_group``
    it leads a process group (and session) of its own, as a shell or a supervisor starts a command."""
    port_file, log = workdir / "cli.port", workdir / "cli.log"
    port_file.unlink(missing_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "specsplit.cli", *args, "--port", "0", "--port-file", str(port_file)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=own_group,
        )
    started = ServiceProcess(f"specsplit {args[0]}", process, 0, log, stop_grace_s=60.0)
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            started.stop(5)
            raise AssertionError(f"`specsplit {args[0]}` did not start:\n{started.log_tail()}")
        time.sleep(0.1)
    started.port = int(port_file.read_text())
    return started
