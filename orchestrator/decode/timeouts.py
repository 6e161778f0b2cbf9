"""Timeouts of one length for many awaits, on one timer.

A target link awaits one verify a round under a timeout that a healthy peer
never reaches (it only catches a stalled one). ``asyncio.timeout``
schedules a timer handle for every such await and cancels it after: about as
much again as the await itself. Here each await enters an ordered table instead:
every timeout of a ``Timeouts`` is as long, so deadlines come in the order of
entry, and one timer, armed at the earliest, cancels whichever awaits are past
theirs. The await cancelled so raises ``TimeoutError``, as under
``asyncio.timeout`` (a cancellation from elsewhere stays a cancellation).
"""

from __future__ import annotations

import asyncio


class Timeouts:
    """Awaits bounded by ``seconds`` each: ``with timeouts.bound(): await ...`` (a task's own await, not nested
    in another bound of the same ``Timeouts``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._bounds: dict[_Bound, float] = {}  # the awaits running, by deadline (= the order they entered)
        self._timer: asyncio.TimerHandle | None = None

    def bound(self) -> _Bound:
        return _Bound(self)

    def close(self) -> None:
        """Stop the timer (the awaits still running are no longer bounded)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._bounds.clear()

    def _enter(self, bound: _Bound) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        self._bounds[bound] = deadline
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        """Cancel the awaits past their deadline; wait for the next one's (the earliest left)."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._bounds:
            bound, deadline = next(iter(self._bounds.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire)
                return
            del self._bounds[bound]
            bound.expire()


class _Bound:
    """One await under a ``Timeouts``: a context manager around it."""

    __slots__ = ("_owner", "_task", "_cancelling", "expired")

    def __init__(self, owner: Timeouts) -> None:
        self._owner = owner
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self.expired = False

    def __enter__(self) -> _Bound:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Timeouts.bound() must be used inside a task")
        self._task, self._cancelling = task, task.cancelling()
        self._owner._enter(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._owner._bounds.pop(self, None)
        # The cancellation this bound made is the timeout; any other (the task's own) goes on as it is.
        if not self.expired:
            return
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError(f"no answer in {self._owner.seconds:g} s") from exc

    def expire(self) -> None:
        self.expired = True
        self._task.cancel()
