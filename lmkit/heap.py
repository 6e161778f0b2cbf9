"""A serving process's start-up heap, frozen out of garbage collection.

Imports, the model, the tokenizer and compiled code leave a few hundred
thousand tracked objects that live as long as the process, and CPython's
oldest-generation collection walks every one of them whenever it runs, the
process stopped meanwhile. Once a process is ready to serve, ``gc.freeze()``
moves them to a permanent generation that no collection walks (vLLM's engine
core and SGLang's servers do the same after warm-up). The collector stays on
for everything allocated afterwards, and its passes are timed
(``CollectorClock``, Prometheus ``specsplit_gc_pause_seconds``).
"""

from __future__ import annotations

import gc
import logging
import time

from prometheus_client import Histogram

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect what start-up left unreachable, then freeze every object alive now; returns how many are frozen.
    The process's collector passes are timed from here on (``collector_clock``)."""
    gc.collect()
    gc.freeze()
    collector_clock()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection", what, frozen)
    return frozen


class CollectorClock:
    """The garbage collector's passes in this process: how many and how long, per generation (``gc.callbacks``).

    Each pass is also observed in ``specsplit_gc_pause_seconds`` (Prometheus, by generation): the process stops
    for a pass, so a long one is a stall of every session the process serves.
    """

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation, seconds = info["generation"], time.perf_counter() - self._began
        self.passes[generation] += 1
        self.seconds[generation] += seconds
        self.longest_s[generation] = max(self.longest_s[generation], seconds)
        GC_PAUSE.labels(str(generation)).observe(seconds)

    def take(self) -> dict:
        """Passes and seconds per generation so far, and the longest pass of each since the last take."""
        longest, self.longest_s = self.longest_s, [0.0, 0.0, 0.0]
        return {"passes": list(self.passes), "seconds": [round(s, 6) for s in self.seconds],
                "longest_s": [round(s, 6) for s in longest]}


GC_PAUSE = Histogram("specsplit_gc_pause_seconds", "garbage collector passes, each a stop of the whole process",
                     ["generation"], buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0))
_CLOCK: CollectorClock | None = None


def collector_clock() -> CollectorClock:
    """This process's ``CollectorClock``, started on first use."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CollectorClock()
        gc.callbacks.append(_CLOCK)
    return _CLOCK
