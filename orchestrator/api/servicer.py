"""The public ``Generator`` API: validate, generate, stream text back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from specsplit.lmkit import errors, wire_version
from specsplit.lmkit.grpc_server import status_for
from specsplit.orchestrator.api import metrics
from specsplit.orchestrator.api.generation import DeadlineExceeded, Orchestrator
from specsplit.orchestrator.api.limits import caller_of
from specsplit.orchestrator.api.requests import parse_request, sample_count
from specsplit.orchestrator.api.samples import generate_samples
from specsplit.orchestrator.decode.peers import PeerError
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A peer's status passes through when it is the client's to act on; anything
# else (a stale block, say) is an orchestrator bug and surfaces as INTERNAL.
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GeneratorServicer(pb_grpc.GeneratorServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orch = orchestrator

    def stalled_send_s(self) -> float:
        """A response write blocked this long (the client reads nothing) ends the stream and its generation."""
        return self.orch.config.grpc_stalled_send_s

    def on_stalled_send(self) -> None:
        metrics.REFUSED.inc(reason="stalled_send")

    async def Generate(self, request: pb.GenerateRequest, context):
        arrived = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            n = sample_count(request, self.orch.config.max_n)
            with self.orch.admit(_caller(context), n):
                parsed, prompt_ids = await parse_request(request, self.orch)
                async with contextlib.aclosing(generate_samples(self.orch, parsed, prompt_ids, n, arrived)) as samples:
                    async for index, event in samples:
                        yield _response(request, index, event)
        except errors.SpecsplitError as exc:
            code = status_for(exc)
            await context.abort(code, str(exc))
        except PeerError as exc:
            code = peer_status(exc)
            log.warning("generation failed: %s", exc)
            await context.abort(code, str(exc))
        except DeadlineExceeded as exc:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            await context.abort(code, str(exc))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            metrics.REQUESTS.inc(code=code.name)

    async def Info(self, request, context):
        return generator_info(self.orch)


def generator_info(orch: Orchestrator) -> pb.ModelInfo:
    """What ``Generator.Info`` answers: the target's identity and context, the wire versions of this build."""
    target = orch.target.info
    return pb.ModelInfo(
        model_id=target.model_id, vocab_size=target.vocab_size, vocab_fingerprint=target.vocab_fingerprint,
        max_context=target.max_context, wire_version=wire_version.WIRE_VERSION,
        min_wire_version=wire_version.OLDEST_CLIENT,
    )


def _response(request: pb.GenerateRequest, index: int, event) -> pb.GenerateResponse:
    response = pb.GenerateResponse(text=event.text, logprobs=event.logprobs, prompt_logprobs=event.prompt_logprobs,
                                   index=index)
    if request.return_token_ids:
        response.token_ids.extend(event.token_ids)
    if event.finish is not None:
        response.finish_reason = event.finish.value
        response.stats.CopyFrom(event.stats)
    return response


def _caller(context) -> str:
    """The caller a Generate call counts against: its bearer token, else its host (the peer without the port)."""
    token = next((value for key, value in context.invocation_metadata() or () if key == "authorization"), "")
    return caller_of(token, context.peer().rpartition(":")[0])


def peer_status(exc: PeerError) -> grpc.StatusCode:
    """The status a client gets for a failed peer call: its own when it is the client's to act on, else INTERNAL."""
    return exc.code if exc.code in _PASS_THROUGH else grpc.StatusCode.INTERNAL
