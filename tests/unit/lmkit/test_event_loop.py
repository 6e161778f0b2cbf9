"""The processes' event loop: uvloop's where installed, the GIL switched every millisecond, and a coroutine's
outcome comes back as from asyncio.run."""

import asyncio
import sys

import pytest

from specsplit.lmkit import event_loop

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def python_default_switch_interval():
    """Each test starts at Python's default (5 ms) and leaves the process's interval as it found it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_run_runs_on_uvloop_and_returns_the_result():
    uvloop = pytest.importorskip("uvloop")  # installed with the project (pyproject) on Linux and macOS

    async def main():
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop())

    assert issubclass(event_loop.run(main()), uvloop.Loop)
    assert event_loop.name() == "uvloop"


def test_run_hands_the_gil_over_every_millisecond():
    async def main():
        return sys.getswitchinterval()

    assert event_loop.run(main()) == pytest.approx(0.001)


def test_run_raises_what_the_coroutine_raises():
    async def main():
        await asyncio.sleep(0)
        raise ValueError("bad flag")

    with pytest.raises(ValueError, match="bad flag"):
        event_loop.run(main())
