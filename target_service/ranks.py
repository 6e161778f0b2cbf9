"""Start and supervise the N ranks of a tensor-parallel target (torchrun's rendezvous, our signals).

Each rank is this same command with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The supervisor owns the lifecycle:

* SIGTERM/SIGINT go to rank 0 only; it turns NOT_SERVING, drains in-flight
  calls, then tells the followers to exit, and everyone exits 0.
* A rank that dies takes the whole target down: rank 0 is told to stop (its
  health turns NOT_SERVING, in-flight calls fail UNAVAILABLE), stragglers are
  killed after a bound, and the supervisor exits 1 — never a hang.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, argv: list[str], cuda: bool) -> list[subprocess.Popen]:
    port = str(free_port())
    ranks = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if not cuda:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node: ranks talk over loopback
        ranks.append(subprocess.Popen([sys.executable, "-m", "specsplit.target_service.server", *argv], env=env))
    return ranks


def supervise(ranks: list[subprocess.Popen], grace_s: float) -> int:
    """Wait for the ranks; returns the exit code for the whole target."""
    stopping = {"at": None}

    def on_signal(signum, frame):
        if stopping["at"] is None:
            stopping["at"] = time.monotonic()
            ranks[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    failed = False
    while any(p.poll() is None for p in ranks):
        dead = [i for i, p in enumerate(ranks) if p.poll() not in (None, 0)]
        early = [i for i, p in enumerate(ranks) if p.poll() == 0 and stopping["at"] is None]
        if (dead or early) and not failed:
            failed = True
            log.error("rank(s) %s exited (codes %s); stopping the target", dead or early,
                      [ranks[i].returncode for i in dead or early])
            on_signal(signal.SIGTERM, None)
        if stopping["at"] is not None and time.monotonic() - stopping["at"] > grace_s + 15:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    codes = [p.returncode for p in ranks]
    return 1 if failed or any(codes) else 0


def launch(world: int, argv: list[str], cuda: bool, grace_s: float) -> int:
    return supervise(spawn(world, argv, cuda), grace_s)
