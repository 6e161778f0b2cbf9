"""The orchestrator as a Ray Serve application: replicas that scale, each health-checked, behind a bounded queue.

``build_app(args)`` is a Serve application builder (``import_path: ray_deploy.serve_app:build_app``);
``args`` holds ``specsplit serve`` flags with underscores (``{"target": "...", "k": 8}``) plus the
Ray keys in ``specsplit.ray_deploy.options.RAY_DEFAULTS``. Every replica owns one ``Orchestrator``
and serves ``Generator.Generate`` through the same ``GeneratorServicer`` as the plain server, so
validation, status codes and output are identical. Serve bounds each replica's work
(``max_ongoing_requests``) and the queue in front of them (``max_queued_requests``); a request
beyond both is answered RESOURCE_EXHAUSTED.

Three ways in, one deployment: ``specsplit serve --ray`` (``specsplit.ray_deploy.front``) calls it
through a DeploymentHandle; Serve's gRPC proxy (KubeRay) calls it with ``SERVICER_FUNCTION``
registered in ``grpc_options``; Serve's HTTP proxy reaches each replica's OpenAI-compatible API.
Behind either proxy the replica checks the bearer token itself; metrics go through Ray's metrics API.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from ray import serve

from specsplit.lmkit.heap import freeze_startup_heap
from specsplit.orchestrator.api import server
from specsplit.ray_deploy.options import RAY_DEFAULTS, flags_to_argv, parse_serve_argv
from specsplit.v1 import specsplit_pb2 as pb

SERVICER_FUNCTION = "specsplit.v1.specsplit_pb2_grpc.add_GeneratorServicer_to_server"
HEALTH_PROBE_S = 5.0  # a target that does not answer Info this fast fails the replica's health check
SHUTDOWN_POLL_S = 0.5  # a stopping replica checks this often for unfinished generations (Serve's default: 2 s)


@dataclass(frozen=True)
class GenerateFailed:
    """The last item of a Generate stream that ended with a status other than OK (DeploymentHandle callers).

    Yielded rather than raised so that a client's mistake is not logged as a
    replica failure with a traceback.
    """

    code: str  # a grpc.StatusCode name
    details: str


class _Aborted(Exception):
    def __init__(self, code: str, details: str) -> None:
        super().__init__(code, details)
        self.failure = GenerateFailed(code, details)


class _ServeContext:
    """What ``GeneratorServicer`` needs of a grpc.aio context, on top of Serve's gRPC context."""

    def __init__(self, grpc_context) -> None:
        self._context = grpc_context

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        if self._context is not None:
            # Serve's proxy sends a status set here only if the generator raises.
            self._context.set_code(code)
            self._context.set_details(details)
        raise _Aborted(code.name, details)

    def invocation_metadata(self):
        """The caller's metadata through Serve's gRPC proxy; none through a DeploymentHandle (the front)."""
        return self._context.invocation_metadata() if self._context is not None else ()

    def peer(self) -> str:
        """The caller's address where Serve's context has one, else empty (the per-caller count then sees one)."""
        return getattr(self._context, "peer", lambda: "")() if self._context is not None else ""


async def _until_cancelled(responses):
    """``responses``, ended (and closed) as soon as this task has been asked to cancel.

    On Python 3.11 ``asyncio.wait_for`` returns its call's result instead of
    raising when the cancellation lands just as the call completes, so a
    cancel can vanish inside the speculative loop and the generation run on to
    max_new_tokens, as happens through Serve. The task's ``cancelling()``
    count still records the request.
    """
    task = asyncio.current_task()
    try:
        async for response in responses:
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            yield response
    finally:
        await responses.aclose()


@serve.deployment(name="Orchestrator")
@serve.ingress()
class OrchestratorReplica:
    """One orchestrator; Serve runs ``num_replicas`` of them and routes Generate calls and HTTP requests over them."""

    async def __init__(self, argv: list[str]) -> None:
        from specsplit.orchestrator.api import metrics
        from specsplit.orchestrator.api.generation import Orchestrator
        from specsplit.orchestrator.api.servicer import GeneratorServicer

        metrics.use_backend("ray")
        ns = parse_serve_argv(argv)
        self.tokens = server.public_tokens(ns)
        self.orch = await Orchestrator.connect(server.config_from_args(ns))
        self.servicer = GeneratorServicer(self.orch)
        freeze_startup_heap("orchestrator replica")

    def __serve_build_asgi_app__(self):
        """The replica's HTTP ingress: the OpenAI-compatible API over this replica's orchestrator."""
        from specsplit.orchestrator.api.openai_server import build_app

        return build_app(self.orch, self.tokens)

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None):
        """Stream ``GenerateResponse``s exactly like ``specsplit serve`` does.

        Through Serve's gRPC proxy (``grpc_context`` set) a failure raises with
        its status set on the context; through a DeploymentHandle it ends the
        stream with a ``GenerateFailed`` item.
        """
        context = _ServeContext(grpc_context)
        try:
            if self.tokens is not None and grpc_context is not None and not self._authorized(grpc_context):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong bearer token: send metadata `authorization: Bearer <token>`",
                )
            async for response in _until_cancelled(self.servicer.Generate(request, context)):
                yield response
        except _Aborted as exc:
            if grpc_context is not None:
                raise
            yield exc.failure

    def _authorized(self, grpc_context) -> bool:
        offered = dict(grpc_context.invocation_metadata()).get("authorization", "")
        return self.tokens.bearer_caller(str(offered)) is not None

    def info(self) -> pb.ModelInfo:
        """What ``Generator.Info`` answers, as ``specsplit serve`` does."""
        from specsplit.orchestrator.api.servicer import generator_info

        return generator_info(self.orch)

    def max_generate_bytes(self) -> int:
        """The largest ``Generate`` request worth reading, as ``specsplit serve`` bounds it."""
        return server.max_generate_bytes(self.orch)

    async def check_health(self) -> None:
        """Healthy while the target answers: a replica cut off from it can only fail its requests."""
        try:
            await self.orch.target.stub.Info(pb.InfoRequest(), timeout=HEALTH_PROBE_S)
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"target {self.orch.target.address} unreachable: {exc.code().name}") from None


def build_app(args: dict[str, Any]) -> serve.Application:
    """A Serve application of orchestrator replicas configured by ``args`` (see the module docstring)."""
    args = dict(args)
    ray_opts = {key: args.pop(key, default) for key, default in RAY_DEFAULTS.items()}
    argv = flags_to_argv(args)
    server.config_from_args(parse_serve_argv(argv))  # fail here, with the flag's name, not in every replica
    # Serve's JSON log lines carry its request id (the X-Request-ID the HTTP API also uses).
    logging = {"logging_config": {"encoding": "JSON"}} if args.get("log_format") == "json" else {}
    return OrchestratorReplica.options(
        **logging,
        num_replicas=ray_opts["num_replicas"],
        max_ongoing_requests=ray_opts["max_ongoing_requests"],
        max_queued_requests=ray_opts["max_queued_requests"],
        health_check_period_s=ray_opts["health_check_period_s"],
        health_check_timeout_s=ray_opts["health_check_timeout_s"],
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        ray_actor_options={"num_cpus": ray_opts["num_cpus"]},
    ).bind(argv)
