"""A serving process's start-up heap, frozen out of garbage collection.

Imports, the model, the tokenizer and compiled code leave a few hundred
thousand tracked objects that live as long as the process, and CPython's
oldest-generation collection walks every one of them whenever it runs, the
process stopped meanwhile. Once a process is ready to serve, ``gc.freeze()``
moves them to a permanent generation that no collection walks (vLLM's engine
core and SGLang's servers do the same after warm-up). The collector stays on
for everything allocated afterwards.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect what start-up left unreachable, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection", what, frozen)
    return frozen
