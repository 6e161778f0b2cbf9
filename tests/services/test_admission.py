"""Admission control: bounded generations and sessions; beyond the bound RESOURCE_EXHAUSTED, never a hang."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.server import start_server
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call


@pytest.fixture(scope="module")
def small_api(tiny_services, tiny_target_dir, background_loop):
    config = OrchestratorConfig(
        tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir), max_concurrent=2
    )
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch))
    yield f"127.0.0.1:{port}"
    background_loop.run(server.stop(0))
    background_loop.run(orch.close())


def test_generations_beyond_the_limit_are_refused_then_admitted(small_api, tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(small_api) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            long = [stub.Generate(pb.GenerateRequest(prompt="tell me", max_new_tokens=400, k=4)) for _ in range(2)]
            for call in long:
                await call.read()  # both admitted and running
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(pb.GenerateRequest(prompt="one more", max_new_tokens=4)):
                    pass
            for call in long:
                while await call.read() is not grpc.aio.EOF:
                    pass
            after = [r async for r in stub.Generate(pb.GenerateRequest(prompt="now", max_new_tokens=4))]
            return refused.value, after

    refused, after = run_async(go())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "maximum of 2 concurrent" in refused.details()
    assert after[-1].HasField("stats")
    assert tiny_services.target_engine.sessions.stats()[0] == 0


def test_target_session_limit_is_resource_exhausted(tiny_services):
    from specsplit.lmkit.sessions import SessionLimits

    engine = tiny_services.target_engine
    original = engine.sessions.limits
    engine.sessions.limits = SessionLimits(max_block=original.max_block, max_sessions=1)

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            stub = pb_grpc.TargetServiceStub(channel)
            first = stub.Session(metadata=VERSION)
            await first.write(pb.TargetRequest(open=pb.TargetOpen(
                session_id="a", tokens=[1, 2], sampling=pb.SamplingParams(), mode=pb.VERIFICATION_MODE_GREEDY)))
            await first.read()
            second = stub.Session(metadata=VERSION)
            await second.write(pb.TargetRequest(open=pb.TargetOpen(
                session_id="b", tokens=[1, 2], sampling=pb.SamplingParams(), mode=pb.VERIFICATION_MODE_GREEDY)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await second.read()
            first.cancel()
            await asyncio.sleep(0.2)
            return info.value

    try:
        error = run_async(go())
    finally:
        engine.sessions.limits = original
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "maximum of 1 sessions" in error.details()
