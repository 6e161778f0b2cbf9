"""The service side of ``Sessions``: many sessions of one client on one stream.

A message carries calls of any of the stream's sessions; each session's calls
run in the order sent, sessions run independently (a verify waits in the
target's batcher beside the others'), and the answers that are ready together
(one batched forward's) leave in one message. A call's domain error closes its
session alone and is answered with its status code; every session of the
stream closes when the stream ends, and one idle past the TTL is evicted. Every
call is answered, one sent after its session was closed with NOT_FOUND. A
call that needs no waiting, none of its session's calls before it still
running, is answered as it is read, without a task of its own. What a call
does is the servicer's (``MuxHandler``); this module only carries it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from specsplit.lmkit import errors
from specsplit.lmkit.grpc_server import Unreadable, status_for
from specsplit.v1 import specsplit_pb2 as pb

log = logging.getLogger(__name__)


class MuxHandler(Protocol):
    """A servicer's side of a ``Sessions`` stream."""

    async def open(self, session_id: str, call: Any) -> tuple[Any, Any]:
        """Open a session from an ``open`` call: (the session's state, the ``opened`` answer)."""

    async def serve(self, state: Any, kind: str, call: Any) -> tuple[str, Any]:
        """Answer one call of an open session: (the answer's kind, its message)."""

    def serve_at_once(self, state: Any, kind: str, call: Any) -> tuple[str, Any] | None:
        """``serve``'s answer when it needs no waiting (a model-free drafter's proposal), computed in the
        event loop now; None when the call must be awaited (``serve``)."""

    def close(self, state: Any) -> Any:
        """Free a session; returns the ``closed`` answer."""

    def reply(self, session_id: str, kind: str, message: Any) -> Any:
        """One answer as the wire's reply message."""

    def replies(self, replies: list) -> Any:
        """Answers as one outgoing message."""


@dataclass
class _Slot:
    state: Any = None  # the servicer's session; None until its open has run
    tail: asyncio.Future | None = None  # the session's last call: the next one runs after it
    active: float = field(default_factory=time.monotonic)  # when its last call finished


class SessionMux:
    """Serves one ``Sessions`` stream until the client ends it or goes away."""

    def __init__(self, context: grpc.aio.ServicerContext, handler: MuxHandler, ttl_s: float) -> None:
        self._context = context
        self._handler = handler
        self._ttl_s = ttl_s
        self._slots: dict[str, _Slot] = {}
        self._evicted: set[str] = set()
        self._out: list = []  # answers not written yet
        self._ready = asyncio.Event()
        self._ending = False  # the client ended its side: write what is left, then stop

    async def run(self) -> None:
        writer = asyncio.ensure_future(self._write())
        sweeper = asyncio.ensure_future(self._sweep())
        try:
            while True:
                message = await self._context.read()
                if message is grpc.aio.EOF:
                    break
                if isinstance(message, Unreadable):
                    await self._context.abort(message.code, message.detail)
                for call in message.calls:
                    self._dispatch(call)
            tails = [slot.tail for slot in self._slots.values() if slot.tail is not None]
            await asyncio.gather(*tails, return_exceptions=True)  # the calls sent before the end are answered
            self._ending = True
            self._ready.set()
            await writer
        finally:
            sweeper.cancel()
            writer.cancel()
            for slot in list(self._slots.values()):
                if slot.tail is not None:
                    slot.tail.cancel()
                self._free(slot)
            self._slots.clear()

    def _dispatch(self, call) -> None:
        session_id, kind = call.session_id, call.WhichOneof("kind")
        slot = self._slots.get(session_id)
        if kind == "open":
            if slot is not None:
                self._answer(session_id, "error", errors.AlreadyExists(
                    f"session {session_id!r} is already open on this stream; open new sessions under new ids"))
                return
            slot = self._slots[session_id] = _Slot()
            self._evicted.discard(session_id)
        elif slot is None:
            why = (f"evicted after {self._ttl_s:g} s idle" if session_id in self._evicted
                   else "not open on this stream")
            self._answer(session_id, "error", errors.NotFound(
                f"session {session_id!r} is {why}; open a new one from the committed tokens"))
            return
        elif kind != "close" and slot.state is not None and (slot.tail is None or slot.tail.done()):
            if self._answered_at_once(session_id, slot, kind, call):
                return
        slot.tail = asyncio.ensure_future(self._call(session_id, slot, kind, call, slot.tail))

    def _answered_at_once(self, session_id: str, slot: _Slot, kind: str, call) -> bool:
        """Answer the call now when its servicer can without waiting (``MuxHandler.serve_at_once``)."""
        try:
            answer = self._handler.serve_at_once(slot.state, kind, getattr(call, kind))
            if answer is None:
                return False
            self._answer(session_id, *answer)
        except Exception as exc:  # noqa: BLE001 - one session's failure never fails the stream's others
            self._failed_call(session_id, slot, kind, exc)
        slot.active = time.monotonic()
        return True

    async def _call(self, session_id: str, slot: _Slot, kind: str, call, before: asyncio.Future | None) -> None:
        if before is not None and not before.done():
            await asyncio.wait({before})  # its outcome is its own: this call runs after it either way
        if self._slots.get(session_id) is not slot:  # closed meanwhile: an error, a close, an eviction
            self._answer(session_id, "error", errors.NotFound(
                f"session {session_id!r} was closed before this {kind} call ran (an earlier call's error, a close "
                "or an eviction); open a new one from the committed tokens"))
            return
        try:
            if kind == "open":
                slot.state, answer = await self._handler.open(session_id, getattr(call, kind))
                self._answer(session_id, "opened", answer)
            elif kind == "close":
                self._slots.pop(session_id, None)
                self._answer(session_id, "closed", self._free(slot))
            else:
                self._answer(session_id, *await self._handler.serve(slot.state, kind, getattr(call, kind)))
        except Exception as exc:  # noqa: BLE001 - one session's failure never fails the stream's others
            self._failed_call(session_id, slot, kind, exc)
        finally:
            slot.active = time.monotonic()

    def _failed_call(self, session_id: str, slot: _Slot, kind: str, exc: Exception) -> None:
        """A call raised: a domain error closes its session with its status, anything else as INTERNAL (logged)."""
        if not isinstance(exc, errors.SpecsplitError):
            log.error("a %s call of session %r failed", kind, session_id, exc_info=exc)
            exc = errors.Internal(f"the {kind} call failed: {exc}")
        self._fail(session_id, slot, exc)

    def _fail(self, session_id: str, slot: _Slot, exc: errors.SpecsplitError) -> None:
        if self._slots.get(session_id) is slot:
            del self._slots[session_id]
        self._free(slot)
        self._answer(session_id, "error", exc)

    def _free(self, slot: _Slot):
        state, slot.state = slot.state, None
        return self._handler.close(state) if state is not None else None

    def _answer(self, session_id: str, kind: str, message) -> None:
        if isinstance(message, errors.SpecsplitError):
            message = pb.CallError(code=status_for(message).value[0], message=str(message))
        self._out.append(self._handler.reply(session_id, kind, message))
        self._ready.set()

    async def _write(self) -> None:
        """Write what is ready, as one message: whatever answers came while the loop ran other tasks."""
        while True:
            if not self._out:
                if self._ending:
                    return
                await self._ready.wait()
                self._ready.clear()
                await asyncio.sleep(0)  # answers completing in this pass of the loop go in the same message
                continue
            out, self._out = self._out, []
            await self._context.write(self._handler.replies(out))

    async def _sweep(self) -> None:
        """Evict sessions idle past the TTL (none of their calls running)."""
        period = min(max(self._ttl_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session_id, slot in list(self._slots.items()):
                idle = slot.tail is None or slot.tail.done()
                if idle and now - slot.active > self._ttl_s:
                    del self._slots[session_id]
                    self._evicted.add(session_id)
                    self._free(slot)
