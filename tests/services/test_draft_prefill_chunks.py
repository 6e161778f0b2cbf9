"""A long context on the draft is read a chunk at a time (serve-draft --prefill-chunk): another session's proposal
runs between its chunks instead of after the whole read; with chunks off it waits for all of it."""

from __future__ import annotations

import grpc
import pytest

from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, wait_until

pytestmark = pytest.mark.services
VERSION = wire_metadata()


@pytest.fixture
def prefill_chunk(tiny_services, request):
    """The tiny draft reading new contexts ``request.param`` tokens at a time, for the length of a test."""
    engine = tiny_services.draft_engine
    original = engine.prefill_chunk
    engine.prefill_chunk = request.param
    yield engine
    engine.prefill_chunk = original


async def open_session(channel, session_id: str, tokens: list[int]):
    call = pb_grpc.DraftServiceStub(channel).Session(timeout=120, metadata=VERSION)
    await call.write(pb.DraftRequest(open=pb.DraftOpen(
        session_id=session_id, tokens=tokens, sampling=pb.SamplingParams(), drafter=DrafterKind.MODEL.value)))
    assert (await call.read()).HasField("opened")
    return call


@pytest.mark.parametrize("prefill_chunk", [2, 0], indirect=True, ids=["chunks-of-2", "whole"])
def test_a_short_sessions_proposal_runs_between_the_chunks_of_a_long_read(tiny_services, prefill_chunk):
    engine = prefill_chunk
    long_prompt = [(7 * i) % 200 + 3 for i in range(engine.max_context - 16)]  # 496 tokens of the 512
    chunks_before = engine.prefill_chunks

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.draft_address) as channel:
            long = await open_session(channel, "long", long_prompt)  # its read starts on the compute thread
            short = await open_session(channel, "short", [5, 6, 7])  # read in one chunk
            await short.write(pb.DraftRequest(propose=pb.ProposeRequest(position=3, k=4)))
            block = (await short.read()).block
            long_read_then = engine.sessions.get("long").drafter.cached_tokens  # when the short one's came back
            await long.write(pb.DraftRequest(propose=pb.ProposeRequest(position=len(long_prompt), k=4)))
            long_block = (await long.read()).block
            long.cancel()
            short.cancel()
            return block, long_read_then, long_block

    block, long_read_then, long_block = run_async(go(), 120)
    assert len(block.tokens) == 4 and len(long_block.tokens) == 4
    whole = len(long_prompt) - 1  # the read leaves the last token to the first proposal
    if engine.prefill_chunk:
        assert long_read_then < whole, "the short session's proposal waited for the whole long read"
        assert engine.prefill_chunks - chunks_before == -(-whole // engine.prefill_chunk) - 1
    else:
        assert long_read_then >= whole and engine.prefill_chunks == chunks_before


@pytest.mark.parametrize("prefill_chunk", [16], indirect=True)
def test_the_prefill_suite_times_the_short_sessions_proposals_while_the_long_context_is_read(
    tiny_services, prefill_chunk
):
    from specsplit.bench import prefill

    long_prompt = [(7 * i) % 200 + 3 for i in range(300)]
    figures = run_async(prefill.draft_run(tiny_services.draft_address, [[5, 6, 7], [8, 9, 10]], long_prompt, 0), 120)
    assert figures["long_ttft_s"] > 0 and figures["others_proposals_per_s"] > 0  # they proposed during the read
    assert 0 < figures["others_median_gap_s"] <= figures["others_p95_gap_s"] <= figures["others_max_gap_s"]
    opened = ("short-0-0", "short-0-1", "long-0")
    assert wait_until(lambda: not any(s in tiny_services.draft_engine.sessions for s in opened))  # streams freed
