"""The prefill suite's figures: the others' gaps while a long prompt waits, against their gaps before it came."""

import pytest

from specsplit.bench import prefill
from specsplit.bench.prefill import BASELINE_S, window_figures

pytestmark = pytest.mark.unit


def _ticks(start: float, end: float, every: float) -> list[float]:
    return [start + i * every for i in range(int(round((end - start) / every)))]


def test_a_decode_step_and_the_p99_rise_come_from_the_gaps_before_and_during_the_wait():
    sent, first = 10.0, 12.0
    # Two sessions decode every 0.1 s; while the long prompt waits, one stalls 0.5 s once and the other decodes
    # every 0.2 s (every step carries a chunk).
    a = _ticks(sent - 3.0, sent, 0.1) + [10.05, 10.55] + _ticks(10.65, first, 0.1)
    b = _ticks(sent - 3.0, sent, 0.1) + _ticks(10.1, first, 0.2)
    figures = window_figures([a, b], sent, first, BASELINE_S)
    assert figures["step_s"] == pytest.approx(0.1)
    assert figures["others_p99_gap_before_s"] == pytest.approx(0.1)
    assert figures["others_max_gap_s"] == pytest.approx(0.5)
    assert figures["others_median_gap_s"] == pytest.approx(0.1, abs=0.051)
    # Of so few gaps (25) the p99 is the largest, the 0.5 s stall: 4 steps above the 0.1 s before
    assert figures["others_p99_gap_s"] == pytest.approx(0.5)
    assert figures["p99_rise_steps"] == pytest.approx(4.0)
    assert figures["long_ttft_s"] == pytest.approx(2.0)


def test_the_baseline_is_only_the_window_before_the_prompt_arrived():
    """Gaps older than BASELINE_S before the prompt (a session's own prefill, say) are not a decode step."""
    sent, first = 10.0, 10.5
    times = [sent - BASELINE_S - 2.0] + _ticks(sent - BASELINE_S, sent, 0.05) + _ticks(sent, first, 0.05)
    figures = window_figures([times], sent, first, BASELINE_S)
    assert figures["step_s"] == pytest.approx(0.05)
    assert figures["p99_rise_steps"] == pytest.approx(0.0, abs=1e-6)


def test_without_gaps_before_the_prompt_there_is_no_step_to_count_in():
    figures = window_figures([[10.0, 10.2, 10.4]], 10.0, 10.5, BASELINE_S)
    assert figures["step_s"] is None and figures["p99_rise_steps"] is None
    assert prefill._median([None, None]) is None and prefill._median([None, 2.0, 4.0]) == 3.0


def test_the_rank_is_the_nearest_rank_quantile():
    ordered = [float(i) for i in range(200)]
    assert prefill._rank(ordered, 0.99) == 198.0
    assert prefill._rank(ordered, 0.95) == 190.0
    assert prefill._rank([3.0], 0.99) == 3.0


def test_an_event_of_several_tokens_counts_as_that_many_rounds_over_its_gap():
    times: list[float] = []
    prefill.spread(times, 1.0, 1)
    prefill.spread(times, 1.1, 1)
    prefill.spread(times, 1.4, 3)  # text held back for two rounds, then three tokens at once
    assert times == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])
    first: list[float] = []
    prefill.spread(first, 5.0, 2)  # the first event: nothing before it to spread over
    assert first == [5.0, 5.0]
