"""The public ``Generator`` API: validate, generate, stream text back."""

from __future__ import annotations

import asyncio
import logging

import grpc

from lmkit import errors
from lmkit.grpc_server import status_for
from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from orchestrator import metrics
from orchestrator.generation import Orchestrator
from orchestrator.peers import PeerError
from orchestrator.requests import parse_request

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
        self.active = 0  # generations in flight; bounded by config.max_concurrent

    async def Generate(self, request: pb.GenerateRequest, context):
        limit = self.orch.config.max_concurrent
        if self.active >= limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the orchestrator is serving its maximum of {limit} concurrent generations; retry with backoff",
            )
        self.active += 1
        metrics.ACTIVE.inc()
        code = grpc.StatusCode.OK
        try:
            parsed, prompt_ids = parse_request(request, self.orch)
            async for event in self.orch.generate(parsed, prompt_ids):
                response = pb.GenerateResponse(text=event.text)
                if request.return_token_ids:
                    response.token_ids.extend(event.token_ids)
                if event.finish is not None:
                    response.finish_reason = event.finish.value
                    response.stats.CopyFrom(event.stats)
                yield response
        except errors.SpecsplitError as exc:
            code = status_for(exc)
            await context.abort(code, str(exc))
        except PeerError as exc:
            code = exc.code if exc.code in _PASS_THROUGH else grpc.StatusCode.INTERNAL
            log.warning("generation failed: %s", exc)
            await context.abort(code, str(exc))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.active -= 1
            metrics.ACTIVE.dec()
            metrics.REQUESTS.labels(code.name).inc()
