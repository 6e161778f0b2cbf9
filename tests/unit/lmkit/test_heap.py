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
