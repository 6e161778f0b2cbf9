"""specsplit.bench.load's pure parts: Poisson arrivals, percentiles, and goodput against the SLOs."""

from __future__ import annotations

import statistics

import pytest

from specsplit.bench.load import Sample, arrivals, percentiles, summarise

pytestmark = pytest.mark.unit


def test_arrivals_are_poisson_at_the_rate_and_reproducible():
    times = arrivals(4.0, 4000, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and times == arrivals(4.0, 4000, seed=1) and times != arrivals(4.0, 4000, seed=2)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: sd = mean


def test_percentiles_interpolate_between_order_statistics():
    cut = percentiles([float(v) for v in range(1, 102)])  # 1 .. 101
    assert (cut["p50"], cut["p90"], cut["p99"], cut["mean"]) == (51.0, 91.0, 100.0, 51.0)
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0, "mean": 2.0} and percentiles([]) == {}


def test_goodput_counts_only_completed_requests_within_both_slos():
    fast = Sample(0.0, ttft=0.5, e2e=1.4, tokens=10, itl=[0.1] * 9, mean_k=2.0, acceptance_rate=0.5)  # tpot 0.1
    slow_tokens = Sample(1.0, ttft=0.5, e2e=3.2, tokens=10, itl=[0.3] * 9, mean_k=4.0)  # tpot 0.3
    slow_first = Sample(2.0, ttft=3.0, e2e=3.9, tokens=10, itl=[0.1] * 9)
    failed = Sample(3.0, error="HTTP 429: busy")
    row = summarise([fast, slow_tokens, slow_first, failed], wall=10.0, slo_ttft=2.0, slo_tpot=0.15)
    assert fast.tpot == pytest.approx(0.1) and failed.tpot is None
    assert (row["completed"], row["errors"], row["goodput_req_per_s"], row["slo_attained"]) == (3, ["HTTP 429: busy"],
                                                                                                  0.1, 0.25)
    assert row["request_throughput"] == 0.3 and row["output_tokens_per_s"] == 3.0 and row["tokens_per_chunk"] == 1.0
    assert row["mean_k"] == 3.0 and row["acceptance_rate"] == 0.5  # over the requests that report them
