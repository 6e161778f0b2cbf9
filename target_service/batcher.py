"""Continuous batching of verification requests on the event loop side.

Each session's stream submits its block and waits. Whenever the compute thread
is free, every block waiting at that moment (up to ``max_batch``) goes into
one ``TargetEngine.verify_batch`` call; blocks that arrive meanwhile form the
next batch. One session alone sees no delay: its block runs as soon as the
thread is free, as before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from lmkit.grpc_server import ComputeThread
from target_service.engine import TargetEngine, Verified, VerifyItem


@dataclass
class _Waiting:
    item: VerifyItem
    future: asyncio.Future


class VerifyBatcher:
    def __init__(self, compute: ComputeThread, engine: TargetEngine, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        self.compute = compute
        self.engine = engine
        self.max_batch = max_batch
        self._waiting: list[_Waiting] = []
        self._runner: asyncio.Task | None = None

    async def verify(self, item: VerifyItem) -> Verified:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(item, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._waiting:
            batch = self._take()
            if not batch:
                continue
            try:
                results = await self.compute.run(self.engine.verify_batch, [w.item for w in batch])
            except Exception as exc:  # noqa: BLE001 - the forward itself failed: every block in it fails
                results = [exc] * len(batch)
            for waiting, result in zip(batch, results):
                if waiting.future.done():  # the stream went away meanwhile
                    continue
                if isinstance(result, BaseException):
                    waiting.future.set_exception(result)
                else:
                    waiting.future.set_result(result)

    def _take(self) -> list[_Waiting]:
        """Up to max_batch live blocks, at most one per session (a session's next block waits for this one)."""
        batch: list[_Waiting] = []
        rest: list[_Waiting] = []
        sessions: set[int] = set()
        for waiting in self._waiting:
            if waiting.future.done():
                continue
            key = id(waiting.item.session)
            if len(batch) < self.max_batch and key not in sessions:
                batch.append(waiting)
                sessions.add(key)
            else:
                rest.append(waiting)
        self._waiting = rest
        return batch

