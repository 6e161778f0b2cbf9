"""The draft service refuses a proposal that would run its model past the model's context."""

from __future__ import annotations

import grpc
import pytest

from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call


def test_a_proposal_past_the_draft_models_context_is_refused(tiny_services):
    context = tiny_services.draft_engine.max_context  # 512
    prompt = [(7 * i) % 200 + 3 for i in range(context - 4)]

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.draft_address) as channel:
            call = pb_grpc.DraftServiceStub(channel).Session(metadata=VERSION)
            await call.write(pb.DraftRequest(open=pb.DraftOpen(
                session_id="edge", tokens=prompt, sampling=pb.SamplingParams(), drafter=DrafterKind.MODEL.value)))
            await call.read()
            await call.write(pb.DraftRequest(propose=pb.ProposeRequest(position=len(prompt), k=4)))
            fits = (await call.read()).block
            await call.write(pb.DraftRequest(propose=pb.ProposeRequest(position=len(prompt), k=8)))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            return fits, caught.value

    fits, error = run_async(go(), 120)
    assert len(fits.tokens) == 4
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"overflows the draft model's context of {context}; ask for at most 4" in error.details()
