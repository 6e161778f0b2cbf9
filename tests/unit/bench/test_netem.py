"""The emulated link's schedule (``specsplit.bench.netem``): when each chunk leaves, given its arrival and the shape.

The relay processes that run this schedule are measured in tests/services/test_netem.py.
"""

from __future__ import annotations

import random

import pytest

from specsplit.bench.netem import Shape, _Schedule

pytestmark = pytest.mark.unit


def schedule(shape: Shape, seed: int = 0) -> _Schedule:
    return _Schedule(lambda: shape, random.Random(seed))


def test_a_chunk_leaves_after_the_delay_and_its_serialisation():
    s = schedule(Shape.from_ms(5.0, rate_mbit=8.0))  # 8 Mbit/s: 1000 bytes take 1 ms
    assert s.due(1.0, 1000) == pytest.approx(1.0 + 0.001 + 0.005)
    # the next chunk, read at once, queues behind the first's serialisation
    assert s.due(1.0, 1000) == pytest.approx(1.0 + 0.002 + 0.005)


def test_jitter_never_reorders_bytes_and_loss_adds_the_retransmission():
    s = schedule(Shape.from_ms(2.0, jitter_ms=3.0), seed=3)
    dues = [s.due(i * 1e-4, 100) for i in range(2000)]
    assert dues == sorted(dues)  # head-of-line blocking: a chunk drawn a short delay waits behind the one ahead
    lossy = schedule(Shape.from_ms(1.0, loss=0.5, retransmit_ms=50), seed=4)
    held = [lossy.due(float(i), 10) - i for i in range(400)]  # 1 s apart: no chunk waits behind another
    assert {round(h, 6) for h in held} == {0.001, 0.051}
    assert 0.4 < sum(h > 0.01 for h in held) / len(held) < 0.6


def test_a_changed_shape_applies_to_the_next_chunk_and_keeps_the_order():
    shape = [Shape.from_ms(20.0)]
    s = _Schedule(lambda: shape[0], random.Random(0))
    assert s.due(0.0, 1) == pytest.approx(0.020)
    shape[0] = Shape.from_ms(1.0)  # the spike ends: a chunk read 1 ms later still leaves after the one ahead
    assert s.due(0.001, 1) == pytest.approx(0.020)
    assert s.due(0.030, 1) == pytest.approx(0.031)


def test_bad_shapes_are_refused():
    for bad in (dict(delay_ms=-1), dict(delay_ms=1, jitter_ms=-1), dict(delay_ms=1, loss=1.0)):
        with pytest.raises(ValueError, match="must be >= 0"):
            Shape.from_ms(**bad)
