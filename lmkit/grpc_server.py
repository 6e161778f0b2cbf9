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
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from lmkit import errors

log = logging.getLogger(__name__)
T = TypeVar("T")

_CODES = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}

# Messages carry token blocks and fp16 distributions; 64 MiB leaves room for
# dense draft probabilities of long blocks over large vocabularies.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def status_for(exc: errors.SpecsplitError) -> grpc.StatusCode:
    for cls, code in _CODES.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class ComputeThread:
    """One thread that runs all model work of a service, in arrival order.

    A model on one device serves one forward at a time; running it off the
    event loop keeps streams, health checks and cancellations responsive.
    """

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class EngineServicer:
    """What both model services' servicers share: the engine slot, Stats and GetSession.

    A servicer exists before its engine (the model loads while health says
    NOT_SERVING); until ``attach`` every call answers UNAVAILABLE.
    """

    service_label = "service"

    def __init__(self, compute: ComputeThread) -> None:
        self.engine = None
        self.compute = compute

    def attach(self, engine) -> None:
        self.engine = engine

    def session_state(self, session):  # -> pb.SessionState
        raise NotImplementedError

    async def _require_engine(self, context):
        if self.engine is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the {self.service_label} model is still loading; retry shortly"
            )
        return self.engine

    async def Stats(self, request, context):
        from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb

        active, opened, rounds = (await self._require_engine(context)).sessions.stats()
        return pb.StatsResponse(active_sessions=active, sessions_opened=opened, rounds=rounds)

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


def create_server(address: str, service_names: list[str], reflection_on: bool = False):
    """A grpc.aio server bound to ``address`` (port 0 picks one) with health.

    Returns (server, port, health). Health starts NOT_SERVING for every
    service; flip it with ``set_serving`` once the model is loaded.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}; is the port in use?")
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection_on:
        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    return server, port, health


async def start_in_process(servicer, add_to_server, service_name: str, address: str = "127.0.0.1:0"):
    """Serve an attached servicer in this process (tests, embedding); returns (server, port)."""
    server, port, health = create_server(address, [service_name])
    add_to_server(servicer, server)
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


async def serve_until_signal(server: grpc.aio.Server, health: HealthServicer, grace_s: float) -> None:
    """Block until SIGTERM/SIGINT, then turn NOT_SERVING and stop with a grace period."""
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
        await health.enter_graceful_shutdown()
        await server.stop(grace_s)
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
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


async def run_service(args, service_name: str, register, load) -> None:
    """Bind, report NOT_SERVING while ``load()`` runs off the loop, then serve until a signal.

    ``register(server)`` adds the servicer; ``load()`` builds the engine
    (blocking) and returns a callback that attaches it to the servicer.
    """
    server, port, health = create_server(f"{args.host}:{args.port}", [service_name], args.reflection)
    register(server)
    await set_serving(health, [service_name], False)
    await server.start()
    log.info("%s listening on %s:%d (loading)", service_name, args.host, port)
    try:
        attach = await asyncio.get_running_loop().run_in_executor(None, load)
    except BaseException:
        await server.stop(0)  # a failed load leaves no half-started server behind
        raise
    attach()
    await set_serving(health, [service_name], True)
    write_port_file(args.port_file, port)
    log.info("%s serving on %s:%d", service_name, args.host, port)
    await serve_until_signal(server, health, args.grace_s)
