"""Clients of the draft and target services: one open bidi stream per session.

Per-round traffic rides an open stream rather than unary calls: a message on a stream already open
skips a call's set-up on every round.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc

from specsplit.lmkit import errors, security, wire_version
from specsplit.lmkit.auth import Tokens
from specsplit.lmkit.grpc_server import CHANNEL_OPTIONS
from specsplit.lmkit.security import ClientTls
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


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


# A replica whose host vanishes (a node lost, a partition: no reset comes) would hold its sessions until a
# call's own timeout (a verify may take 120 s: a long prefill on a CPU). With calls in flight the channel
# pings every KEEPALIVE_S; a peer that does not answer within KEEPALIVE_TIMEOUT_S is taken as gone, its calls
# fail UNAVAILABLE and the pool re-opens its sessions elsewhere. The services accept pings this often
# (``lmkit.grpc_server.PING_OPTIONS``); pings are answered by gRPC's core, not the busy model thread.
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.max_pings_without_data", 0),  # a verify that computes long sends nothing meanwhile
]


def open_channel(address: str, tls: ClientTls | None = None, options: Sequence[tuple[str, object]] = ()):
    """A channel to a draft or target service, sized for the largest message (draft probabilities)."""
    return security.open_channel(address, tls, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, *KEEPALIVE_OPTIONS, *options])


class OwnStream:
    """A session's own stream: each call written is answered by one read; the session ends with the stream."""

    def __init__(self, call, request_type, peer: str) -> None:
        self._call = call
        self._request_type = request_type  # TargetRequest or DraftRequest: the stream's message
        self.peer = peer
        self._last: asyncio.Future | None = None  # the latest call sent with ``ask``: the next one follows it

    def ask(self, kind: str, message) -> asyncio.Future:
        """``call`` as a future, written once the calls asked before it are answered (one write, one read)."""
        self._last = asyncio.ensure_future(self._after(self._last, kind, message))
        return self._last

    async def _after(self, before: asyncio.Future | None, kind: str, message):
        if before is not None and not before.done():
            await asyncio.wait({before})  # its outcome is its own
        return await self.call(kind, message)

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
        if self._last is not None:
            self._last.cancel()  # the calls chained before it end with the stream

    async def _drain(self) -> None:
        if self._call.done():
            return
        await self._call.done_writing()
        while await self._call.read() is not grpc.aio.EOF:
            pass


class _Session:
    """A session's calls, over its own stream (``OwnStream``) or a shared one (``orchestrator.decode.mux``)."""

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

    def propose(
        self, position: int, tokens: Sequence[int], k: int, free_k: int = 0, max_branches: int = 1,
        features: pb.HiddenFeatures | None = None, successors: Sequence[pb.Successors] = (),
    ) -> asyncio.Future:
        """Send a proposal request now; the future of its ``DraftBlock`` (a session's answers come in order)."""
        msg = pb.ProposeRequest(position=position, tokens=tokens, k=k, free_k=free_k, max_branches=max_branches,
                                successors=successors)
        if features is not None:
            msg.features.CopyFrom(features)
        return self._transport.ask("propose", msg)


@dataclass(eq=False)
class ServiceClient:
    """Stub plus identity of one service (one replica of a ``Pool``)."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    info: pb.ModelInfo | None = None
    mux: object | None = None  # every session on one Sessions stream (orchestrator.decode.mux.Mux); None: a stream each
    kind: str = "service"  # "target" or "draft", as messages name it
    sessions: int = 0  # this orchestrator's sessions open here (``Pool.place``)
    opened: int = 0  # sessions placed here so far: ties go to the replica given fewer
    failed_at: float = field(default=-float("inf"))  # time.monotonic() of the last call here that failed
    gone: bool = False  # its address no longer resolves from the pool's name: no new session
    reported: pb.StatsResponse | None = None  # its latest Stats (every orchestrator's sessions; Pool.watch_load)
    sessions_at_report: int = 0  # this orchestrator's sessions here when ``reported`` was read
    checked_at: float = field(default=-float("inf"))  # time.monotonic() when ``info`` was last read and checked

    @property
    def load(self) -> tuple[int, float]:
        """(sessions open here, the KV budget's reserved fraction): the latest report of the replica, with the
        sessions this orchestrator placed or closed here since; this orchestrator's own sessions without one."""
        if self.reported is None:
            return self.sessions, 0.0
        sessions = max(self.reported.active_sessions - self.sessions_at_report + self.sessions, self.sessions)
        budget = self.reported.kv_budget
        return sessions, (self.reported.kv_reserved / budget if budget else 0.0)

    async def fetch_info(self, timeout_s: float) -> pb.ModelInfo:
        """Wait up to ``timeout_s`` for the service to load and answer ``Info``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                info = await self.stub.Info(pb.InfoRequest(), timeout=max(remaining, 0.01), wait_for_ready=True)
                wire_version.check_service(info.wire_version, info.min_wire_version, self.kind, self.address)
                self.info, self.checked_at = info, time.monotonic()
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

    @property
    def may_have_restarted(self) -> bool:
        """Whether what answers at the address may not be what answered ``Info``: the channel is not connected (a
        dropped connection leaves it idle until the next call), or a call here failed since the check."""
        return self.channel.get_state() is not grpc.ChannelConnectivity.READY or self.failed_at >= self.checked_at

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest())

    async def close(self) -> None:
        if self.mux is not None:
            await self.mux.close()
        await self.channel.close()


# A call's failure after which another replica may serve the session (restart, eviction, a stall).
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
})
AVOID_FAILED_S = 5.0  # a replica whose call failed gets no new session for this long while another can take it
JOIN_GRACE_S = 1.0  # at connect, how long the other replicas may take to answer once one has
JOIN_RETRY_S = 2.0  # between Info calls to a replica that did not answer at connect
RESOLVE_EVERY_S = 10.0  # a dns:/// pool's name is resolved again this often
# Fields of ModelInfo every replica of a pool must report alike: they serve one model, one way.
SAME_IN_A_POOL = ("model_id", "vocab_fingerprint", "vocab_size", "max_context", "max_block", "hidden_size",
                  "token_trees")


class Pool:
    """The replicas of one service behind one ``--target``/``--draft`` value (addresses separated by commas).

    Each session is placed on the replica with the fewest sessions (as it last reported them, every
    orchestrator's, with this one's placed since; ties: the smaller share of its KV budget reserved, then the
    replica given fewer so far), and stays there for its life (its stream is its own, or its replica's shared stream). A replica whose call failed gets no
    new session for ``AVOID_FAILED_S`` while another can take it, so a session re-opened after its replica
    died (re-prefilled from the committed tokens, as after a restart) lands on a live one. Every replica must
    serve the same model (``SAME_IN_A_POOL``); calls that are not a session's (``Info``, ``Stats``) go to the
    replica a new session would."""

    def __init__(self, replicas: Sequence[ServiceClient]) -> None:
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = list(replicas)
        self.kind = self.replicas[0].kind
        self._where: dict[str, ServiceClient] = {}  # open session id -> its replica
        self._first: ServiceClient | None = None  # the replica whose Info the pool's is
        self._model: pb.ModelInfo | None = None  # that Info, as it answered at connect
        self._joining: set[asyncio.Task] = set()  # replicas that did not answer at connect, still asked
        self._refresher: asyncio.Task | None = None  # a resolving pool's re-resolution (``Resolving``)
        self._watcher: asyncio.Task | None = None  # reads the replicas' Stats (``watch_load``)
        self._prepare: Callable[[ServiceClient], None] | None = None

    def prepare(self, setup: Callable[[ServiceClient], None]) -> None:
        """Run ``setup`` on every replica, now and on each one found later (a shared stream of its own, say)."""
        self._prepare = setup
        for replica in self.replicas:
            setup(replica)

    @property
    def address(self) -> str:
        return ",".join(replica.address for replica in self.replicas)

    @property
    def info(self) -> pb.ModelInfo | None:
        return self._model

    @property
    def live(self) -> list[ServiceClient]:
        """Replicas that answered ``Info`` as this pool's model (and still resolve): those sessions go to."""
        return [replica for replica in self.replicas if replica.info is not None and not replica.gone]

    @property
    def stub(self):
        return self.choose().stub

    def choose(self, prefer: str = "", exclude: Sequence[ServiceClient] = ()) -> ServiceClient:
        """The replica for a new session: the one holding session ``prefer`` (a fork's source) if it has not
        failed lately, else the one with the fewest sessions among those that have not, else among all; never
        one of ``exclude`` (those that refused this session) while another is live."""
        now = time.monotonic()
        live = self.live or self.replicas
        live = [r for r in live if all(r is not t for t in exclude)] or live
        fresh = [r for r in live if now - r.failed_at > AVOID_FAILED_S] or live
        preferred = self._where.get(prefer)
        if preferred is not None and any(replica is preferred for replica in fresh):
            return preferred
        return min(fresh, key=lambda r: (*r.load, r.opened))

    def untried(self, tried: Sequence[ServiceClient]) -> bool:
        """Whether a live replica outside ``tried`` is left to ask."""
        return any(all(r is not t for t in tried) for r in self.live)

    def place(self, session_id: str, transport_on, prefer: str = "", exclude: Sequence[ServiceClient] = ()) -> "Placed":
        """A new session's transport (``transport_on(replica)``) on the replica ``choose`` picks."""
        replica = self.choose(prefer, exclude)
        replica.sessions += 1
        replica.opened += 1
        self._where[session_id] = replica
        return Placed(transport_on(replica), self, replica, session_id)

    def _release(self, replica: ServiceClient, session_id: str) -> None:
        replica.sessions -= 1
        if self._where.get(session_id) is replica:
            del self._where[session_id]

    async def fetch_info(self, timeout_s: float) -> pb.ModelInfo:
        """The pool's model, once a replica answers ``Info`` (``ServiceClient.fetch_info``, within ``timeout_s``).
        The others get ``JOIN_GRACE_S`` more; those that answer by then must serve the same model (else a
        ValueError naming both), and those that do not are asked again in the background and take sessions
        once they answer as the same model (a replica down at start does not hold the orchestrator up)."""
        asking = {asyncio.ensure_future(replica.fetch_info(timeout_s)): replica for replica in self.replicas}
        first_error: BaseException | None = None
        pending = set(asking)
        while pending and self._first is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    first_error = first_error or task.exception()
                elif self._first is None:
                    self._first = asking[task]
                    self._model = self._first.info
        if self._first is None:
            raise first_error
        if pending:
            _, pending = await asyncio.wait(pending, timeout=JOIN_GRACE_S)
        mismatch: ValueError | None = None
        for task, replica in asking.items():
            if task in pending:
                task.cancel()
                self._join_later(replica, timeout_s)
            elif task.exception() is not None:
                replica.info = None
                self._join_later(replica, timeout_s)
            elif replica is not self._first:
                try:
                    self._check_same(replica)
                except ValueError as exc:
                    mismatch = mismatch or exc
        if mismatch is not None:
            await self.close()
            raise mismatch
        return self._model

    async def recheck(self, replica: ServiceClient, timeout_s: float) -> None:
        """Before a session opens on ``replica``: if it may have restarted since its ``Info`` was read, ask it again
        (one call, no waiting for the connection) and check the answer as at connect (wire version, the pool's
        model). A replica that answers as another build or model is left out (FailedPrecondition, naming what
        differs; alone in its pool, it is asked again at the next open); one that does not answer is left to the
        open, which fails or retries as it would have."""
        if not replica.may_have_restarted:
            return
        try:
            info = await replica.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return
        try:
            wire_version.check_service(info.wire_version, info.min_wire_version, replica.kind, replica.address)
            replica.info = info
            if self._model is not None:
                self._check_same(replica)
        except (errors.FailedPrecondition, ValueError) as exc:
            replica.info = None
            log.error("%s replica at %s left out until it answers as the pool's: %s", self.kind, replica.address, exc)
            raise errors.FailedPrecondition(str(exc)) from None
        replica.checked_at = time.monotonic()

    def _check_same(self, replica: ServiceClient) -> None:
        """A ValueError naming both, in the pool's order, when ``replica`` serves another model than the pool's
        (it then takes none)."""
        first, mine = self._model, replica.info
        for name in SAME_IN_A_POOL:
            if getattr(mine, name) != getattr(first, name):
                replica.info = None
                if replica is self._first:
                    raise ValueError(f"the {self.kind} at {replica.address} came back serving another model: "
                                     f"{name} {getattr(mine, name)!r}, was {getattr(first, name)!r}")
                a, b = sorted([(self._first, first), (replica, mine)], key=lambda r: self.replicas.index(r[0]))
                raise ValueError(
                    f"the {self.kind} replicas at {a[0].address} and {b[0].address} differ in {name} "
                    f"({getattr(a[1], name)!r} and {getattr(b[1], name)!r}); a pool serves one model"
                )

    def _join_later(self, replica: ServiceClient, timeout_s: float) -> None:
        """Ask ``replica`` for ``Info`` until it answers; it takes sessions once it answers as the pool's model."""

        async def join() -> None:
            while True:
                try:
                    await replica.fetch_info(timeout_s)
                except errors.Unavailable:
                    await asyncio.sleep(JOIN_RETRY_S)
                    continue
                except Exception as exc:  # noqa: BLE001 - any other refusal: logged, the replica left out
                    replica.info = None
                    log.error("%s replica at %s left out of the pool: %s", self.kind, replica.address, exc)
                    return
                try:
                    self._check_same(replica)
                except ValueError as exc:
                    log.error("%s", exc)
                    return
                log.info("%s replica at %s joined the pool", self.kind, replica.address)
                return

        task = asyncio.ensure_future(join())
        self._joining.add(task)
        task.add_done_callback(self._joining.discard)

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest())

    def watch_load(self, every_s: float) -> None:
        """Read every live replica's ``Stats`` every ``every_s`` seconds, so placement counts the sessions and KV
        other orchestrators hold there too (``ServiceClient.load``); 0: this orchestrator's own sessions only."""
        if every_s > 0 and self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch(every_s))

    async def _watch(self, every_s: float) -> None:
        while True:
            replicas = self.live
            own = [replica.sessions for replica in replicas]
            reports = await asyncio.gather(
                *(replica.stub.Stats(pb.StatsRequest(), timeout=max(every_s, 1.0)) for replica in replicas),
                return_exceptions=True,
            )
            for replica, sessions, report in zip(replicas, own, reports):
                if isinstance(report, pb.StatsResponse):
                    replica.reported, replica.sessions_at_report = report, sessions
                else:  # unreachable for now: its own sessions until it answers again
                    replica.reported = None
            await asyncio.sleep(every_s)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._refresher is not None:
            self._refresher.cancel()
        for task in list(self._joining):
            task.cancel()
        await asyncio.gather(*self._joining, return_exceptions=True)
        await asyncio.gather(*(replica.close() for replica in self.replicas))


class Placed:
    """A session's transport on one replica of a ``Pool``: counted there until closed or aborted, and the
    replica marked failed when a call on it fails in a way another replica may not."""

    def __init__(self, transport, pool: Pool, replica: ServiceClient, session_id: str) -> None:
        self._transport = transport
        self._pool = pool
        self.replica = replica
        self._session_id = session_id
        self._placed = True

    async def call(self, kind: str, message):
        try:
            return await self._transport.call(kind, message)
        except PeerError as exc:
            self._failed(exc)
            raise

    def ask(self, kind: str, message) -> asyncio.Future:
        """``call`` as a future, sent now (``OwnStream.ask``, ``MuxSession.ask``)."""
        answer = self._transport.ask(kind, message)
        answer.add_done_callback(self._answered)
        return answer

    def _answered(self, answer: asyncio.Future) -> None:
        if not answer.cancelled() and isinstance(answer.exception(), PeerError):
            self._failed(answer.exception())

    def _failed(self, exc: PeerError) -> None:
        if exc.code in RETRYABLE:
            self.replica.failed_at = time.monotonic()

    def _release(self) -> None:
        if self._placed:
            self._placed = False
            self._pool._release(self.replica, self._session_id)

    async def close(self, timeout_s: float = 5.0) -> None:
        self._release()
        await self._transport.close(timeout_s)

    def abort(self) -> None:
        self._release()
        self._transport.abort()


class Resolving(Pool):
    """A pool behind one ``dns:///NAME:PORT`` address: a replica for each address NAME resolves to, resolved
    again every ``every_s`` seconds. An address that appears is a replica that joins once it answers ``Info``
    as the pool's model; one that disappears takes no new session (those open there go on; it takes sessions
    again if it comes back). Each replica's channel keeps NAME as its authority (and TLS server name)."""

    def __init__(self, name: str, port: int, make: Callable[[str, Sequence[tuple[str, object]]], ServiceClient],
                 every_s: float) -> None:
        self.name, self.port, self._make, self.every_s = name, port, make, every_s
        super().__init__([self._replica(ip) for ip in self._resolve_now()])

    @property
    def address(self) -> str:
        return f"dns:///{self.name}:{self.port}"

    def _replica(self, ip: str) -> ServiceClient:
        authority = f"{self.name}:{self.port}"
        return self._make(self._replica_address(ip), [("grpc.default_authority", authority),
                                                      ("grpc.ssl_target_name_override", self.name)])

    def _resolve_now(self) -> list[str]:
        try:
            found = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise errors.Unavailable(f"{self.name} does not resolve ({exc}); is the name right?") from None
        return sorted({entry[4][0] for entry in found})

    async def fetch_info(self, timeout_s: float) -> pb.ModelInfo:
        info = await super().fetch_info(timeout_s)
        self._refresher = asyncio.ensure_future(self._refresh(timeout_s))
        return info

    async def _refresh(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.every_s)
            try:
                found = await loop.run_in_executor(None, self._resolve_now)
            except errors.Unavailable as exc:
                log.warning("%s pool: %s; keeping its replicas", self.kind, exc)
                continue
            self.update(found, timeout_s)

    def update(self, found: Sequence[str], timeout_s: float) -> None:
        """The name now resolves to ``found``: new addresses join, missing ones take no new session."""
        known = {replica.address: replica for replica in self.replicas}
        wanted = {self._replica_address(ip) for ip in found}
        for replica in self.replicas:
            if replica.gone != (replica.address not in wanted):
                replica.gone = not replica.gone
                log.info("%s replica at %s %s %s", self.kind, replica.address,
                         "left" if replica.gone else "is back in", self.address)
        for ip in found:
            if self._replica_address(ip) not in known:
                replica = self._replica(ip)
                if self._prepare is not None:
                    self._prepare(replica)
                self.replicas.append(replica)
                log.info("%s replica at %s found behind %s", self.kind, replica.address, self.address)
                self._join_later(replica, timeout_s)

    def _replica_address(self, ip: str) -> str:
        return f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"


def dns_name(address: str) -> tuple[str, int] | None:
    """(NAME, PORT) of a ``dns:///NAME:PORT`` (or ``dns://AUTHORITY/NAME:PORT``) address; None for any other."""
    if not address.startswith("dns:"):
        return None
    rest = address[len("dns:"):]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[-1]
    name, _, port = rest.rpartition(":")
    if not name or not port.isdigit():
        raise ValueError(f"{address!r}: a pool's name needs a port, as in dns:///target:50052")
    return name.strip("[]"), int(port)


def replica_addresses(value: str) -> list[str]:
    """``--target``/``--draft`` as replica addresses: separated by commas, except a gRPC ``ipv4:``/``ipv6:``
    address list, which is one channel's."""
    if value.startswith(("ipv4:", "ipv6:")):
        return [value]
    addresses = [part.strip() for part in value.split(",")]
    if any(not address for address in addresses):
        raise ValueError(f"{value!r}: an empty address in the list; separate replicas with single commas")
    return addresses


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


def target_client(address: str, tls: ClientTls | None = None, tokens: Tokens | None = None,
                  options: Sequence[tuple[str, object]] = ()) -> ServiceClient:
    channel = open_channel(address, tls, options)
    return ServiceClient(address, channel, PeerStub(pb_grpc.TargetServiceStub(channel), tokens), kind="target")


def draft_client(address: str, tls: ClientTls | None = None, tokens: Tokens | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> ServiceClient:
    channel = open_channel(address, tls, options)
    return ServiceClient(address, channel, PeerStub(pb_grpc.DraftServiceStub(channel), tokens), kind="draft")


def target_pool(addresses: str, tls: ClientTls | None = None, tokens: Tokens | None = None,
                resolve_every_s: float = RESOLVE_EVERY_S) -> Pool:
    return _pool(addresses, lambda a, o: target_client(a, tls, tokens, o), resolve_every_s)


def draft_pool(addresses: str, tls: ClientTls | None = None, tokens: Tokens | None = None,
               resolve_every_s: float = RESOLVE_EVERY_S) -> Pool:
    return _pool(addresses, lambda a, o: draft_client(a, tls, tokens, o), resolve_every_s)


def _pool(addresses: str, make, resolve_every_s: float) -> Pool:
    """A resolving pool for one ``dns:///NAME:PORT`` address, else a pool of the listed replicas."""
    listed = replica_addresses(addresses)
    named = dns_name(listed[0]) if len(listed) == 1 else None
    if named is not None:
        return Resolving(*named, make, resolve_every_s)
    return Pool([make(address, ()) for address in listed])
