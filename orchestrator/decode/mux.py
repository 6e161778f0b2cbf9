"""The orchestrator's side of ``Sessions``: every session it has on a service, on one stream.

Calls made while the event loop runs other tasks leave together, in one
message, when the loop comes back to the writer: the sessions a batched forward
answered together answer back together, so the target's next step arrives as
one message, not one per session. Each call's answer resolves its own future
(a session's answers come in the order of its calls). A stream that fails fails
every call on it with the stream's status; the next call opens a new stream,
and a session opened on the old one is refused at once (UNAVAILABLE), so its
link re-opens it from the committed tokens as it would after a restart.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from typing import Callable

import grpc

from specsplit.orchestrator.decode.peers import PeerError
from specsplit.v1 import specsplit_pb2 as pb

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_FIELD_OVERHEAD = 6  # a call's tag and length prefix inside its Calls message


class Mux:
    """One ``Sessions`` stream to a service, opened on first use and again after a failure."""

    def __init__(self, open_stream: Callable[[], grpc.aio.StreamStreamCall], call_type, calls_type, peer: str) -> None:
        self._open_stream = open_stream  # the stub's Sessions
        self._call_type = call_type  # TargetCall or DraftCall
        self._calls_type = calls_type  # TargetCalls or DraftCalls
        self.peer = peer
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._epochs = itertools.count(1)
        self.epoch = 0  # which stream the current one is; sessions remember theirs
        self._pending: list = []  # calls not written yet
        self._waiting: dict[str, collections.deque[asyncio.Future]] = {}  # session id -> its calls' answers, in order
        self._writer: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self.max_bytes = 0  # the service's bound on one message (ModelInfo.max_request_bytes); 0: none

    def session(self) -> MuxSession:
        return MuxSession(self)

    def current(self) -> int:
        """The epoch of the stream calls go on now (opening one if there is none)."""
        if self._stream is None:
            self._stream = self._open_stream()
            self.epoch = next(self._epochs)
            self._reader = asyncio.ensure_future(self._read(self._stream))
        return self.epoch

    def ask(self, session_id: str, kind: str, message) -> asyncio.Future:
        """Send one call; the future of its answer's payload (PeerError for an error answer or a failed stream)."""
        self.current()
        answer = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(session_id, collections.deque()).append(answer)
        self._pending.append(self._call_type(session_id=session_id, **{kind: message}))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write(self._stream))
        return answer

    def forget(self, session_id: str) -> None:
        """Stop waiting for a session's answers (it was dropped): any that still come are ignored."""
        for answer in self._waiting.pop(session_id, ()):
            answer.cancel()

    async def _write(self, stream) -> None:
        """Write every pending call, as one message each time round (calls made meanwhile join the next)."""
        while self._pending and stream is self._stream:
            calls, self._pending = self._pending, []
            try:
                for message in self._messages(calls):
                    await stream.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                await self._failed(stream, exc)
                return

    def _messages(self, calls: list) -> list:
        """``calls`` as one message, or in order as several when one would be over the service's bound."""
        message = self._calls_type(calls=calls)
        if not self.max_bytes or message.ByteSize() <= self.max_bytes:
            return [message]
        messages, part, size = [], [], 0
        for call in calls:
            length = call.ByteSize() + _FIELD_OVERHEAD
            if part and size + length > self.max_bytes:
                messages.append(self._calls_type(calls=part))
                part, size = [], 0
            part.append(call)
            size += length
        messages.append(self._calls_type(calls=part))
        return messages

    async def _read(self, stream) -> None:
        try:
            async for message in stream:
                for reply in message.replies:
                    self._answer(reply)
        except grpc.aio.AioRpcError as exc:
            await self._failed(stream, exc)
            return
        await self._failed(stream, None)  # the service ended the stream

    def _answer(self, reply) -> None:
        waiting = self._waiting.get(reply.session_id)
        if not waiting:
            return  # a dropped session's
        answer = waiting.popleft()
        if not waiting:
            del self._waiting[reply.session_id]
        if answer.done():
            return  # its caller gave up (a timeout, a cancelled generation)
        kind = reply.WhichOneof("kind")
        if kind == "error":
            code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            answer.set_exception(PeerError(self.peer, code, reply.error.message))
        else:
            answer.set_result(getattr(reply, kind))

    async def _failed(self, stream, exc: BaseException | None) -> None:
        """The stream is gone: every call still waiting on it fails with its status, and the next opens anew."""
        if stream is not self._stream:
            return
        self._stream = None
        if isinstance(exc, grpc.aio.AioRpcError):
            code, details = exc.code(), exc.details() or ""
        else:
            code = await stream.code() if exc is None else grpc.StatusCode.UNAVAILABLE
            details = (await stream.details() if exc is None else "") or "the sessions stream ended"
        if code == grpc.StatusCode.OK:
            code = grpc.StatusCode.UNAVAILABLE
        waiting, self._waiting, self._pending = self._waiting, {}, []
        for answers in waiting.values():
            for answer in answers:
                if not answer.done():
                    answer.set_exception(PeerError(self.peer, code, details))
        stream.cancel()

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        for task in (self._writer, self._reader):
            if task is not None:
                task.cancel()


class MuxSession:
    """A session's calls on the shared stream, with the interface of a session's own stream (``OwnStream``)."""

    def __init__(self, mux: Mux) -> None:
        self._mux = mux
        self._id = ""
        self._epoch = 0

    async def call(self, kind: str, message):
        return await self.ask(kind, message)

    def ask(self, kind: str, message) -> asyncio.Future:
        """Send the call now; the future of its answer's payload (PeerError: an error answer, a failed stream, or
        a stream reset since this session opened)."""
        if kind == "open":
            self._id, self._epoch = message.session_id, self._mux.current()
        elif self._epoch != self._mux.epoch:
            reset = asyncio.get_running_loop().create_future()
            reset.set_exception(PeerError(self._mux.peer, grpc.StatusCode.UNAVAILABLE,
                                          "the sessions stream was reset since this session opened"))
            return reset
        return self._mux.ask(self._id, kind, message)

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the session and wait until the service has freed it (or ``timeout_s``)."""
        if not self._id or self._epoch != self._mux.epoch:
            return  # never opened, or gone with its stream
        try:
            async with asyncio.timeout(timeout_s):
                await self._mux.ask(self._id, "close", pb.CloseSession())
        except (asyncio.TimeoutError, PeerError):
            self._mux.forget(self._id)

    def abort(self) -> None:
        """Drop the session at once (a failed or stalled call): the service frees it when the close arrives."""
        if self._id and self._epoch == self._mux.epoch:
            self._mux.forget(self._id)
            self._mux.ask(self._id, "close", pb.CloseSession())
            self._mux.forget(self._id)
