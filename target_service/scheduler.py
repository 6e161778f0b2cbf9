"""Continuous batching of verification requests on the event loop side.

Each session's stream submits its block and waits. Whenever the compute thread
is free, the blocks waiting (up to ``max_batch``) go into one
``TargetEngine.verify_batch`` call; blocks that arrive meanwhile form the next
batch.

Sessions of one batch get their results together and come back a round trip
later (the orchestrator commits, drafts, sends the next block): the
turnaround. Starting the next forward with whoever arrived first splits them:
two sessions would alternate A, B, A, B, each alone, and each forward pays the
fixed part a of its cost t(x) = a + s x (the engine's fit) again. Waiting for
all of them instead leaves the target idle through the turnaround. So the next
batch waits for the open sessions of the last one, for at most a, where the
turnaround (the latest of a batch's sessions, smoothed) is shorter than a: a
GPU's forward, nearly flat in its tokens, then serves every session in one
step. Where the turnaround is longer than a (a CPU, where a forward costs
nearly in proportion to its tokens), the next forward starts with the blocks in
hand: the target computes for some sessions while the orchestrator turns the
others' results into their next blocks. Before a fit the wait is
``wait_fraction`` of the last forward; never over ``max_wait_s``. One session
alone never waits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from specsplit.lmkit import errors
from specsplit.lmkit.grpc_server import ComputeThread
from specsplit.target_service.engine import PREFILLING, TargetEngine, VerifyItem, VerifyOutcome

# Run on the compute thread just before the forward: the item with its tensors decoded (draft_probs).
Prepare = Callable[[VerifyItem], VerifyItem]


@dataclass
class _Waiting:
    item: VerifyItem
    future: asyncio.Future
    prepare: Prepare | None = None


@dataclass
class _Answered:
    """The sessions one forward answered, until each has sent its next block (or closed)."""

    end: float  # time.monotonic() when the forward ended
    open: set[str]  # session ids still to send theirs
    latest: float = 0.0  # the longest turnaround so far


TURNAROUND_GAIN = 1 / 8  # as RFC 6298 smooths a round trip


class VerifyScheduler:
    def __init__(
        self, compute: ComputeThread, engine: TargetEngine, max_batch: int,
        wait_fraction: float = 0.2, max_wait_s: float = 0.05,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        self.compute = compute
        self.engine = engine
        self.max_batch = max_batch
        self.wait_fraction = wait_fraction
        self.max_wait_s = max_wait_s
        self._waiting: list[_Waiting] = []
        self._runner: asyncio.Task | None = None
        self._arrived = asyncio.Event()
        self._last_batch: set[str] = set()  # session ids verified together last time
        self._last_forward_s = 0.0
        self._answered: dict[str, _Answered] = {}  # session id -> the forward whose answer it is turning around
        self.turnaround_s: float | None = None  # a forward's last session's result-to-next-block time, smoothed

    async def verify(self, item: VerifyItem, prepare: Prepare | None = None) -> VerifyOutcome:
        """``item``'s verification, batched with other sessions'. ``prepare`` (optional) completes the item on
        the compute thread (tensor work stays off the event loop: ``specsplit.lmkit.grpc_server.ComputeThread``); an
        ``errors.SpecsplitError`` it raises fails this item alone."""
        future = asyncio.get_running_loop().create_future()
        self._came(item.session.session_id, time.monotonic())
        self._waiting.append(_Waiting(item, future, prepare))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    async def _gather_last_batch(self) -> None:
        """Wait briefly for the open sessions of the last batch that have not sent their next block yet."""
        if self.max_batch == 1:
            return
        deadline = time.monotonic() + min(self._wait_s(), self.max_wait_s)
        while True:
            here = {w.item.session.session_id for w in self._waiting}
            missing = [s for s in self._last_batch - here if s in self.engine.sessions]
            remaining = deadline - time.monotonic()
            if not missing or remaining <= 0 or len(here) >= self.max_batch:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _wait_s(self) -> float:
        """How long a batch may wait for the last one's sessions: a, where the turnaround is shorter."""
        fit = self.engine.cost_fit()
        if fit is None:
            return self.wait_fraction * self._last_forward_s
        fixed_s = fit[0]
        return fixed_s if self.turnaround_s is None or self.turnaround_s <= fixed_s else 0.0

    def _came(self, session_id: str, now: float) -> None:
        """A session's next block came: the turnaround of the forward that answered it, once all its sessions'."""
        group = self._answered.pop(session_id, None)
        if group is not None:
            group.latest = now - group.end
            self._close(group, session_id)

    def _close(self, group: _Answered, session_id: str) -> None:
        group.open.discard(session_id)
        if not group.open and group.latest > 0:
            known = self.turnaround_s
            self.turnaround_s = group.latest if known is None else known + TURNAROUND_GAIN * (group.latest - known)

    def _answer(self, batch: list[_Waiting], end: float) -> None:
        """The sessions answered at ``end`` wait for their next blocks; sessions closed meanwhile are not waited
        for."""
        for session_id in [sid for sid in self._answered if sid not in self.engine.sessions]:
            self._close(self._answered.pop(session_id), session_id)
        group = _Answered(end, {w.item.session.session_id for w in batch})
        for session_id in group.open:
            self._answered[session_id] = group

    async def _run(self) -> None:
        while self._waiting:
            await self._gather_last_batch()
            batch = self._take()
            if not batch:
                continue
            self._last_batch = {w.item.session.session_id for w in batch}
            start = time.monotonic()
            try:
                results = await self.compute.run(self._verify_batch, batch)
            except Exception as exc:  # noqa: BLE001 - the forward itself failed: every block in it fails
                results = [exc] * len(batch)
            end = time.monotonic()
            self._last_forward_s = end - start
            prefilling, answered = [], []
            for waiting, result in zip(batch, results):
                if waiting.future.done():  # the stream went away meanwhile
                    continue
                if result is PREFILLING:  # its prompt's next chunk goes in the next step
                    prefilling.append(waiting)
                    continue
                if isinstance(result, BaseException):
                    waiting.future.set_exception(result)
                else:
                    waiting.future.set_result(result)
                    answered.append(waiting)
            self._waiting[:0] = prefilling
            self._answer(answered, end)

    def _verify_batch(self, batch: list[_Waiting]) -> list[VerifyOutcome | BaseException]:
        """On the compute thread: prepare each item, then verify those that prepared in one ``verify_batch``."""
        results: list[VerifyOutcome | BaseException | None] = [None] * len(batch)
        ready: list[int] = []
        items: list[VerifyItem] = []
        for i, waiting in enumerate(batch):
            try:
                items.append(waiting.prepare(waiting.item) if waiting.prepare else waiting.item)
                ready.append(i)
            except errors.SpecsplitError as exc:
                results[i] = exc
        for i, result in zip(ready, self.engine.verify_batch(items) if items else []):
            results[i] = result
        return results

    def _take(self) -> list[_Waiting]:
        """Up to max_batch live blocks, at most one per session (a session's next block waits for this one)."""
        batch: list[_Waiting] = []
        rest: list[_Waiting] = []
        sessions: set[str] = set()
        for waiting in self._waiting:
            if waiting.future.done():
                continue
            key = waiting.item.session.session_id
            if len(batch) < self.max_batch and key not in sessions:
                batch.append(waiting)
                sessions.add(key)
            else:
                rest.append(waiting)
        self._waiting = rest
        return batch

