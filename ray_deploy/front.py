"""``specsplit serve --ray``: our gRPC front over the orchestrator's Ray Serve application.

The front is the same public server as plain ``specsplit serve`` (grpc.health.v1,
TLS, bearer token, tolerant parsing, SIGTERM drain) but each Generate streams
from a Serve replica through a DeploymentHandle. Serve picks the replica,
bounds the queue in front of the replicas, health-checks each one and restarts
it when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time

import grpc

from specsplit.lmkit.grpc_server import (
    add_servicer,
    create_server,
    serve_until_signal,
    server_tls,
    set_serving,
    write_port_file,
)
from specsplit.lmkit.metrics import serve_metrics
from specsplit.orchestrator.api import metrics, server
from specsplit.ray_deploy import cluster, options, resources, serve_app
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
APP_POLL_S = 5.0  # how often health follows the Serve application's status
DELETE_TIMEOUT_S = 60.0  # replicas drain their generations while the application is deleted
DEPLOY_POLL_S = 0.5


class RayFrontServicer(pb_grpc.GeneratorServicer):
    """Generate, streamed from a Serve replica; Serve's refusals become gRPC status codes."""

    def __init__(self, handle, max_queued: int, max_generate_bytes: int = 0, stalled_send_s: float = 30.0) -> None:
        self.handle = handle.options(stream=True)
        self.unary = handle.options(stream=False)
        self.max_queued = max_queued
        self._max_generate_bytes = max_generate_bytes
        self._stalled_send_s = stalled_send_s

    def stalled_send_s(self) -> float:
        """A response write blocked this long (the client reads nothing) ends the stream and the replica's work."""
        return self._stalled_send_s

    def on_stalled_send(self) -> None:
        metrics.REFUSED.inc(reason="stalled_send")
        log.warning("a client read nothing of its Generate stream for %.0f s: the stream and its generation end",
                    self._stalled_send_s)

    def max_request_bytes(self) -> int:
        """A larger ``Generate`` is refused (RESOURCE_EXHAUSTED) before it is parsed: the replicas' bound."""
        return self._max_generate_bytes

    async def Info(self, request: pb.InfoRequest, context):
        return await self.unary.info.remote()

    async def Generate(self, request: pb.GenerateRequest, context):
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        code = grpc.StatusCode.OK
        stream = self.handle.Generate.remote(request)
        finished = False

        def on_done(_context) -> None:
            # The client left (cancel, deadline, disconnect): end the replica's generation and its sessions.
            # A done callback fires every time; a CancelledError reaches this generator only if it is awaiting.
            if not finished:
                stream.cancel()

        context.add_done_callback(on_done)
        try:
            async for item in stream:
                if isinstance(item, serve_app.GenerateFailed):
                    code = grpc.StatusCode[item.code]
                    finished = True
                    await context.abort(code, item.details)
                yield item
            finished = True
        except BackPressureError:
            finished = True
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(
                code,
                f"every orchestrator replica is busy and {self.max_queued} requests already wait "
                "(--ray-max-queued-requests); retry with backoff",
            )
        except (DeploymentUnavailableError, RayActorError) as exc:
            code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"orchestrator replica unavailable ({type(exc).__name__}); retry")
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            metrics.REQUESTS.inc(code=code.name)


def deploy(args, local: bool, cancelled: threading.Event):
    """Start Serve and run the application. The front is the gRPC ingress; with --http-port, Serve's HTTP
    proxy (on the head node) is the HTTP one, reaching the replicas' OpenAI-compatible API.

    Waits a bounded time for the replicas' resources: first for a placement group that holds them
    all (removed at once: it only proves they fit), then for Serve to stop reporting replicas that
    wait to be scheduled. Returns None when ``cancelled`` is set meanwhile.
    """
    from ray import serve
    from ray.util.placement_group import remove_placement_group

    http = args.http_port is not None
    if http:
        if args.http_port == 0:
            raise ValueError("--http-port 0 is not supported with --ray: Serve's HTTP proxy needs a fixed port")
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.http_port})
    else:
        serve.start(proxy_location="Disabled")
    app_args = options.app_args(args, server.build_parser())
    if http and args.auth_token_file:
        app_args["auth_token_file"] = args.auth_token_file  # the replicas check the HTTP requests' token
    app = serve_app.build_app(app_args)
    ask = resources.replica_ask(args.ray_num_cpus, args.ray_num_replicas)
    probe = resources.reserve([ask], args.ray_schedule_timeout_s, resources.capacity(), local, cancelled)
    if probe is not None:
        remove_placement_group(probe)
    if cancelled.is_set():
        return None
    # serve.run waits for RUNNING without a bound; serve._run (marked PublicAPI in Ray 2.60) can return at once.
    serve._run(app, _blocking=False, name=args.ray_app_name, route_prefix="/" if http else None)
    began, said = time.monotonic(), set()
    while not cancelled.is_set():
        app_status = serve.status().applications.get(args.ray_app_name)
        if app_status is not None and app_status.status == "RUNNING":
            if http:
                _wait_for_http(args.host, args.http_port)
            return serve.get_app_handle(args.ray_app_name)
        if app_status is None or app_status.status == "DEPLOY_FAILED":  # say why, as the replica said it
            why = _replica_error(app_status) or (app_status.message if app_status else "the application is gone")
            raise ValueError(f"the orchestrator replicas did not start: {why}")
        for message in {d.message for d in app_status.deployments.values() if d.message} - said:
            log.warning("Serve: %s", message)  # e.g. replicas slow to be scheduled or to start: never silent
            said.add(message)
        if time.monotonic() - began > args.ray_schedule_timeout_s and _waiting_for_resources(app_status):
            raise ValueError(resources.refusal(
                f"Serve could not schedule the orchestrator replicas within {args.ray_schedule_timeout_s:.0f} s "
                "(--ray-schedule-timeout-s): what they ask for is not free", [ask], resources.capacity(), local))
        time.sleep(DEPLOY_POLL_S)
    return None


def _waiting_for_resources(app) -> bool:
    """Serve says that replicas wait to be scheduled (its report, 30 s after they began to wait)."""
    return any("to be scheduled" in d.message for d in app.deployments.values())


def _wait_for_http(host: str, port: int, timeout_s: float = 60.0) -> None:
    """Serve's HTTP proxy answers on the port, or a ValueError says why it cannot (Serve already running)."""
    import urllib.error
    import urllib.request

    address = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://{address}:{port}/-/healthz", timeout=5).close()
            return
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"Serve's HTTP proxy does not answer on {address}:{port} ({exc}); if Serve already runs on "
                    "this cluster with other HTTP options, it keeps them: `serve shutdown` first, or use its port"
                ) from None
            time.sleep(0.5)


def _replica_error(app) -> str:
    """The last line of the error a failed replica reported (its exception), '' if none."""
    messages = [d.message for d in app.deployments.values() if d.message] if app is not None else []
    lines = [line.strip() for message in messages for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else ""


async def _off_loop(fn, *args, timeout_s: float):
    """``fn(*args)`` on a daemon thread: a call into a cluster that went away can neither block the
    event loop nor keep the process from exiting (the default executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(error: Exception | None, result) -> None:
        if not future.done():  # wait_for may have given up on it already
            future.set_exception(error) if error is not None else future.set_result(result)

    def call() -> None:
        try:
            outcome = (None, fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (exc, None)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=call, daemon=True).start()
    return await asyncio.wait_for(future, timeout_s)


async def _follow_app_status(health, app_name: str) -> None:
    """Health is SERVING while the application runs (every replica started and healthy)."""
    from ray import serve

    while True:
        await asyncio.sleep(APP_POLL_S)
        try:
            app = (await _off_loop(serve.status, timeout_s=APP_POLL_S)).applications.get(app_name)
        except Exception:  # noqa: BLE001 - a controller that does not answer means not serving
            app = None
        await set_serving(health, [SERVICE_NAME], app is not None and app.status == "RUNNING")


async def serve(args) -> None:
    """``specsplit serve --ray``: join or start a cluster, deploy the application, serve until a signal."""
    if args.ray_num_cpus is not None and args.ray_num_cpus < 0:
        raise ValueError(f"--ray-num-cpus must be >= 0, got {args.ray_num_cpus:g}")
    # On the loop's (main) thread: it installs the SIGTERM handler; nothing else runs on the loop yet.
    started = cluster.connect(args.ray_address, args.ray_local_cpus)
    try:
        cap = resources.capacity()
        args.ray_num_cpus = resources.size_cpus({"replica": (args.ray_num_cpus, args.ray_num_replicas)},
                                                cap.total().get("CPU", 0.0) if started else None)["replica"]
        resources.require([resources.replica_ask(args.ray_num_cpus, args.ray_num_replicas)], cap, started,
                          "serve --ray")
        await run_front(args, local=started)
    except KeyboardInterrupt:
        if not cluster.stop_requested():
            raise
    finally:
        cluster.disconnect(started)


async def run_front(args, local: bool = False) -> None:
    """Deploy the application on the connected cluster and serve the front until SIGTERM/SIGINT.

    A signal while the replicas deploy stops at once; either way the application is deleted.
    """
    from ray import serve as ray_serve

    stop = _stop_on_signal()
    interceptors = server.public_interceptors(server.public_tokens(args))
    _check_bindable(args.host, args.port)  # the front binds after the deploy: a port in use fails before it
    serve_metrics(args.metrics_port, args.host, "orchestrator")
    cancelled, deployed = threading.Event(), threading.Event()

    def deploying():
        try:
            return deploy(args, local, cancelled)
        finally:
            deployed.set()

    try:
        handle = await _unless(stop, _off_loop(deploying, timeout_s=None))
        if handle is None:  # stopped while deploying
            return
        bound = await handle.max_generate_bytes.remote()  # the target's context of the tokenizer's longest tokens
        # Made once the bound is known: the transport refuses a larger Generate before buffering it, as
        # `specsplit serve` does, instead of reading up to 64 MiB first.
        front, port, health = create_server(
            f"{args.host}:{args.port}", [SERVICE_NAME], args.reflection, server_tls(args), interceptors, bound
        )
        await set_serving(health, [SERVICE_NAME], False)
        servicer = RayFrontServicer(handle, args.ray_max_queued_requests, bound, args.grpc_stalled_send_s)
        add_servicer(pb_grpc.add_GeneratorServicer_to_server, servicer, front)
        await front.start()
        await set_serving(health, [SERVICE_NAME], True)
        write_port_file(args.port_file, port)
        log.info("orchestrator on Ray (%d replicas) serving on %s:%d", args.ray_num_replicas, args.host, port)
        if args.http_port is not None:
            log.info("OpenAI-compatible HTTP API (Serve's HTTP proxy) on %s:%d", args.host, args.http_port)
        watcher = asyncio.create_task(_follow_app_status(health, args.ray_app_name))
        try:
            if not stop.is_set():  # serve_until_signal takes the signals over from here
                await serve_until_signal(front, health, args.grace_s)
        finally:
            watcher.cancel()
    finally:
        cancelled.set()
        began = time.monotonic()
        with contextlib.suppress(Exception):  # the cluster may already be gone
            # A deploy cut short by a signal finishes its step first, so that nothing deploys after the delete.
            await _off_loop(deployed.wait, DELETE_TIMEOUT_S, timeout_s=DELETE_TIMEOUT_S)
            await _off_loop(ray_serve.delete, args.ray_app_name, timeout_s=DELETE_TIMEOUT_S)
        log.info("application %s deleted in %.1f s", args.ray_app_name, time.monotonic() - began)


def _check_bindable(host: str, port: int) -> None:
    """A ValueError now, not after minutes of deploying, when ``host:port`` cannot be bound (0: any port can)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"could not bind {host}:{port} ({exc.strerror}); is the port in use?") from None


def _stop_on_signal() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, from now on (replacing Ray's handler, which exits wherever it is)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _unless(stop: asyncio.Event, awaitable):
    """The result of ``awaitable``, or None as soon as ``stop`` is set first."""
    task, stopped = asyncio.ensure_future(awaitable), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None
