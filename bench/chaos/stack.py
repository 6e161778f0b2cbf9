"""The processes a chaos run drives: target, draft and orchestrator, restartable, and an emulated link
(bench/netem) between the orchestrator and each draft.

On loopback there is one of each. Across hosts (``specsplit.bench.hosts``) each target and draft replica
runs on a host of its own (``t1``, ``t2``, ... and ``d1``, ``d2``, ...), the orchestrator on ``orch``
serves both pools, each draft's link is a relay on the router host, and a replica's host can be cut off.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.bench.hosts import Hosts
from specsplit.bench.netem import LinkProcess, Shape, start_link
from specsplit.lmkit.processes import ServiceProcess, restartable_port, start_service

TARGET = "specsplit.target_service.server"
DRAFT = "specsplit.draft_service.server"
ORCHESTRATOR = "specsplit.orchestrator.api.server"


@dataclass
class Restartable:
    """A service on a fixed port that can be killed (or drained) and started again in its place; on loopback,
    or on ``host`` of ``net``."""

    module: str
    name: str
    args: list[str]
    workdir: Path
    net: Hosts | None = None
    host: str = ""
    port: int = field(default_factory=restartable_port)
    instances: list[ServiceProcess] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.net.address(self.host) if self.net else '127.0.0.1'}:{self.port}"

    @property
    def current(self) -> ServiceProcess:
        return self.instances[-1]

    def start(self) -> None:
        label = f"{self.name}-{len(self.instances)}"
        if self.net is None:
            self.instances.append(start_service(self.module, label, self.args, self.workdir, 600, port=self.port))
        else:
            self.instances.append(
                self.net.start_service(self.host, self.module, label, self.args, self.workdir, 600, port=self.port)
            )

    def kill(self) -> None:
        os.kill(self.current.process.pid, signal.SIGKILL)
        self.current.process.wait()

    def kill_and_restart(self) -> None:
        """SIGKILL the current instance and start another in its place at once."""
        self.kill()
        self.start()

    def drain(self, grace_s: float) -> int:
        """SIGTERM and wait for the drain; the exit code (killed after grace + 10 s if it does not stop)."""
        return self.current.stop(grace_s + 10.0)

    def stop(self) -> None:
        for instance in self.instances:
            instance.stop()

    def pids(self) -> dict[str, int]:
        """Live instances by name, for RSS sampling."""
        return {f"{self.name}-{i}": s.process.pid for i, s in enumerate(self.instances) if s.process.poll() is None}


class Stack:
    """Target and draft replicas (``replicas`` of each) and an orchestrator over them, reaching each draft
    through an emulated link; on loopback, or across the hosts of ``net`` (one replica a host)."""

    def __init__(self, workdir: Path, target_model: str, draft_args: list[str], grace_s: float,
                 orchestrator_args: list[str], net: Hosts | None = None, replicas: int = 1) -> None:
        if replicas < 1 or (net is None and replicas > 1):
            raise ValueError("a stack has at least one replica of each service, and more only across hosts")
        self.workdir = workdir
        self.grace_s = grace_s
        self.net = net

        def replica(module: str, role: str, args: list[str], i: int) -> Restartable:
            if net is None:
                return Restartable(module, role, args, workdir)
            host = f"{role[0]}{i + 1}"
            return Restartable(module, f"{role}-{host}", args, workdir, net, host)

        self.targets = [replica(TARGET, "target", ["--model", target_model], i) for i in range(replicas)]
        self.drafts = [replica(DRAFT, "draft", draft_args, i) for i in range(replicas)]
        self._orchestrator_args = [
            "--target", ",".join(t.address for t in self.targets), "--tokenizer", target_model,
            "--grace-s", str(grace_s), *orchestrator_args,
        ]
        self.orchestrator: Restartable | None = None
        self.draft_links: list[LinkProcess] = []

    @staticmethod
    def hosts(replicas: int) -> list[str]:
        """The hosts a stack of ``replicas`` needs across hosts (``client``: where the load runs)."""
        return ["client", "orch", *(f"{role}{i + 1}" for role in "td" for i in range(replicas))]

    def start(self) -> None:
        """Start the services, a plain link (no delay) in front of each draft, then the orchestrator behind them.

        A link outlives its draft's restarts: the draft comes back on its port and the relay reaches it there.
        """
        for service in (*self.targets, *self.drafts):
            service.start()
        addresses = []
        for draft in self.drafts:
            if self.net is None:
                link = start_link(draft.address, Shape(), self.workdir, "draft-link")
                address = link.address
            else:
                address, link = self.net.relay(draft.host, draft.port, Shape(), self.workdir, f"{draft.name}-link")
            self.draft_links.append(link)
            addresses.append(address)
        args = [*self._orchestrator_args, "--draft", ",".join(addresses)]
        net = {"net": self.net, "host": "orch"} if self.net else {}
        self.orchestrator = Restartable(ORCHESTRATOR, "orchestrator", args, self.workdir, **net)
        self.orchestrator.start()

    def restart(self, service: Restartable, down_s: float) -> None:
        time.sleep(down_s)
        service.start()

    def partition(self, service: Restartable, hold_s: float) -> None:
        """Cut ``service``'s host off (its link down: no reset reaches anyone) for ``hold_s``, then mend it."""
        if self.net is None:
            raise ValueError("a partition cuts a host's link: only a stack across hosts has one")
        self.net.take_down(service.host)
        try:
            time.sleep(hold_s)
        finally:
            self.net.bring_up(service.host)

    def pids(self) -> dict[str, int]:
        services = [*self.targets, *self.drafts, *([self.orchestrator] if self.orchestrator else [])]
        return {name: pid for service in services for name, pid in service.pids().items()}

    def stop(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.stop()
        for link in self.draft_links:
            link.stop()
        for service in (*self.drafts, *self.targets):
            service.stop()
