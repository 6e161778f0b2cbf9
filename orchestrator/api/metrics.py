"""Metrics of the orchestrator: requests, latencies, tokens, speculation, K, fallbacks.

Names follow vLLM's where they mean the same thing, with ``specsplit_`` for ``vllm:``
(``vllm:spec_decode_num_accepted_tokens_total`` is ``specsplit_spec_decode_num_accepted_tokens_total``),
so dashboards written for vLLM map by a prefix. Each metric is declared once here and recorded
through one of two backends: ``prometheus`` (default; ``prometheus_client``'s registry, served by
``--metrics-port`` of a plain ``specsplit serve``) or ``ray`` (``ray.util.metrics``, for Serve
replicas: each node's metrics agent aggregates them for Prometheus, with Ray's ``ray_`` prefix).
``use_backend("ray")`` switches a process (a replica calls it first thing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import prometheus_client

from specsplit.orchestrator.decode.loop import LoopStats
from specsplit.orchestrator.decode.policy.measure import Links

MAX_POSITION = 32  # per-position acceptance is kept for the first 32 draft positions
_backend = "prometheus"

# Latency buckets, seconds (close to vLLM's, so the same SLO thresholds read the same).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)


def exposition() -> tuple[bytes, str] | None:
    """This process's metrics in Prometheus' text format and its content type, as ``--metrics-port`` serves them;
    None under the ``ray`` backend, whose metrics Ray's agents export."""
    if _backend != "prometheus":
        return None
    return prometheus_client.generate_latest(prometheus_client.REGISTRY), prometheus_client.CONTENT_TYPE_LATEST


def use_backend(name: str) -> None:
    """Record through ``prometheus`` (this process's registry) or ``ray`` (Ray's metrics agent)."""
    global _backend
    if name not in ("prometheus", "ray"):
        raise ValueError(f"metrics backend must be 'prometheus' or 'ray', got {name!r}")
    _backend = name


@dataclass
class Metric:
    """A counter, gauge or histogram, recorded through the process's backend."""

    kind: str  # "counter" | "gauge" | "histogram"
    name: str  # without the _total suffix of a counter
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    _impl: dict = field(default_factory=dict, repr=False)  # backend name -> its metric object

    def __post_init__(self) -> None:
        self._get("prometheus")  # present (at zero) in /metrics from the start

    def inc(self, value: float = 1.0, **labels: str) -> None:
        if value:  # Ray refuses increments of 0
            self._record("inc", value, labels)

    def dec(self, value: float = 1.0, **labels: str) -> None:
        self._record("dec", value, labels)

    def set(self, value: float, **labels: str) -> None:
        self._record("set", value, labels)

    def observe(self, value: float, **labels: str) -> None:
        self._record("observe", value, labels)

    def _record(self, op: str, value: float, labels: dict[str, str]) -> None:
        impl = self._get(_backend)
        if _backend == "prometheus":
            target = impl.labels(**labels) if self.labels else impl
            getattr(target, op)(value)
        elif op == "dec":  # a Ray gauge is set, not moved: keep the value here
            self._ray_gauge_move(impl, -value, labels)
        elif op == "inc" and self.kind == "gauge":
            self._ray_gauge_move(impl, value, labels)
        else:
            getattr(impl, {"inc": "inc", "set": "set", "observe": "observe"}[op])(value, tags=labels or None)

    def _ray_gauge_move(self, impl, delta: float, labels: dict[str, str]) -> None:
        key = ("value", tuple(sorted(labels.items())))
        self._impl[key] = self._impl.get(key, 0.0) + delta
        impl.set(self._impl[key], tags=labels or None)

    def _get(self, backend: str):
        if backend not in self._impl:
            self._impl[backend] = _make_prometheus(self) if backend == "prometheus" else _make_ray(self)
        return self._impl[backend]


def _make_prometheus(metric: Metric):
    cls = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge,
           "histogram": prometheus_client.Histogram}[metric.kind]
    extra = {"buckets": metric.buckets} if metric.kind == "histogram" else {}
    return cls(metric.name, metric.doc, list(metric.labels), **extra)


def _make_ray(metric: Metric):
    from ray.util import metrics as ray_metrics

    if metric.kind == "histogram":  # Ray wants strictly positive boundaries
        boundaries = [b for b in metric.buckets if b > 0]
        return ray_metrics.Histogram(metric.name, metric.doc, boundaries=boundaries, tag_keys=metric.labels)
    cls = ray_metrics.Counter if metric.kind == "counter" else ray_metrics.Gauge
    return cls(metric.name, metric.doc, tag_keys=metric.labels)


# -- requests and latencies (vLLM: vllm:<name>) -------------------------------------------------------
REQUESTS = Metric("counter", "specsplit_requests", "Generate calls and HTTP requests by final status code", ("code",))
SUCCESS = Metric("counter", "specsplit_request_success", "finished generations by finish reason",
                 ("finished_reason",))
RUNNING = Metric("gauge", "specsplit_num_requests_running", "generations in flight")
REFUSED = Metric("counter", "specsplit_refused_requests",
                 "requests refused or cut short to protect the server, by reason (docs/http-api.md, Limits)",
                 ("reason",))
QUEUE_TIME = Metric("histogram", "specsplit_request_queue_time_seconds",
                    "arrival until the target session is open (tokenizing, admission, draft and target session set-up)",
                    buckets=REQUEST_BUCKETS)
TTFT = Metric("histogram", "specsplit_time_to_first_token_seconds", "arrival until the first token is committed",
              buckets=TTFT_BUCKETS)
ITL = Metric("histogram", "specsplit_inter_token_latency_seconds",
             "time between successive rounds that commit tokens (a round commits accepted + 1 tokens at once)",
             buckets=ITL_BUCKETS)
E2E = Metric("histogram", "specsplit_e2e_request_latency_seconds", "arrival until the generation finished",
             buckets=REQUEST_BUCKETS)
PROMPT_TOKENS = Metric("counter", "specsplit_prompt_tokens", "prompt tokens of started generations")
GENERATION_TOKENS = Metric("counter", "specsplit_generation_tokens", "tokens committed and streamed")

# -- speculation (vLLM: vllm:spec_decode_*) ------------------------------------------------------------
DRAFTS = Metric("counter", "specsplit_spec_decode_num_drafts", "rounds that verified at least one draft token")
DRAFT_TOKENS = Metric("counter", "specsplit_spec_decode_num_draft_tokens", "draft tokens sent for verification")
ACCEPTED_TOKENS = Metric("counter", "specsplit_spec_decode_num_accepted_tokens", "draft tokens the target accepted")
ACCEPTED_PER_POS = Metric("counter", "specsplit_spec_decode_num_accepted_tokens_per_pos",
                          "draft tokens accepted at this block position", ("position",))
DRAFTED_PER_POS = Metric("counter", "specsplit_spec_decode_num_draft_tokens_per_pos",
                         "draft tokens verified at this block position (K adapts, so not every round drafts K)",
                         ("position",))

# -- specsplit's own ----------------------------------------------------------------------------------
ROUNDS = Metric("counter", "specsplit_rounds", "target forward passes (speculative rounds)")
K_CHOSEN = Metric("histogram", "specsplit_k_chosen", "block size chosen per round",
                  buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32))
ACCEPTED_LENGTH = Metric("histogram", "specsplit_accepted_length", "tokens committed per target pass (accepted + 1)",
                         buckets=(1, 2, 3, 4, 5, 6, 8, 10, 17, 33))
FALLBACKS = Metric("counter", "specsplit_draft_fallback_rounds", "rounds decoded without the draft (it was down)")
REOPENS = Metric("counter", "specsplit_target_reopens", "target sessions rebuilt from committed tokens")
ACCEPTANCE = Metric("gauge", "specsplit_acceptance_rate_last", "acceptance rate of the last finished generation")

# -- links ----------------------------------------------------------------------------------------------
LATE_BLOCKS = Metric("counter", "specsplit_draft_late_blocks",
                     "draft blocks that missed their round's deadline (the target stepped alone)")
OVERLAP_HITS = Metric("counter", "specsplit_overlap_hits", "blocks drafted during a verification that were used")
OVERLAP_STARTED = Metric("counter", "specsplit_overlap_started", "blocks drafted during a verification")
LINK_RTT = Metric("gauge", "specsplit_link_rtt_seconds", "smoothed round trip of a link (RFC 6298 srtt)", ("link",))
LINK_RTTVAR = Metric("gauge", "specsplit_link_rttvar_seconds", "mean deviation of a link's round trip (rttvar)",
                     ("link",))


def record_links(links: Links) -> None:
    for name, rtt in (("draft", links.draft), ("target", links.target)):
        if rtt.samples:
            LINK_RTT.set(rtt.srtt, link=name)
            LINK_RTTVAR.set(rtt.rttvar, link=name)


class RequestTimer:
    """One generation's timeline, from its arrival: queue time, first token, gaps between rounds, end to end."""

    def __init__(self, arrived: float | None = None) -> None:
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.last_token: float | None = None
        self.first_token_s: float | None = None  # seconds from arrival, once a token was committed

    def opened(self) -> None:
        QUEUE_TIME.observe(time.perf_counter() - self.arrived)

    def committed(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if self.last_token is None:
            self.first_token_s = now - self.arrived
            TTFT.observe(self.first_token_s)
        else:
            ITL.observe(now - self.last_token)
        self.last_token = now

    def finished(self, reason: str) -> None:
        E2E.observe(time.perf_counter() - self.arrived)
        SUCCESS.inc(finished_reason=reason)


def record_generation(stats: LoopStats, prompt_tokens: int, fallback_rounds: int, reopens: int) -> None:
    PROMPT_TOKENS.inc(prompt_tokens)
    GENERATION_TOKENS.inc(stats.committed)
    DRAFT_TOKENS.inc(stats.drafted)
    ACCEPTED_TOKENS.inc(stats.accepted)
    DRAFTS.inc(sum(1 for drafted in stats.drafted_per_round if drafted))
    ROUNDS.inc(stats.rounds)
    FALLBACKS.inc(fallback_rounds)
    REOPENS.inc(reopens)
    LATE_BLOCKS.inc(stats.late_blocks)
    OVERLAP_HITS.inc(stats.overlap_hits)
    OVERLAP_STARTED.inc(stats.ahead_started)
    if stats.drafted:
        ACCEPTANCE.set(stats.acceptance_rate)
    drafted_at = [0] * MAX_POSITION
    accepted_at = [0] * MAX_POSITION
    for k, drafted, accepted in zip(stats.k_per_round, stats.drafted_per_round, stats.accepted_per_round):
        K_CHOSEN.observe(k)
        ACCEPTED_LENGTH.observe(accepted + 1)
        # A block is accepted left to right: positions < accepted passed, position `accepted` (if drafted) failed.
        for position in range(min(drafted, MAX_POSITION)):
            drafted_at[position] += 1
            accepted_at[position] += position < accepted
    for position in range(MAX_POSITION):
        DRAFTED_PER_POS.inc(drafted_at[position], position=str(position))
        ACCEPTED_PER_POS.inc(accepted_at[position], position=str(position))
