"""The emulated link (``specsplit.bench.netem``): a relay process measured against what it was asked.

The relay tests start real relay processes in front of a TCP echo server on
127.0.0.1: the added round trip is what was asked within 10 %, a stall holds
bytes until resumed, and ``set_shape`` changes the delay of a running link (a
delay spike) and back. The schedule they follow is tested alone in
tests/unit/bench/test_netem.py.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time

import pytest

from specsplit.bench.netem import LinkProcess, Shape, start_link
from specsplit.bench.netem_check import _Echo, ping_pong_s, self_check

pytestmark = pytest.mark.services


def test_the_relay_adds_the_round_trip_it_was_asked_for(tmp_path):
    report = self_check(Shape.from_ms(2.0), tmp_path, pings=100)
    assert abs(report["error"]) <= 0.10, report
    assert report["relay"]["up"]["chunks"] >= 100 and report["relay"]["down"]["chunks"] >= 100


def median_rtt_s(link: LinkProcess, count: int = 15) -> float:
    return statistics.median(ping_pong_s(link.address, count))


def test_a_running_link_takes_a_delay_spike_a_stall_and_recovers(tmp_path):
    echo = _Echo()
    link = start_link(echo.address, Shape.from_ms(1.0), tmp_path, "spiky")
    try:
        assert 0.0018 < median_rtt_s(link) < 0.010
        link.set_shape(Shape.from_ms(25.0))  # a delay spike: both directions, from the next byte on
        assert 0.048 < median_rtt_s(link, 5) < 0.080
        link.set_shape(Shape.from_ms(1.0), down=Shape.from_ms(10.0))  # asymmetric: 1 ms up, 10 ms down
        assert 0.0105 < median_rtt_s(link) < 0.025
        link.set_shape(Shape.from_ms(1.0))
        assert median_rtt_s(link) < 0.010

        link.stall()
        threading.Timer(0.3, link.resume).start()
        start = time.perf_counter()
        ping_pong_s(link.address, 1)  # held while the link is stalled, delivered once it resumes
        assert time.perf_counter() - start >= 0.28
        assert median_rtt_s(link) < 0.010
    finally:
        stats = link.stop()
        echo.close()
    assert stats["shape_changes"] == 3
    assert stats["up_shape"] == stats["down_shape"] == {**Shape.from_ms(1.0).__dict__}


def test_a_bad_control_file_is_refused_and_the_link_keeps_its_shape(tmp_path):
    echo = _Echo()
    link = start_link(echo.address, Shape.from_ms(1.0), tmp_path, "refusing")
    try:
        link.control_path.write_text('{"generation": 7, "up": {"delay_s": -1}}')
        link.service.process.send_signal(signal.SIGHUP)
        applied = link.control_path.with_name(link.control_path.name + ".applied")
        deadline = time.monotonic() + 5
        while not applied.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "must be >= 0" in applied.read_text()
        assert median_rtt_s(link) < 0.010 and link.service.process.poll() is None
        link.set_shape(Shape.from_ms(2.0))  # and the next good one is taken
    finally:
        stats = link.stop()
        echo.close()
    assert stats["shape_changes"] == 1
