"""Timeouts on one timer: an await past its bound raises TimeoutError, as under ``asyncio.timeout``."""

import asyncio

import pytest

from specsplit.orchestrator.decode.timeouts import Timeouts

pytestmark = pytest.mark.unit


async def _bounded(timeouts: Timeouts, waited: asyncio.Future):
    with timeouts.bound():
        return await waited


def test_an_await_past_its_bound_raises_timeout_error():
    async def main():
        timeouts = Timeouts(0.05)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await _bounded(timeouts, loop.create_future())
        return loop.time() - start

    assert 0.05 <= asyncio.run(main()) < 1.0


def test_an_answer_in_time_is_returned_and_later_awaits_are_still_bounded():
    async def main():
        timeouts = Timeouts(0.1)
        loop = asyncio.get_running_loop()
        for value in range(50):  # answered at once, every one
            answered = loop.create_future()
            loop.call_soon(answered.set_result, value)
            assert await _bounded(timeouts, answered) == value
        await asyncio.sleep(0.15)  # past the first await's deadline: the timer finds nothing due
        with pytest.raises(TimeoutError):
            await _bounded(timeouts, loop.create_future())

    asyncio.run(main())


def test_each_await_expires_at_its_own_deadline():
    async def main():
        timeouts = Timeouts(0.2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        first = asyncio.ensure_future(_bounded(timeouts, loop.create_future()))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(_bounded(timeouts, loop.create_future()))
        ended = {}
        for name, task in (("first", first), ("second", second)):
            with pytest.raises(TimeoutError):
                await task
            ended[name] = loop.time() - start
        return ended

    ended = asyncio.run(main())
    assert 0.2 <= ended["first"] < 0.3 <= ended["second"] < 1.0


def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    async def main():
        timeouts = Timeouts(5.0)
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(_bounded(timeouts, loop.create_future()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # and the bound left with it: a later await runs its full length unhurt
        answered = loop.create_future()
        loop.call_later(0.05, answered.set_result, "kept")
        return await _bounded(timeouts, answered)

    assert asyncio.run(main()) == "kept"


def test_closing_stops_the_timer():
    async def main():
        timeouts = Timeouts(0.05)
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(_bounded(timeouts, loop.create_future()))
        await asyncio.sleep(0)
        timeouts.close()
        await asyncio.sleep(0.1)
        running = not task.done()
        task.cancel()
        return running

    assert asyncio.run(main())
