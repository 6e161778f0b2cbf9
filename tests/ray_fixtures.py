"""One real local Ray cluster for every Ray test: a head and two worker nodes on 127.0.0.1.

The worker nodes carry the custom resources ``draft_node`` and ``target_node``
(the second also two declared GPUs), so placement by resources can be checked.
No dashboard; Serve runs without its own proxies (our front is the ingress).
Registered for every test module by ``pytest_plugins`` in ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.launcher import ServiceProcess

OBJECT_STORE = 80 * 1024 * 1024


@dataclass(frozen=True)
class RayCluster:
    address: str
    head_node: str  # node ids (hex)
    draft_node: str
    target_node: str


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback, not the host's external address
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": OBJECT_STORE},
    )
    draft = cluster.add_node(num_cpus=1, resources={"draft_node": 1}, object_store_memory=OBJECT_STORE)
    target = cluster.add_node(num_cpus=1, num_gpus=2, resources={"target_node": 1}, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="specsplit", log_to_driver=False)
    yield RayCluster(cluster.address, cluster.head_node.node_id, draft.node_id, target.node_id)
    ray.shutdown()
    cluster.shutdown()


def start_cli(args: list[str], workdir: Path, timeout_s: float = 180.0) -> ServiceProcess:
    """``python -m orchestrator.cli ARGS --port 0 --port-file F``, returned once it serves."""
    port_file, log = workdir / "cli.port", workdir / "cli.log"
    port_file.unlink(missing_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", *args, "--port", "0", "--port-file", str(port_file)],
            stdout=out, stderr=subprocess.STDOUT,
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
