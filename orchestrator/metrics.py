"""Prometheus metrics of the orchestrator: requests, tokens, acceptance, K, fallbacks, load."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from orchestrator.link_cost import LinkCosts
from orchestrator.loop import LoopStats

MAX_POSITION = 32  # per-position acceptance is kept for the first 32 draft positions

REQUESTS = Counter("specsplit_requests_total", "Generate calls by final status code", ["code"])
TOKENS = Counter("specsplit_generated_tokens_total", "tokens committed and streamed")
DRAFTED = Counter("specsplit_drafted_tokens_total", "draft tokens sent for verification")
ACCEPTED = Counter("specsplit_accepted_tokens_total", "draft tokens the target accepted")
ROUNDS = Counter("specsplit_rounds_total", "target forward passes (speculative rounds)")
POSITION_DRAFTED = Counter("specsplit_position_drafted_total", "draft tokens verified at this block position",
                           ["position"])
POSITION_ACCEPTED = Counter("specsplit_position_accepted_total", "draft tokens accepted at this block position",
                            ["position"])
K_CHOSEN = Histogram("specsplit_k_chosen", "block size chosen per round", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32))
ACCEPTED_LENGTH = Histogram("specsplit_accepted_length", "tokens committed per target pass (accepted + 1)",
                            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 17, 33))
FALLBACKS = Counter("specsplit_draft_fallback_rounds_total", "rounds decoded without the draft (it was down)")
REOPENS = Counter("specsplit_target_reopens_total", "target sessions rebuilt from committed tokens")
LATE_BLOCKS = Counter("specsplit_draft_late_blocks_total",
                      "draft blocks that missed their round's deadline (the target stepped alone)")
OVERLAP_HITS = Counter("specsplit_overlap_hits_total", "blocks drafted during a verification that were used")
OVERLAP_STARTED = Counter("specsplit_overlap_started_total", "blocks drafted during a verification")
LINK_RTT = Gauge("specsplit_link_rtt_seconds", "smoothed round trip of a link (RFC 6298 srtt)", ["link"])
LINK_RTTVAR = Gauge("specsplit_link_rttvar_seconds", "mean deviation of a link's round trip (rttvar)", ["link"])
ACTIVE = Gauge("specsplit_active_generations", "generations in flight")
ACCEPTANCE = Gauge("specsplit_acceptance_rate_last", "acceptance rate of the last finished generation")


def record_links(links: LinkCosts) -> None:
    for name, rtt in (("draft", links.draft), ("target", links.target)):
        if rtt.samples:
            LINK_RTT.labels(name).set(rtt.srtt)
            LINK_RTTVAR.labels(name).set(rtt.rttvar)


def record_generation(stats: LoopStats, fallback_rounds: int, reopens: int) -> None:
    TOKENS.inc(stats.committed)
    DRAFTED.inc(stats.drafted)
    ACCEPTED.inc(stats.accepted)
    ROUNDS.inc(stats.rounds)
    FALLBACKS.inc(fallback_rounds)
    REOPENS.inc(reopens)
    LATE_BLOCKS.inc(stats.late_blocks)
    OVERLAP_HITS.inc(stats.overlap_hits)
    OVERLAP_STARTED.inc(stats.ahead_started)
    if stats.drafted:
        ACCEPTANCE.set(stats.acceptance_rate)
    for k, drafted, accepted in zip(stats.k_per_round, stats.drafted_per_round, stats.accepted_per_round):
        K_CHOSEN.observe(k)
        ACCEPTED_LENGTH.observe(accepted + 1)
        # A block is accepted left to right: positions < accepted passed, position `accepted` (if drafted) failed.
        for position in range(min(drafted, MAX_POSITION)):
            POSITION_DRAFTED.labels(str(position)).inc()
            if position < accepted:
                POSITION_ACCEPTED.labels(str(position)).inc()
            else:
                break
