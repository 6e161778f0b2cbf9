"""The processes' event loop: uvloop's where installed, and a coroutine's outcome comes back as from asyncio.run."""

import asyncio

import pytest

from specsplit.lmkit import event_loop

pytestmark = pytest.mark.unit


def test_run_runs_on_uvloop_and_returns_the_result():
    uvloop = pytest.importorskip("uvloop")  # installed with the project (pyproject) on Linux and macOS

    async def main():
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop())

    assert issubclass(event_loop.run(main()), uvloop.Loop)
    assert event_loop.name() == "uvloop"


def test_run_raises_what_the_coroutine_raises():
    async def main():
        await asyncio.sleep(0)
        raise ValueError("bad flag")

    with pytest.raises(ValueError, match="bad flag"):
        event_loop.run(main())
