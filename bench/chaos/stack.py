"""The processes a chaos run drives: target, draft and orchestrator on fixed loopback ports, restartable,
and the emulated link (bench/netem) between the orchestrator and the draft."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.bench.netem import LinkProcess, Shape, start_link
from specsplit.lmkit.processes import ServiceProcess, restartable_port, start_service


@dataclass
class Restartable:
    """A service on a fixed port that can be killed (or drained) and started again in its place."""

    module: str
    name: str
    args: list[str]
    workdir: Path
    port: int = field(default_factory=restartable_port)
    instances: list[ServiceProcess] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def current(self) -> ServiceProcess:
        return self.instances[-1]

    def start(self) -> None:
        label = f"{self.name}-{len(self.instances)}"
        self.instances.append(start_service(self.module, label, self.args, self.workdir, 600, port=self.port))

    def kill(self) -> None:
        os.kill(self.current.process.pid, signal.SIGKILL)
        self.current.process.wait()

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
    """Target, draft and orchestrator processes; the orchestrator reaches the draft through an emulated link."""

    def __init__(self, workdir: Path, target_model: str, draft_args: list[str], grace_s: float,
                 orchestrator_args: list[str]) -> None:
        self.workdir = workdir
        self.grace_s = grace_s
        self.target = Restartable("specsplit.target_service.server", "target", ["--model", target_model], workdir)
        self.draft = Restartable("specsplit.draft_service.server", "draft", draft_args, workdir)
        self._orchestrator_args = [
            "--target", self.target.address, "--tokenizer", target_model, "--grace-s", str(grace_s),
            *orchestrator_args,
        ]
        self.orchestrator: Restartable | None = None
        self.draft_link: LinkProcess | None = None

    def start(self) -> None:
        """Start the services, a plain link (no delay) in front of the draft, then the orchestrator behind it.

        The link outlives draft restarts: the draft comes back on its port and the relay reaches it there.
        """
        self.target.start()
        self.draft.start()
        self.draft_link = start_link(self.draft.address, Shape(), self.workdir, "draft-link")
        args = [*self._orchestrator_args, "--draft", self.draft_link.address]
        self.orchestrator = Restartable("specsplit.orchestrator.server", "orchestrator", args, self.workdir)
        self.orchestrator.start()

    def restart(self, service: Restartable, down_s: float) -> None:
        time.sleep(down_s)
        service.start()

    def pids(self) -> dict[str, int]:
        return {**self.target.pids(), **self.draft.pids(), **(self.orchestrator.pids() if self.orchestrator else {})}

    def stop(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.stop()
        if self.draft_link is not None:
            self.draft_link.stop()
        for service in (self.draft, self.target):
            service.stop()
