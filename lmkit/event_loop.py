"""The event loop the services, the orchestrator and the Ray fronts run on.

uvloop's loop (libuv, in Cython) where it is installed, as uvicorn, vLLM's API server and SGLang's run theirs:
gRPC's asyncio stack works on any asyncio loop, and libuv spends less Python and fewer system calls on each
callback, wake-up and timer than asyncio's selector loop; ``specsplit bench --suite overhead`` measures what
that is worth to the orchestrator (docs/performance.md). asyncio's own loop where uvloop is not installed
(Windows, where it does not build).
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

try:
    import uvloop
except ImportError:  # no build for this platform
    uvloop = None

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop's loop where it is installed."""
    if uvloop is None:
        return asyncio.run(main)
    return uvloop.run(main)


def name() -> str:
    """Which loop ``run`` runs on, for logs and benchmark reports."""
    return "uvloop" if uvloop is not None else "asyncio"
