"""The fault schedule: which faults land when, drawn from a seed, printed and reproducible."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Every kind the soak injects; each schedule draws them in turn so that all appear about equally often.
KINDS = (
    "draft_kill",  # SIGKILL the draft service (across hosts: one replica of the pool), start it again on its port
    "target_kill",  # SIGKILL the target service (across hosts: one replica of the pool), start it again
    "draft_stall",  # the emulated draft link forwards nothing for a while
    "draft_delay",  # the emulated draft link adds a one-way delay spike
    "client_cancel",  # a client cancels its stream mid-generation
    "malformed",  # a request whose bytes do not parse
    "bad_request",  # a well-formed request with an invalid field
    "oversize",  # a prompt longer than the model's context
    "orchestrator_drain",  # SIGTERM the orchestrator (it drains), start it again
)
# Across hosts, with pools: a target or draft replica's host cut off for a while (no reset: its link goes down).
HOSTS_KINDS = (*KINDS, "partition")


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the load starts
    kind: str
    hold_s: float = 0.0  # how long a stall or delay spike lasts; for a kill, the downtime before the restart
    delay_ms: float = 0.0  # draft_delay: one-way delay added

    def __str__(self) -> str:
        extra = f" hold {self.hold_s:.1f}s" if self.hold_s else ""
        extra += f" delay {self.delay_ms:.0f}ms" if self.delay_ms else ""
        return f"{self.at_s:8.1f}s  {self.kind}{extra}"


def draw(seed: int, duration_s: float, every_s: float, kinds: tuple[str, ...] = KINDS,
         warmup_s: float = 5.0, quiet_tail_s: float = 5.0) -> list[Fault]:
    """Faults roughly every ``every_s`` seconds (jittered), kinds cycling through a seeded shuffle.

    The first ``warmup_s`` and the last ``quiet_tail_s`` seconds stay fault-free, so the run also has
    undisturbed requests to compare with and ends with every service up.
    """
    if every_s <= 0:
        raise ValueError(f"--fault-every-s must be > 0, got {every_s}")
    rng = random.Random(seed)
    faults: list[Fault] = []
    order: list[str] = []
    t = warmup_s + rng.uniform(0, every_s)
    while t < duration_s - quiet_tail_s:
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        kind = order.pop()
        hold = {"draft_kill": rng.uniform(0.5, 3.0), "target_kill": rng.uniform(0.2, 2.0),
                "draft_stall": rng.uniform(1.0, 6.0), "draft_delay": rng.uniform(2.0, 8.0),
                "orchestrator_drain": rng.uniform(0.2, 1.0)}.get(kind, 0.0)
        if kind == "partition":  # drawn apart, so the loopback kinds' schedules stay what a seed gave before
            hold = rng.uniform(0.5, 4.0)
        delay = rng.choice((10.0, 50.0, 200.0)) if kind == "draft_delay" else 0.0
        faults.append(Fault(round(t, 2), kind, round(hold, 2), delay))
        t += every_s * rng.uniform(0.5, 1.5)
    return faults
