"""A request over its service's bound is refused with RESOURCE_EXHAUSTED before it is parsed, and the service
keeps serving: the draft and target (bounds from their model's shape) and the orchestrator's Generate."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.lmkit.message_limits import draft_request_bytes, target_request_bytes
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call


async def _refused_then_healthy(address: str, stub_type, send):
    """``send(stub)``'s error, then the service's Info and health."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = stub_type(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await send(stub)
        info = await stub.Info(pb.InfoRequest(), timeout=10)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return refused.value, info, health.status


async def _open_stream(stub, request):
    call = stub.Session(timeout=30, metadata=VERSION)
    try:
        await call.write(request)
        answer = await call.read()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        answer = grpc.aio.EOF
    if answer is grpc.aio.EOF:
        raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details())


@pytest.mark.parametrize("service", ["target", "draft"])
def test_an_oversized_session_message_is_refused_and_the_service_stays_healthy(tiny_services, service):
    engine = tiny_services.target_engine if service == "target" else tiny_services.draft_engine
    if service == "target":
        bound = target_request_bytes(engine.max_context, engine.limits.max_block, engine.vocab_size)
        address, stub_type = tiny_services.target_address, pb_grpc.TargetServiceStub
        request = pb.TargetRequest(open=pb.TargetOpen(session_id="big", tokens=[1 << 20] * (bound // 2)))
    else:
        bound = draft_request_bytes(engine.max_context, engine.limits.max_block, 0)
        address, stub_type = tiny_services.draft_address, pb_grpc.DraftServiceStub
        request = pb.DraftRequest(open=pb.DraftOpen(session_id="big", tokens=[1 << 20] * (bound // 2)))
    assert request.ByteSize() > bound  # 3 bytes a token id (a packed varint): over the bound, within 64 MiB

    refused, info, health = run_async(_refused_then_healthy(address, stub_type, lambda s: _open_stream(s, request)))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert f"{bound}-byte bound" in refused.details()
    assert info.max_request_bytes == bound and health == health_pb2.HealthCheckResponse.SERVING
    assert engine.sessions.stats()[0] == 0


def test_an_oversized_sessions_message_is_refused(tiny_services):
    engine = tiny_services.target_engine
    bound = target_request_bytes(engine.max_context, engine.limits.max_block, engine.vocab_size)
    calls = [pb.TargetCall(session_id=f"s{i}", open=pb.TargetOpen(tokens=[7] * 100_000)) for i in range(40)]
    message = pb.TargetCalls(calls=calls)
    assert message.ByteSize() > bound

    async def send(stub):
        call = stub.Sessions(timeout=30, metadata=VERSION)
        try:
            await call.write(message)
            await call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details())

    refused, _, health = run_async(_refused_then_healthy(tiny_services.target_address, pb_grpc.TargetServiceStub, send))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "split a Sessions message" in refused.details()
    assert health == health_pb2.HealthCheckResponse.SERVING


def test_an_oversized_generate_request_is_refused_before_tokenization(public_api):
    async def go():
        async with grpc.aio.insecure_channel(public_api) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(pb.GenerateRequest(prompt="x" * (8 << 20), max_new_tokens=2), timeout=60):
                    pass
            replies = [r async for r in stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=2), timeout=60)]
            return refused.value, replies

    refused, replies = run_async(go())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert "larger than max" in refused.details()
    assert replies[-1].HasField("stats")
