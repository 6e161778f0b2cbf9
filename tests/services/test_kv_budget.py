"""Admission by tokens: each target session reserves its prompt + max new tokens + one block against the KV
budget at its open; what does not fit is refused with RESOURCE_EXHAUSTED saying what fits, through the
orchestrator's Generate as well, and admitted once room is freed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.lmkit.sessions import SessionLimits
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, wait_until

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call


@pytest.fixture
def budget(tiny_services):
    """The tiny target with a KV budget of 300 positions (its context is 512), for the length of a test."""
    engine = tiny_services.target_engine
    original = engine.sessions.limits
    engine.sessions.limits = SessionLimits(max_block=original.max_block, max_sessions=original.max_sessions,
                                           kv_budget_tokens=300)
    yield engine
    engine.sessions.limits = original


def test_a_generation_that_does_not_fit_the_budget_is_refused_then_admitted(budget, public_api):
    async def go():
        async with grpc.aio.insecure_channel(public_api) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            # 200 new tokens + the prompt + one block (32) + 1 reserve about 240 of the 300 positions.
            holder = stub.Generate(pb.GenerateRequest(prompt="tell me", max_new_tokens=200, k=4))
            await holder.read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(pb.GenerateRequest(prompt="one more", max_new_tokens=200)):
                    pass
            small = [r async for r in stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=8))]
            while await holder.read() is not grpc.aio.EOF:
                pass
            after = [r async for r in stub.Generate(pb.GenerateRequest(prompt="one more", max_new_tokens=200))]
            return refused.value, small, after

    refused, small, after = run_async(go())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert "KV budget holds 300 positions" in refused.details() and "are free" in refused.details()
    assert small[-1].HasField("stats") and after[-1].HasField("stats")  # what fits gets in; freed room is reused
    assert wait_until(lambda: budget.sessions.stats()[0] == 0)


def test_an_open_that_reserves_nothing_reserves_the_full_context(budget, tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            call = pb_grpc.TargetServiceStub(channel).Session(timeout=30, metadata=VERSION)
            await call.write(pb.TargetRequest(open=pb.TargetOpen(
                session_id="whole", tokens=[1, 2, 3], sampling=pb.SamplingParams(), mode=pb.VERIFICATION_MODE_GREEDY)))
            try:
                await call.read()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
            return await call.code(), await call.details()

    code, details = run_async(go())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reserves 512" in details


def test_a_block_past_the_sessions_reservation_is_refused(budget, tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            call = pb_grpc.TargetServiceStub(channel).Session(timeout=30, metadata=VERSION)
            await call.write(pb.TargetRequest(open=pb.TargetOpen(
                session_id="tight", tokens=[1, 2, 3], sampling=pb.SamplingParams(), mode=pb.VERIFICATION_MODE_GREEDY,
                reserve_tokens=6)))
            await call.read()
            await call.write(pb.TargetRequest(verify=pb.VerifyRequest(position=3, draft_tokens=[4, 5, 6])))
            try:
                await call.read()
            except grpc.aio.AioRpcError:
                pass
            return await call.code(), await call.details()

    code, details = run_async(go())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "passes the 6 positions" in details
    assert wait_until(lambda: budget.sessions.stats()[0] == 0)


def test_the_openai_api_answers_429_in_its_shape_saying_what_fits(budget, tiny_services, tiny_target_dir,
                                                                  background_loop):
    import openai

    from specsplit.orchestrator.api import openai_server
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import Orchestrator

    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir),
                                served_model_names=("tiny",), max_new_tokens_limit=600)
    orch = background_loop.run(Orchestrator.connect(config))
    http = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="hi", max_tokens=400)
        assert refused.value.status_code == 429
        assert "KV budget holds 300 positions and 300 are free" in refused.value.message
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=8).choices[0].text is not None
    finally:
        background_loop.run(http.stop())
        background_loop.run(orch.close())
