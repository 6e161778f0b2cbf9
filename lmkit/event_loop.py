"""The event loop the services, the orchestrator and the Ray fronts run on.

uvloop's loop (libuv, in Cython) where it is installed, as uvicorn, vLLM's API server and SGLang's run theirs:
gRPC's asyncio stack works on any asyncio loop, and libuv spends less Python and fewer system calls on each
callback, wake-up and timer than asyncio's selector loop; ``specsplit bench --suite overhead`` measures what
that is worth to the orchestrator (docs/performance.md). asyncio's own loop where uvloop is not installed
(Windows, where it does not build).

The GIL changes hands every ``SWITCH_INTERVAL_S`` instead of Python's 5 ms: a service's compute thread runs the
model's Python between its kernels while the loop takes in the next blocks, and gRPC's poller thread hands each
completion to the loop under the GIL, so at 5 ms a message that has arrived can wait that long for the
interpreter. 1 ms gained at 32 sessions in every alternated pass and cost nothing at k = 0, where 0.5 ms cost the
target a quarter more CPU a token (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Coroutine, TypeVar

try:
    import uvloop
except ImportError:  # no build for this platform
    uvloop = None

T = TypeVar("T")

SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval for the process's threads (Python's default: 0.005)


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop's loop where it is installed, the GIL switched every ``SWITCH_INTERVAL_S``."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if uvloop is None:
        return asyncio.run(main)
    return uvloop.run(main)


def name() -> str:
    """Which loop ``run`` runs on, for logs and benchmark reports."""
    return "uvloop" if uvloop is not None else "asyncio"
