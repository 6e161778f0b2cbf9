"""Clients of the draft and target services: one open bidi stream per session.

Per-round traffic rides an open stream rather than unary calls: a message on a stream already open
skips a call's set-up on every round.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

import grpc

from specsplit.lmkit import errors, security, wire_version
from specsplit.lmkit.auth import Tokens
from specsplit.lmkit.grpc_server import CHANNEL_OPTIONS
from specsplit.lmkit.security import ClientTls
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc


class PeerError(Exception):
    """A draft or target call failed; carries the gRPC code and the peer's message."""

    def __init__(self, peer: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{peer}: {code.name}: {details}")
        self.peer = peer
        self.code = code
        self.details = details


# A peer that restarts is found again within a second or two: gRPC's defaults back off from 1 s up to 120 s
# between reconnection attempts, so a draft back after a few seconds could stay unused for a minute (the
# draft link re-attaches every draft_retry_s, but each attempt fails fast while the channel backs off).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def open_channel(address: str, tls: ClientTls | None = None) -> grpc.aio.Channel:
    """A channel to a draft or target service, sized for the largest message (draft probabilities)."""
    return security.open_channel(address, tls, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])


class OwnStream:
    """A session's own stream: each call written is answered by one read; the session ends with the stream."""

    def __init__(self, call, request_type, peer: str) -> None:
        self._call = call
        self._request_type = request_type  # TargetRequest or DraftRequest: the stream's message
        self.peer = peer

    async def call(self, kind: str, message):
        """Send ``message`` as the request's ``kind``; the response's payload."""
        try:
            await self._call.write(self._request_type(**{kind: message}))
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise PeerError(self.peer, exc.code(), exc.details() or "") from None
        except asyncio.InvalidStateError:  # the stream already ended (the peer went away)
            code = await self._call.code()
            raise PeerError(self.peer, code, await self._call.details() or "stream ended") from None
        if response is grpc.aio.EOF:
            code = await self._call.code()
            details = await self._call.details()
            raise PeerError(self.peer, code, details or "stream ended")
        return getattr(response, response.WhichOneof("kind"))

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the stream cleanly and wait until the service has freed the session.

        Falls back to cancelling the call (which frees it too, asynchronously)
        when the stream already failed or the service does not answer in time.
        """
        try:
            await asyncio.wait_for(self._drain(), timeout_s)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._call.cancel()
        except asyncio.CancelledError:
            self._call.cancel()
            raise

    def abort(self) -> None:
        """Drop the stream at once (a failed or stalled peer); the service frees the session when it notices."""
        self._call.cancel()

    async def _drain(self) -> None:
        if self._call.done():
            return
        await self._call.done_writing()
        while await self._call.read() is not grpc.aio.EOF:
            pass


class _Session:
    """A session's calls, over its own stream (``OwnStream``) or a shared one (``orchestrator.mux``)."""

    def __init__(self, transport) -> None:
        self._transport = transport

    async def close(self, timeout_s: float = 5.0) -> None:
        await self._transport.close(timeout_s)

    def abort(self) -> None:
        self._transport.abort()


class TargetStream(_Session):
    @classmethod
    def over(cls, call) -> "TargetStream":
        """A target session on a stream of its own (``TargetService.Session``)."""
        return cls(OwnStream(call, pb.TargetRequest, "target"))

    async def open(self, open_msg: pb.TargetOpen) -> None:
        await self._transport.call("open", open_msg)

    async def verify(
        self, position: int, draft_tokens: Sequence[int], draft_probs: pb.DraftProbs | None,
        parents: Sequence[int] = (), allowed: pb.TokenMask | None = None,
    ) -> pb.VerifyResult:
        msg = pb.VerifyRequest(position=position, draft_tokens=draft_tokens, parents=parents)
        if draft_probs is not None:
            msg.draft_probs.CopyFrom(draft_probs)
        if allowed is not None:
            msg.allowed.CopyFrom(allowed)
        return await self._transport.call("verify", msg)


class DraftStream(_Session):
    @classmethod
    def over(cls, call) -> "DraftStream":
        """A draft session on a stream of its own (``DraftService.Session``)."""
        return cls(OwnStream(call, pb.DraftRequest, "draft"))

    async def open(self, open_msg: pb.DraftOpen) -> None:
        await self._transport.call("open", open_msg)

    async def propose(
        self, position: int, tokens: Sequence[int], k: int, free_k: int = 0, max_branches: int = 1,
        features: pb.HiddenFeatures | None = None, successors: Sequence[pb.Successors] = (),
    ) -> pb.DraftBlock:
        msg = pb.ProposeRequest(position=position, tokens=tokens, k=k, free_k=free_k, max_branches=max_branches,
                                successors=successors)
        if features is not None:
            msg.features.CopyFrom(features)
        return await self._transport.call("propose", msg)


@dataclass
class ServiceClient:
    """Stub plus identity of one service."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    info: pb.ModelInfo | None = None
    mux: object | None = None  # every session on one Sessions stream (orchestrator.mux.Mux); None: a stream each
    kind: str = "service"  # "target" or "draft", as messages name it

    async def fetch_info(self, timeout_s: float) -> pb.ModelInfo:
        """Wait up to ``timeout_s`` for the service to load and answer ``Info``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                info = await self.stub.Info(pb.InfoRequest(), timeout=max(remaining, 0.01), wait_for_ready=True)
                wire_version.check_service(info.wire_version, info.min_wire_version, self.kind, self.address)
                self.info = info
                return info
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise errors.Unauthenticated(
                        f"the service at {self.address} refused the orchestrator ({exc.code().name}: {exc.details()})"
                    ) from None
                # UNAVAILABLE with a message: the server is up but its model is still loading.
                if exc.code() != grpc.StatusCode.UNAVAILABLE or remaining <= 0.5:
                    raise errors.Unavailable(
                        f"could not reach the service at {self.address} within {timeout_s:.0f} s "
                        f"({exc.code().name}: {exc.details()}); is it running?"
                    ) from None
                await asyncio.sleep(0.5)

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest())

    async def close(self) -> None:
        if self.mux is not None:
            await self.mux.close()
        await self.channel.close()


class PeerStub:
    """A stub whose every call states this build's wire version (``specsplit-wire-version``) and, with ``tokens``,
    carries ``authorization: Bearer <token>``, the token read afresh per call (so a rotated token file takes effect
    on the next call). Per call, not per message: a session's stream pays it once."""

    def __init__(self, stub, tokens: Tokens | None) -> None:
        self._stub = stub
        self._tokens = tokens

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        def call(*args, metadata=(), **kwargs):
            stated = (*metadata, *wire_version.metadata())
            if self._tokens is not None:
                stated = (*stated, ("authorization", f"Bearer {self._tokens.first()}"))
            return method(*args, metadata=stated, **kwargs)

        return call


def peer_tokens(path: str) -> Tokens | None:
    """What the orchestrator sends its services: ``--peer-token-file``, else SPECSPLIT_PEER_TOKEN; None: nothing."""
    return Tokens.load(path, "SPECSPLIT_PEER_TOKEN")


def target_client(address: str, tls: ClientTls | None = None, tokens: Tokens | None = None) -> ServiceClient:
    channel = open_channel(address, tls)
    return ServiceClient(address, channel, PeerStub(pb_grpc.TargetServiceStub(channel), tokens), kind="target")


def draft_client(address: str, tls: ClientTls | None = None, tokens: Tokens | None = None) -> ServiceClient:
    channel = open_channel(address, tls)
    return ServiceClient(address, channel, PeerStub(pb_grpc.DraftServiceStub(channel), tokens), kind="draft")
