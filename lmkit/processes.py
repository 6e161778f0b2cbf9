"""Start draft and target services as separate processes on loopback (demo, bench, tests).

Each service binds port 0 and publishes its port through ``--port-file`` once
its model is loaded and health is SERVING.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    port: int
    log_path: Path
    stop_grace_s: float = 5.0  # a service drains fast; a whole `specsplit up` tears down a Ray app

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace_s: float | None = None) -> int:
        """SIGTERM, then SIGKILL after ``grace_s`` (default ``stop_grace_s``); returns the exit code."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def rss_mb(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MB (``/proc``); None once it has ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass  # it ended between listing and reading
    return None


def restartable_port(host: str = "127.0.0.1") -> int:
    """A free port for a service that will be killed and started again in its place.

    It lies below the kernel's ephemeral range, so while the service is down no other process's
    ``bind(0)`` and no outgoing connection's local port can take it: a port from ``bind(0)`` can
    be handed to another server in that gap, and callers of the old address then reach a stranger.
    """
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port found below the ephemeral range (starts at {low}) on {host}")


def _ephemeral_range() -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999  # Linux's default


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (so a killed Ray actor leaves no service behind)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_service(
    module: str, name: str, args: list[str], workdir: Path, timeout_s: float = 600.0, port: int = 0,
    die_with_parent: bool = False, wrap: Sequence[str] = (),
) -> ServiceProcess:
    """Run ``python -m module --port PORT ...`` (0: a free one) and wait until it serves.

    ``args`` come last, so a ``--host`` among them overrides the loopback default; ``wrap`` goes
    first (e.g. ``ip netns exec NS``, which execs the command: the process is still the service).
    """
    port_file = workdir / f"{name}.port"
    log_path = workdir / f"{name}.log"
    port_file.unlink(missing_ok=True)
    cmd = [*wrap, sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--port-file", str(port_file), *args]
    with log_path.open("a") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    service = ServiceProcess(name, process, 0, log_path)
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None:
            raise ValueError(f"{name} exited with code {process.returncode}:\n{service.log_tail(6)}")
        if time.monotonic() > deadline:
            service.stop()
            raise TimeoutError(f"{name} did not start within {timeout_s:.0f} s:\n{service.log_tail()}")
        time.sleep(0.05)
    service.port = int(port_file.read_text())
    return service


@contextlib.contextmanager
def local_services(target_args: list[str], draft_args: list[str] | None):
    """Draft (optional) and target processes for the duration of the block."""
    with tempfile.TemporaryDirectory(prefix="specsplit-") as tmp:
        started: list[ServiceProcess] = []
        try:
            started.append(start_service("specsplit.target_service.server", "target", target_args, Path(tmp)))
            if draft_args is not None:
                started.append(start_service("specsplit.draft_service.server", "draft", draft_args, Path(tmp)))
            yield started
        finally:
            for service in reversed(started):
                service.stop()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each named process has used so far; {} where /proc cannot tell (another
    platform, or a process gone)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return {}
        used[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return used


def cpu_used(pids: dict[str, int], since: dict[str, float]) -> dict[str, float]:
    """CPU seconds each named process used since ``since`` (an earlier ``cpu_seconds(pids)``)."""
    return {name: used - since[name] for name, used in cpu_seconds(pids).items() if name in since}
