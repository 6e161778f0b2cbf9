"""A Ray cluster across the hosts of ``specsplit.bench.hosts``: a head on one host, worker nodes on others.

    with Hosts(["head", "draft-node", "target-node", "client"]) as net:
        with RayNodes(net, "head", {"draft-node": {"draft_node": 1}, "target-node": {"target_node": 1}},
                      workdir) as cluster:
            net.popen("head", ["specsplit", "up", "--ray-address", cluster.address, ...], env=cluster.env)
            cluster.kill("draft-node")            # a node lost: its processes ended, its link taken down

Each node is ``ray start ... --block`` inside its host, with ``--node-ip-address`` its home address, so
Ray's own traffic (GCS, raylets, object transfers) crosses the hosts' links like any other. Every node and
every driver runs with token authentication (``RAY_AUTH_MODE=token``) and one token file the harness
writes (``RAY_AUTH_TOKEN_PATH``): what a real deployment has to hand each machine. No dashboard, a small
object store per node (only small messages cross Ray here). Leaving the block stops the nodes; whatever
they leave is killed when the hosts are deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specsplit.bench.hosts import HostError, Hosts, kill_everything_in

HEAD_PORT = 6379
OBJECT_STORE_BYTES = 80 * 1024 * 1024
JOIN_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 5.0  # then killed: the hosts are deleted next in any case


class RayNodes:
    """A head on ``head`` and a worker node on each host of ``workers`` (host -> custom resources)."""

    def __init__(self, net: Hosts, head: str, workers: dict[str, dict[str, float]], workdir: Path,
                 cpus: float = 1, head_resources: dict[str, float] | None = None,
                 node_loss_s: float | None = None) -> None:
        """``node_loss_s``: about how long the head takes to declare a silent node dead (Ray's health checks:
        by default three misses of 3 s checks with a 10 s timeout; a deployment tunes the same settings)."""
        self.net, self.head, self.workers, self.workdir = net, head, workers, workdir
        self.cpus, self.head_resources = cpus, head_resources or {}
        self.address = f"{net.address(head)}:{HEAD_PORT}"
        # Ray's unix socket paths must fit in 107 bytes: a short temp dir of its own
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rayh-", dir="/tmp"))
        token = workdir / "ray_auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = ray_env(token)
        self.head_env = dict(self.env)
        if node_loss_s is not None:
            check_ms = str(max(int(node_loss_s * 1000 / 3), 100))
            self.head_env.update(RAY_health_check_period_ms=check_ms, RAY_health_check_timeout_ms=check_ms,
                                 RAY_health_check_failure_threshold="3")
        self.nodes: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "RayNodes":
        try:
            self._start(self.head, ["--head", "--port", str(HEAD_PORT), "--include-dashboard=false",
                                    "--temp-dir", str(self.temp_dir)], self.head_resources)
            self.wait_for_nodes(1)
            # one at a time: nodes on one machine share the session's directory, and two starting at once pick
            # the same socket names there (the second raylet fails to bind)
            for joined, (host, resources) in enumerate(self.workers.items(), 2):
                self._start(host, ["--address", self.address], resources)
                self.wait_for_nodes(joined)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, host: str, args: list[str], resources: dict[str, float]) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [ray, "start", "--block", *args, "--node-ip-address", self.net.address(host),
                "--num-cpus", f"{self.cpus:g}", "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--disable-usage-stats", "--resources", json.dumps(resources)]
        log = (self.workdir / f"ray-{host}.log").open("w")
        env = self.head_env if host == self.head else self.env
        self.nodes[host] = self.net.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self, host: str) -> str:
        return (self.workdir / f"ray-{host}.log").read_text(errors="replace")

    def alive_nodes(self, host: str | None = None) -> list[str]:
        """The addresses of the nodes the cluster counts as alive, asked by a driver on ``host`` (the head's)."""
        script = ("import json, ray; ray.init(address='auto', log_to_driver=False); "
                  "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))")
        result = self.net.run(host or self.head, [sys.executable, "-c", script], env={**self.env,
                              "RAY_ADDRESS": self.address}, timeout=60)
        if result.returncode != 0:
            raise HostError(f"a driver on {host or self.head} could not reach the cluster: {result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def wait_for_nodes(self, count: int, timeout_s: float = JOIN_TIMEOUT_S) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            for host, node in self.nodes.items():
                if node.poll() is not None:
                    raise HostError(f"the Ray node on {host} exited {node.returncode}:\n{self.log(host)[-3000:]}")
            with contextlib.suppress(HostError, subprocess.TimeoutExpired, ValueError):
                alive = self.alive_nodes()
                if len(alive) == count:
                    return alive
            if time.monotonic() > deadline:
                raise HostError(f"{count} Ray nodes did not join within {timeout_s:.0f} s:\n"
                                + "\n".join(f"--- {h} ---\n{self.log(h)[-1500:]}" for h in self.nodes))
            time.sleep(1.0)

    def kill(self, host: str) -> None:
        """The node on ``host`` is lost: every process in the host killed, its link taken down."""
        self.net.take_down(host)
        kill_everything_in(self.net.namespaces[host])
        self.nodes.pop(host).wait(10)

    def close(self) -> None:
        """Stop every node at once (each ``ray start --block`` stops its node's processes on SIGTERM)."""
        nodes = [node for node in self.nodes.values() if node.poll() is None]
        self.nodes.clear()
        for node in nodes:
            node.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S  # all of them together
        for node in nodes:
            try:
                node.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def ray_env(token_path: Path) -> dict[str, str]:
    """The environment of a node or driver of a cluster with token authentication from ``token_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path), RAY_USAGE_STATS_ENABLED="0")
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return env
