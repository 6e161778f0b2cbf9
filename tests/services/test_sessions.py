"""A session lives exactly as long as its stream: ended or cancelled streams free it on every service."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call


def active(services) -> tuple[int, int]:
    return services.target_engine.sessions.stats()[0], services.draft_engine.sessions.stats()[0]


def wait_for_zero(services, timeout_s: float = 10.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while active(services) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    return active(services)


def test_sessions_live_while_streaming_and_end_with_the_stream(tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            stub = pb_grpc.TargetServiceStub(channel)
            call = stub.Session(metadata=VERSION)
            await call.write(pb.TargetRequest(open=pb.TargetOpen(
                session_id="live", tokens=[1, 2, 3], sampling=pb.SamplingParams(), mode=pb.VERIFICATION_MODE_GREEDY)))
            opened = await call.read()
            during = (await stub.Stats(pb.StatsRequest())).active_sessions
            state = await stub.GetSession(pb.GetSessionRequest(session_id="live"))
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            after = (await stub.Stats(pb.StatsRequest())).active_sessions
            return opened, during, state, after

    opened, during, state, after = run_async(go())
    assert opened.opened.position == 3
    assert during == 1 and state.position == 3
    assert after == 0


def test_full_generation_frees_sessions_on_both_services(public_api, tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(public_api) as channel:
            request = pb.GenerateRequest(prompt="a b a b a b", max_new_tokens=12, k=4)
            return [r async for r in pb_grpc.GeneratorStub(channel).Generate(request)]

    responses = run_async(go())
    assert responses[-1].stats.new_tokens == 12
    assert active(tiny_services) == (0, 0)  # the orchestrator waits for each service to close


def test_client_cancellation_frees_sessions_on_both_services(public_api, tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(public_api) as channel:
            call = pb_grpc.GeneratorStub(channel).Generate(
                pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=400, k=4, drafter=pb.DRAFTER_KIND_MODEL)
            )
            first = await call.read()
            seen_during = active(tiny_services)
            call.cancel()
            await asyncio.sleep(0)
            return first, seen_during

    first, seen_during = run_async(go())
    assert first.text is not None
    assert seen_during == (1, 1)
    assert wait_for_zero(tiny_services) == (0, 0)


def test_many_sequential_sessions_leave_nothing_behind(public_api, tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(public_api) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            for i in range(10):
                request = pb.GenerateRequest(prompt=f"count {i}", max_new_tokens=3, k=2)
                [r async for r in stub.Generate(request)]

    opened_before = tiny_services.target_engine.sessions.stats()[1]
    run_async(go())
    assert tiny_services.target_engine.sessions.stats()[1] - opened_before == 10
    assert active(tiny_services) == (0, 0)


def test_idle_sessions_are_evicted_after_the_ttl(tiny_services):
    from specsplit.target_service.servicer import TargetServicer

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            call = pb_grpc.TargetServiceStub(channel).Session(metadata=VERSION)
            await call.write(pb.TargetRequest(open=pb.TargetOpen(
                session_id="idle", tokens=[1, 2], sampling=pb.SamplingParams(), mode=pb.VERIFICATION_MODE_GREEDY)))
            await call.read()
            held = tiny_services.target_engine.sessions.stats()[0]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()  # nothing sent: the TTL runs out
            return held, info.value

    TargetServicer.session_ttl_s = 0.5
    try:
        held, error = run_async(go())
    finally:
        TargetServicer.session_ttl_s = 300.0
    assert held == 1
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "evicted" in error.details()
    assert wait_for_zero(tiny_services) == (0, 0)


def test_a_model_draft_session_reads_its_context_before_its_first_proposal(tiny_services):
    """Right after the open the draft prefills the context on its compute thread (the orchestrator's first round
    runs meanwhile), so the first proposal drafts from a warm cache; its block is the one a cold proposal drafts."""
    from specsplit.draft_service.ngram import NgramConfig
    from specsplit.lmkit.kinds import DrafterKind
    from specsplit.lmkit.sampling import SamplingParams

    prompt = [(7 * i) % 200 + 3 for i in range(48)]
    engine = tiny_services.draft_engine

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.draft_address) as channel:
            stub = pb_grpc.DraftServiceStub(channel)
            call = stub.Session(metadata=VERSION)
            await call.write(pb.DraftRequest(open=pb.DraftOpen(
                session_id="warm", tokens=prompt, sampling=pb.SamplingParams(), drafter=DrafterKind.MODEL.value)))
            await call.read()
            deadline, cached = time.monotonic() + 10.0, 0
            while time.monotonic() < deadline:  # nothing proposed yet
                cached = (await stub.GetSession(pb.GetSessionRequest(session_id="warm"))).cached_tokens
                if cached:
                    break
                await asyncio.sleep(0.01)
            await call.write(pb.DraftRequest(propose=pb.ProposeRequest(position=len(prompt), k=4)))
            block = (await call.read()).block
            await call.done_writing()
            return cached, block

    cached, block = run_async(go())
    assert cached == len(prompt) - 1  # all but the last token, which the first proposal feeds
    cold = engine.open("cold", prompt, SamplingParams(), DrafterKind.MODEL, False, NgramConfig())
    try:
        assert list(block.tokens) == engine.propose(cold, len(prompt), [], 4).proposal.tokens
    finally:
        engine.close("cold")
    assert block.position == len(prompt) and block.timing.compute_us > 0
