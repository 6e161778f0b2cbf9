"""Freezing the start-up heap: start-up garbage is collected first, everything alive is left out of later
collections, and what is allocated afterwards is still collected."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent('''
    import gc, weakref
    import torch  # a serving process's imports: many tracked objects
    from specsplit.lmkit.heap import freeze_startup_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    before = cycle()  # start-up garbage: a cycle nothing refers to
    kept = Node()
    frozen = freeze_startup_heap("test")
    assert before() is None, "start-up garbage was frozen, not collected"
    assert frozen == gc.get_freeze_count() > 10_000, frozen
    assert not any(o is kept for o in gc.get_objects()), "a start-up object is still walked by collections"
    after = cycle()
    gc.collect()
    assert after() is None, "a cycle made after the freeze was not collected"
    print("ok", frozen)
''')


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


def test_the_collector_clock_counts_and_times_each_pass_by_generation():
    import gc

    from specsplit.lmkit.heap import GC_PAUSE, CollectorClock

    clock = CollectorClock()
    observed = GC_PAUSE.labels("1")._sum.get()
    gc.callbacks.append(clock)
    try:
        gc.collect(1)
    finally:
        gc.callbacks.remove(clock)
    first = clock.take()
    assert first["passes"][1] == 1 and first["seconds"][1] > 0
    assert first["longest_s"][1] == pytest.approx(first["seconds"][1], abs=1e-6)
    assert GC_PAUSE.labels("1")._sum.get() > observed  # and each pass is in the Prometheus histogram
    second = clock.take()  # the longest pass is per take; passes and seconds add up
    assert second["passes"] == first["passes"] and second["longest_s"] == [0.0, 0.0, 0.0]
