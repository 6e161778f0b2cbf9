"""Admission by tokens on the draft: each session reserves its prompt + most new tokens + one block at what its
drafter keeps a position (a model's keys and values; nothing for n-gram). What the budget cannot hold is refused
with RESOURCE_EXHAUSTED saying what fits; through the orchestrator such a session runs target-only, its output
the target's own, and gets the draft again once room is freed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sessions import SessionLimits
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, wait_until

pytestmark = pytest.mark.services
VERSION = wire_metadata()
BUDGET_POSITIONS = 300  # of the tiny draft model; its context is 512


@pytest.fixture
def draft_budget(tiny_services):
    """The tiny draft with a KV budget of 300 of its model's positions, for the length of a test."""
    engine = tiny_services.draft_engine
    original = engine.sessions.limits
    per_position = engine.position_bytes[DrafterKind.MODEL]
    engine.sessions.limits = SessionLimits(max_block=original.max_block, max_sessions=original.max_sessions,
                                           kv_budget_bytes=BUDGET_POSITIONS * per_position)
    yield engine, per_position
    engine.sessions.limits = original


async def open_draft(call, session_id: str, drafter: int, reserve: int) -> tuple[grpc.StatusCode, str]:
    """Open a draft session on ``call`` (a Session stream); OK with '' once it is open, else the stream's status."""
    await call.write(pb.DraftRequest(open=pb.DraftOpen(
        session_id=session_id, tokens=[1, 2, 3], sampling=pb.SamplingParams(), drafter=drafter,
        reserve_tokens=reserve)))
    try:
        reply = await call.read()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        reply = None
    if reply is not None and reply is not grpc.aio.EOF:
        return grpc.StatusCode.OK, ""
    return await call.code(), await call.details()


async def generate(stub, prompt: str, k: int) -> pb.GenerateResponse:
    # A fixed k: every round asks the draft while it holds the session (adaptive K may find drafting not paying).
    responses = [r async for r in stub.Generate(pb.GenerateRequest(
        prompt=prompt, max_new_tokens=24, k=k, drafter=pb.DRAFTER_KIND_MODEL, return_token_ids=True,
        adaptive_k=False))]
    ids = [t for r in responses for t in r.token_ids]
    return ids, responses[-1].stats


def test_model_sessions_past_the_draft_budget_run_target_only_until_room_is_freed(
    draft_budget, tiny_services, public_api
):
    engine, per_position = draft_budget

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.draft_address) as draft_channel, \
                grpc.aio.insecure_channel(public_api) as channel:
            draft = pb_grpc.DraftServiceStub(draft_channel)
            holder = draft.Session(timeout=60, metadata=VERSION)
            held = await open_draft(holder, "holder", pb.DRAFTER_KIND_MODEL, 250)
            refused = await open_draft(draft.Session(timeout=30, metadata=VERSION), "big", pb.DRAFTER_KIND_MODEL, 100)
            ngram = draft.Session(timeout=30, metadata=VERSION)
            free = await open_draft(ngram, "ngram", pb.DRAFTER_KIND_NGRAM, 10**6)  # keeps nothing per position
            ngram.cancel()
            stub = pb_grpc.GeneratorStub(channel)
            plain = await generate(stub, "Once upon a time", k=0)
            squeezed = await generate(stub, "Once upon a time", k=4)  # reserves ~60 positions: 50 are free
            holder.cancel()
            await asyncio.to_thread(wait_until, lambda: "holder" not in engine.sessions)
            roomy = await generate(stub, "Once upon a time", k=4)
            return held, refused, free, plain, squeezed, roomy

    held, refused, free, plain, squeezed, roomy = run_async(go())
    assert held == (grpc.StatusCode.OK, "")
    code, details = refused
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert f"KV budget holds {BUDGET_POSITIONS * per_position} bytes and {50 * per_position} are free" in details
    assert f"of {per_position} bytes each: ask for at most 50 positions" in details
    assert free == (grpc.StatusCode.OK, "")
    (plain_ids, _), (squeezed_ids, squeezed_stats), (roomy_ids, roomy_stats) = plain, squeezed, roomy
    assert squeezed_ids == plain_ids and roomy_ids == plain_ids  # the target's own greedy output either way
    assert squeezed_stats.drafted_tokens == 0 and squeezed_stats.draft_fallback_rounds > 0  # target-only
    assert roomy_stats.draft_fallback_rounds == 0 and roomy_stats.drafted_tokens > 0
    assert wait_until(lambda: engine.sessions.stats()[0] == 0)
