"""Holds a chaos run's recorded history against specsplit's promises. Pure: no I/O.

* A generation that completed OK carries exactly its fault-free reference's
  tokens: none lost, duplicated or changed.
* A generation that failed failed with a documented status, and every token it
  had streamed is a prefix of the reference: nothing a client was sent is ever
  contradicted.
* No stream outlived its deadline.
* Requests built to fail (malformed, invalid, oversize) fail with the status
  that says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

# What a client of specsplit may be answered besides OK, per the contract (docs/reliability.md).
DOCUMENTED = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED", "INVALID_ARGUMENT"})
# The statuses a request built to fail may get: its own, or the ones any request may get while a service is down.
EXPECTED_FAILURE = {
    "malformed": frozenset({"INVALID_ARGUMENT"}),
    "bad_request": frozenset({"INVALID_ARGUMENT"}),
    "oversize": frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
}
_ANY_TIME = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})  # orchestrator draining or at its admission limit


@dataclass
class Record:
    """One request as its client saw it."""

    request_id: int
    client: int
    kind: str  # "generate", "cancel" (the client cancels it mid-stream), or a key of EXPECTED_FAILURE
    entry: int  # catalogue entry (-1 for requests built to fail)
    started_s: float  # seconds since the load started
    ended_s: float
    deadline_s: float  # the client's timeout for the call
    code: str  # "OK", a grpc status name, or "HANG" (the watchdog ended it past its deadline)
    tokens: list[int] = field(default_factory=list)  # token ids as streamed
    details: str = ""


@dataclass
class Verdict:
    requests_by_outcome: dict[str, int]
    tokens_checked: int
    mismatches: list[str]  # completed generations whose tokens differ from the reference
    contradicted: list[str]  # failed generations that had streamed a token the reference contradicts
    undocumented: list[str]  # failures with a status the contract does not name
    wrong_failures: list[str]  # requests built to fail that got something else
    hangs: list[str]

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.contradicted or self.undocumented or self.wrong_failures or self.hangs)


def check(records: Iterable[Record], references: Mapping[int, Sequence[int]], hang_slack_s: float = 10.0) -> Verdict:
    """Every record against its reference (``references[entry]``: the fault-free token ids)."""
    outcomes: dict[str, int] = {}
    verdict = Verdict(outcomes, 0, [], [], [], [], [])
    for r in records:
        outcomes[f"{r.kind}:{r.code}"] = outcomes.get(f"{r.kind}:{r.code}", 0) + 1
        label = f"#{r.request_id} ({r.kind}, entry {r.entry}, client {r.client}, {r.code})"
        if r.code == "HANG" or r.ended_s - r.started_s > r.deadline_s + hang_slack_s:
            verdict.hangs.append(label)
            continue
        if r.kind in EXPECTED_FAILURE:
            if r.code not in EXPECTED_FAILURE[r.kind] | _ANY_TIME:
                verdict.wrong_failures.append(f"{label}: {r.details}")
            continue
        if r.code != "OK" and r.code not in DOCUMENTED:
            verdict.undocumented.append(f"{label}: {r.details}")
        want = list(references[r.entry])
        verdict.tokens_checked += len(r.tokens)
        if r.code == "OK" and r.kind == "generate":
            if r.tokens != want:
                verdict.mismatches.append(f"{label}: {_diff(r.tokens, want)}")
        elif r.tokens != want[: len(r.tokens)]:
            verdict.contradicted.append(f"{label}: {_diff(r.tokens, want)}")
    return verdict


def _diff(got: Sequence[int], want: Sequence[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"{len(got)} tokens vs {len(want)} expected, first difference at {at}"


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float


def overlaps(record: Record, windows: Sequence[Window]) -> bool:
    return any(record.started_s < w.end_s and w.start_s < record.ended_s for w in windows)


def latency_summary(records: Sequence[Record]) -> dict:
    """p50/p99 end-to-end latency and tokens/s of completed generations."""
    done = [r for r in records if r.kind == "generate" and r.code == "OK"]
    if not done:
        return {"requests": 0}
    latencies = sorted(r.ended_s - r.started_s for r in done)
    span = max(r.ended_s for r in done) - min(r.started_s for r in done)
    return {
        "requests": len(done),
        "p50_latency_s": round(statistics.median(latencies), 3),
        "p99_latency_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "tokens_per_request_s": round(sum(len(r.tokens) / max(r.ended_s - r.started_s, 1e-9) for r in done)
                                      / len(done), 2),
        "span_s": round(span, 1),
    }


def rss_growth(series_by_instance: Mapping[str, Sequence[float]], warmup_fraction: float = 1 / 3) -> dict[str, float]:
    """Per process instance, RSS growth (%) from the end of its warm-up to its last sample."""
    growth = {}
    for name, series in series_by_instance.items():
        if len(series) >= 6:
            base = series[int(len(series) * warmup_fraction)]
            growth[name] = round(100.0 * (series[-1] - base) / base, 2) if base else 0.0
    return growth
