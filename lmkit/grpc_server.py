"""What every specsplit gRPC server shares: binding, health, reflection, error mapping, shutdown.

Servicers stay thin: they convert protos to domain calls, run engine work on
the service's single compute thread, and let ``status_for`` turn domain errors
into status codes with the engine's message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specsplit.lmkit import errors, logs, wire_version
from specsplit.lmkit.caller_check import CallerCheck, CallerPolicy, add_caller_flags, caller_policy
from specsplit.lmkit.heap import freeze_startup_heap
from specsplit.lmkit.metrics import serve_metrics
from specsplit.lmkit.security import ServerTls, refusing
from specsplit.lmkit.sessions import SessionLimits

log = logging.getLogger(__name__)
T = TypeVar("T")

_CODES = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Internal: grpc.StatusCode.INTERNAL,
}

# Messages carry token blocks and fp16 distributions; 64 MiB leaves room for
# dense draft probabilities of long blocks over large vocabularies.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class Unreadable:
    """A request refused before it was parsed: bytes that do not parse (INVALID_ARGUMENT) or a message over the
    service's bound (RESOURCE_EXHAUSTED); handlers answer it with its code."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        self.code = code
        self.detail = detail


def _tolerant_deserializer(deserialize, limit: Callable[[], int]):
    owner = getattr(getattr(deserialize, "__self__", None), "__name__", "message")

    def parse(data: bytes):
        bound = limit()
        if bound and len(data) > bound:
            return Unreadable(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{owner} of {len(data)} bytes is over this service's {bound}-byte bound for its model (context, "
                "block and vocabulary; ModelInfo.max_request_bytes); send less, or split a Sessions message's calls"
            ))
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parser error is the client's
            return Unreadable(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {owner}: {exc}; send a valid serialized message")

    return parse


@dataclass(frozen=True)
class StalledSend:
    """How long a server-streaming handler's write may stay blocked (the client reads nothing, the transport does
    not drain), and what to count when it does."""

    bound_s: Callable[[], float]
    on_stalled: Callable[[], None]


# A stalled stream's status may itself wait behind the undrained write; the handler ends after this regardless.
_STATUS_WAIT_S = 1.0


def _bounded_writes(inner_stream, stalled: StalledSend):
    """A server-streaming handler that writes ``inner_stream``'s responses, each within ``stalled.bound_s()``;
    a write still blocked then closes ``inner_stream`` (its work and what it holds end) and the call."""

    async def stream(request, context):
        if isinstance(request, Unreadable):
            await context.abort(request.code, request.detail)
        responses = inner_stream(request, context)
        try:
            async for response in responses:
                bound = stalled.bound_s()
                try:
                    async with asyncio.timeout(bound):
                        await context.write(response)
                except TimeoutError:
                    stalled.on_stalled()
                    await responses.aclose()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_STATUS_WAIT_S):
                            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                                f"the client read nothing of its stream for {bound:g} s; its generation was "
                                "ended (read the stream as it arrives)"))
                    return
        finally:
            await responses.aclose()

    return stream


def _tolerant_handler(
    handler: grpc.RpcMethodHandler, limit: Callable[[], int], stalled: StalledSend | None = None
) -> grpc.RpcMethodHandler:
    """Same handler, but unparseable or oversized bytes become a status instead of a logged traceback or a parse;
    with ``stalled``, a server stream whose write stays blocked past its bound ends."""
    kwargs = {
        "request_deserializer": _tolerant_deserializer(handler.request_deserializer, limit),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        inner_unary = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, Unreadable):
                await context.abort(request.code, request.detail)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream and stalled is not None:
        return grpc.unary_stream_rpc_method_handler(_bounded_writes(handler.unary_stream, stalled), **kwargs)
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, Unreadable):
                await context.abort(request.code, request.detail)
            async for response in inner_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    # Streaming requests are checked where they are read (EngineServicer.session_requests).
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(handler.stream_stream, **kwargs)
    return grpc.stream_unary_rpc_method_handler(handler.stream_unary, **kwargs)


class _Capture:
    """Stands in for a server to collect the handlers a generated add_*_to_server registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add_to_server, servicer, server) -> None:
    """Register a servicer through its generated add function, with tolerant deserialization bounded by the
    servicer's ``max_request_bytes()`` (0 or none: the transport's ceiling alone) and, when the servicer has
    ``stalled_send_s()`` and ``on_stalled_send()``, server-stream writes bounded by it."""
    capture = _Capture()
    add_to_server(servicer, capture)
    limit = getattr(servicer, "max_request_bytes", lambda: 0)
    stalled = (StalledSend(servicer.stalled_send_s, servicer.on_stalled_send)
               if hasattr(servicer, "stalled_send_s") else None)
    handlers = {name: _tolerant_handler(h, limit, stalled) for name, h in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)


def status_for(exc: errors.SpecsplitError) -> grpc.StatusCode:
    for cls, code in _CODES.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class ComputeThread:
    """One thread that runs all model work of a service, in arrival order.

    A model on one device serves one forward at a time; running it off the
    event loop keeps streams, health checks and cancellations responsive.

    All tensor work of a service runs here, the model's loading included, and
    none on the event loop. With OpenMP (torch's CPU threads) every thread that
    starts a parallel region gets its own team of helpers; once two teams
    exist there are more OpenMP threads than cores and libgomp stops spinning
    between regions, so each of a forward's hundreds of regions waits for a
    wake-up.
    """

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending = 0

    async def run(self, fn: Callable[..., T], *args) -> T:
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._pending -= 1

    def queued(self) -> int:
        """Calls submitted and not finished (the one running included)."""
        return self._pending

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class EngineServicer:
    """What both model services' servicers share: the engine slot, Stats and GetSession.

    A servicer exists before its engine (the model loads while health says
    NOT_SERVING); until ``attach`` every call answers UNAVAILABLE.
    """

    service_label = "service"
    session_ttl_s = 300.0  # a session idle this long is evicted (--session-ttl-s)

    def __init__(self, compute: ComputeThread) -> None:
        self.engine = None
        self.compute = compute
        self.draining = False  # set on SIGTERM: sessions open go on for the grace period, new ones are refused

    def drain(self) -> None:
        self.draining = True

    def check_open(self) -> None:
        """Raise Unavailable while draining: a new session belongs on another replica, not on one that will cut
        it at the end of its grace period (the orchestrator's pool places it elsewhere at once)."""
        if self.draining:
            log.info("refused a new session: draining")
            raise errors.Unavailable(
                f"this {self.service_label} is draining (shutting down); open the session on another replica"
            )

    async def session_requests(self, context):
        """The stream's requests, in order; a session idle past the TTL is evicted (the stream ends).

        One timeout per stream, re-armed around each read (not a task and a timer per message, as
        ``asyncio.wait_for`` makes): the idle clock runs only while the stream waits for its next request."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as idle:
                while True:
                    idle.reschedule(loop.time() + self.session_ttl_s)
                    request = await context.read()
                    idle.reschedule(None)
                    if request is grpc.aio.EOF:
                        return
                    if isinstance(request, Unreadable):
                        await context.abort(request.code, request.detail)
                    yield request
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"session evicted after {self.session_ttl_s:g} s idle; open a new one from the committed tokens",
            )

    def attach(self, engine) -> None:
        self.engine = engine

    def max_request_bytes(self) -> int:
        """The largest request message this service accepts (``lmkit.message_limits``); 0 while loading."""
        return 0

    def session_state(self, session):  # -> pb.SessionState
        raise NotImplementedError

    async def _require_engine(self, context):
        if self.engine is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the {self.service_label} model is still loading; retry shortly"
            )
        return self.engine

    async def Stats(self, request, context):
        from specsplit.v1 import specsplit_pb2 as pb

        sessions = (await self._require_engine(context)).sessions
        active, opened, rounds = sessions.stats()
        reserved, budget, _ = sessions.budget()
        return pb.StatsResponse(active_sessions=active, sessions_opened=opened, rounds=rounds, kv_reserved=reserved,
                                kv_budget=budget)

    async def GetSession(self, request, context):
        engine = await self._require_engine(context)
        try:
            return self.session_state(engine.sessions.get(request.session_id))
        except errors.SpecsplitError as exc:
            await context.abort(status_for(exc), str(exc))


async def abort_on_error(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    """Await ``call``; a domain error aborts the RPC with its status and message."""
    try:
        return await call
    except errors.SpecsplitError as exc:
        await context.abort(status_for(exc), str(exc))
        raise  # unreachable: abort raises


# Per service: the calls that carry work, the oldest wire version accepted on them and who makes them.
# Info, Stats and GetSession stay open to any version, so an older peer can still read why it is refused.
VERSIONED_CALLS = {
    "specsplit.v1.DraftService": (("Session", "Sessions"), wire_version.OLDEST_ORCHESTRATOR, "orchestrator"),
    "specsplit.v1.TargetService": (("Session", "Sessions"), wire_version.OLDEST_ORCHESTRATOR, "orchestrator"),
    "specsplit.v1.Generator": (("Generate",), wire_version.OLDEST_CLIENT, "client"),
}


class WireVersionCheck(grpc.aio.ServerInterceptor):
    """Refuses a call from a peer whose wire version the service does not accept (FAILED_PRECONDITION, naming both
    versions) before the handler reads a message; a malformed version is INVALID_ARGUMENT."""

    def __init__(self, service_names: list[str]) -> None:
        self._checks = {}  # "/service/method" -> (oldest accepted, the service's short name, who calls it)
        for service in service_names:
            if service in VERSIONED_CALLS:
                methods, oldest, caller = VERSIONED_CALLS[service]
                for method in methods:
                    self._checks[f"/{service}/{method}"] = (oldest, service.rsplit(".", 1)[-1], caller)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        check = self._checks.get(handler_call_details.method)
        if handler is None or check is None:
            return handler
        oldest, service, caller = check
        try:
            version = wire_version.stated_version(handler_call_details.invocation_metadata)
            wire_version.check_caller(version, oldest, service, caller)
        except errors.SpecsplitError as exc:
            return refusing(handler, status_for(exc), str(exc))
        return handler


# Keepalive pings a client may send while its calls are in flight: every 5 s or slower (the orchestrator
# pings its services every 10 s to find a vanished host). gRPC's default of 5 minutes would answer a third
# faster ping with GOAWAY (too_many_pings), ending every stream on the connection.
PING_OPTIONS = [("grpc.http2.min_recv_ping_interval_without_data_ms", 5000)]


def create_server(
    address: str, service_names: list[str], reflection_on: bool = False, tls: ServerTls | None = None,
    interceptors: tuple = (), max_receive_bytes: int = MAX_MESSAGE_BYTES,
):
    """A grpc.aio server bound to ``address`` (port 0 picks one) with health; TLS when ``tls`` is enabled.

    Returns (server, port, health). Health starts NOT_SERVING for every
    service; flip it with ``set_serving`` once the model is loaded. A request
    message over ``max_receive_bytes`` is refused by the transport
    (RESOURCE_EXHAUSTED) before any handler sees it; a call from a peer of a
    wire version the service does not accept, by ``WireVersionCheck``.
    """
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", max_receive_bytes),
               *PING_OPTIONS]
    interceptors = (*interceptors, WireVersionCheck(service_names))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    if tls is not None and tls.enabled:
        port = server.add_secure_port(address, tls.credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}; is the port in use?")
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection_on:
        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    return server, port, health


def caller_interceptors(policy: CallerPolicy | None) -> tuple:
    """The caller check a service's policy asks for (none when it asks for nothing)."""
    return (CallerCheck(policy),) if policy is not None and policy.enabled else ()


async def start_in_process(
    servicer, add_to_server, service_name: str, address: str = "127.0.0.1:0", tls: ServerTls | None = None,
    interceptors: tuple = (), policy: CallerPolicy | None = None, max_receive_bytes: int = MAX_MESSAGE_BYTES,
):
    """Serve an attached servicer in this process (tests, embedding); returns (server, port)."""
    interceptors = (*interceptors, *caller_interceptors(policy))
    server, port, health = create_server(
        address, [service_name], tls=tls, interceptors=interceptors, max_receive_bytes=max_receive_bytes
    )
    add_servicer(add_to_server, servicer, server)
    await server.start()
    await set_serving(health, [service_name], True)
    return server, port


async def set_serving(health: HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health.set(name, status)


def write_port_file(path: str, port: int) -> None:
    """Atomically publish the bound port (for supervisors and tests that bind port 0)."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(target)


async def serve_until_signal(
    server: grpc.aio.Server, health: HealthServicer, grace_s: float, also_stop: Callable[[], Awaitable] | None = None,
    on_signal: Callable[[], None] | None = None,
) -> None:
    """Block until SIGTERM/SIGINT, then call ``on_signal()``, turn NOT_SERVING and stop with a grace period.

    ``also_stop()`` (another server of the process) drains at the same time.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received: draining for up to %.1f s", grace_s)
        if on_signal is not None:
            on_signal()
        await health.enter_graceful_shutdown()
        await asyncio.gather(server.stop(grace_s), *([also_stop()] if also_stop is not None else []))
    waiter.cancel()
    stopper.cancel()


def add_common_flags(parser, default_port: int) -> None:
    """Flags every service takes."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=default_port, help="port to bind; 0 picks a free one")
    parser.add_argument("--port-file", default="", help="write the bound port here once serving")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for this service")
    parser.add_argument("--cpus", default="", help="pin the process to these CPU ids, e.g. '1' or '0,1'")
    parser.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument("--max-sessions", type=int, default=64, help="live sessions at most")
    parser.add_argument("--session-ttl-s", type=float, default=300.0, help="evict sessions idle this long")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)")
    parser.add_argument(
        "--health-port", type=int, default=0,
        help="also serve grpc.health.v1 alone, plaintext, on this port (for Kubernetes gRPC probes, which cannot "
             "speak TLS); 0 = off",
    )
    logs.add_log_flags(parser)
    add_tls_flags(parser)
    add_caller_flags(parser)


def add_tls_flags(parser) -> None:
    parser.add_argument("--tls-cert", default="", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", default="", help="private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", default="", help="require client certificates signed by this CA (mTLS)")


def session_limits(args) -> SessionLimits:
    """A service's session limits from its flags (ValueError for a bad value)."""
    return SessionLimits(max_block=args.max_block, max_sessions=args.max_sessions,
                         max_sessions_per_caller=args.max_sessions_per_caller)


def server_tls(args) -> ServerTls:
    return ServerTls(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


async def run_service(args, service_name: str, register, load, servicer: "EngineServicer") -> None:
    """Bind, report NOT_SERVING while ``load()`` runs on the servicer's compute thread, then serve until a signal.

    ``register(server)`` adds the servicer; ``load()`` builds the engine
    (blocking) and returns a callback that attaches it to the servicer.
    """
    policy = caller_policy(args, service_name.rsplit(".", 1)[-1].removesuffix("Service").lower())
    server, port, health = create_server(
        f"{args.host}:{args.port}", [service_name], args.reflection, server_tls(args), caller_interceptors(policy)
    )
    register(server)
    serve_metrics(args.metrics_port, args.host, service_name.rsplit(".", 1)[-1], servicer)
    await set_serving(health, [service_name], False)
    probes = await start_health_server(args.host, args.health_port, health)
    await server.start()
    log.info("%s listening on %s:%d (loading)", service_name, args.host, port)
    try:
        attach = await servicer.compute.run(load)  # the thread that will run the model (ComputeThread)
    except BaseException:
        await server.stop(0)  # a failed load leaves no half-started server behind
        if probes is not None:
            await probes.stop(0)
        raise
    attach()
    freeze_startup_heap(service_name.rsplit(".", 1)[-1])
    await set_serving(health, [service_name], True)
    write_port_file(args.port_file, port)
    log.info("%s serving on %s:%d", service_name, args.host, port)
    try:
        await serve_until_signal(server, health, args.grace_s, on_signal=servicer.drain)
    finally:
        if probes is not None:
            await probes.stop(0)


async def start_health_server(host: str, port: int, health: HealthServicer) -> grpc.aio.Server | None:
    """The same health statuses, plaintext, on their own port (``--health-port``); None when port is 0.

    Kubernetes' native gRPC probes cannot present TLS or client certificates,
    so a service whose main port requires mTLS exposes health alone here.
    """
    if not port:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"could not bind --health-port {port} on {host}; is the port in use?")
    await server.start()
    return server
