"""Many sessions on one stream (``Sessions``): each as on its own stream, answers of a batch together, errors kept
to their session, every session freed with the stream, idle ones evicted; and the orchestrator over it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.target_service.servicer import TargetServicer
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async
from tests.services.test_sessions import wait_for_zero

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call

GREEDY = pb.VERIFICATION_MODE_GREEDY
PROMPTS = {"a": [1, 2, 3, 4], "b": [7, 8, 9], "c": [5, 5, 5, 5, 5]}


def target_open(tokens) -> pb.TargetOpen:
    return pb.TargetOpen(tokens=tokens, sampling=pb.SamplingParams(), mode=GREEDY)


async def own_stream_tokens(stub, tokens: list[int], steps: int) -> list[int]:
    """Greedy decoding on a session's own stream: the reference."""
    call = stub.Session(metadata=VERSION)
    await call.write(pb.TargetRequest(open=pb.TargetOpen(session_id="own", tokens=tokens, mode=GREEDY)))
    await call.read()
    out = list(tokens)
    for _ in range(steps):
        await call.write(pb.TargetRequest(verify=pb.VerifyRequest(position=len(out))))
        out.append((await call.read()).result.next_token)
    await call.done_writing()
    await call.read()
    return out[len(tokens):]


def test_sessions_on_one_stream_decode_as_on_their_own_and_a_step_answers_in_one_message(tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            stub = pb_grpc.TargetServiceStub(channel)
            expected = {sid: await own_stream_tokens(stub, tokens, 6) for sid, tokens in PROMPTS.items()}
            call = stub.Sessions(metadata=VERSION)
            await call.write(pb.TargetCalls(calls=[pb.TargetCall(session_id=sid, open=target_open(tokens))
                                                   for sid, tokens in PROMPTS.items()]))
            opened = []
            while len(opened) < len(PROMPTS):
                opened += (await call.read()).replies
            during = (await stub.Stats(pb.StatsRequest())).active_sessions
            committed = {sid: list(tokens) for sid, tokens in PROMPTS.items()}
            sizes = []
            for _ in range(6):  # every session's verify in one message: answered together
                await call.write(pb.TargetCalls(calls=[
                    pb.TargetCall(session_id=sid, verify=pb.VerifyRequest(position=len(tokens)))
                    for sid, tokens in committed.items()]))
                got = []
                while len(got) < len(committed):
                    got += (await call.read()).replies
                sizes.append(len(got))
                for reply in got:
                    committed[reply.session_id].append(reply.result.next_token)
            await call.write(pb.TargetCalls(calls=[pb.TargetCall(session_id="a", close=pb.CloseSession())]))
            closed = (await call.read()).replies
            after_close = (await stub.Stats(pb.StatsRequest())).active_sessions
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            return expected, committed, opened, during, closed, after_close

    expected, committed, opened, during, closed, after_close = run_async(go())
    assert {r.session_id: r.WhichOneof("kind") for r in opened} == dict.fromkeys(PROMPTS, "opened")
    assert during == 3
    assert {sid: tokens[len(PROMPTS[sid]):] for sid, tokens in committed.items()} == expected
    assert [(r.session_id, r.WhichOneof("kind")) for r in closed] == [("a", "closed")]
    assert after_close == 2
    assert wait_for_zero(tiny_services) == (0, 0)  # the stream's end freed the other two


def test_a_calls_error_closes_its_session_alone(tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            call = pb_grpc.TargetServiceStub(channel).Sessions(metadata=VERSION)
            await call.write(pb.TargetCalls(calls=[pb.TargetCall(session_id=sid, open=target_open(PROMPTS[sid]))
                                                   for sid in ("a", "b")]))
            opened = []
            while len(opened) < 2:  # answers that are ready together come in one message
                opened += (await call.read()).replies
            await call.write(pb.TargetCalls(calls=[
                pb.TargetCall(session_id="a", verify=pb.VerifyRequest(position=99)),  # a stale position
                pb.TargetCall(session_id="b", verify=pb.VerifyRequest(position=3)),
                pb.TargetCall(session_id="a", verify=pb.VerifyRequest(position=4)),  # behind the failing one
            ]))
            replies = []
            async with asyncio.timeout(10):  # every call is answered
                while len(replies) < 3:
                    replies += (await call.read()).replies
            behind = [r for r in replies if r.session_id == "a"][1]
            replies = [r for r in replies if r is not behind]
            await call.write(pb.TargetCalls(calls=[
                pb.TargetCall(session_id="a", verify=pb.VerifyRequest(position=4)),
                pb.TargetCall(session_id="z", verify=pb.VerifyRequest(position=1)),
                pb.TargetCall(session_id="b", open=target_open([1])),
            ]))
            later = []
            while len(later) < 3:
                later += (await call.read()).replies
            call.cancel()
            return {r.session_id: r for r in replies}, later, behind

    replies, later, behind = run_async(go())
    assert behind.error.code == grpc.StatusCode.NOT_FOUND.value[0] and "closed before" in behind.error.message
    assert replies["a"].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "position" in replies["a"].error.message
    assert replies["b"].WhichOneof("kind") == "result"
    errors = {r.session_id: r.error for r in later}
    assert errors["a"].code == grpc.StatusCode.NOT_FOUND.value[0]  # closed by its error: open it again
    assert errors["z"].code == grpc.StatusCode.NOT_FOUND.value[0] and "not open" in errors["z"].message
    assert errors["b"].code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert wait_for_zero(tiny_services) == (0, 0)  # a cancelled stream frees its sessions


def test_an_idle_session_of_the_stream_is_evicted(tiny_services):
    async def go():
        async with grpc.aio.insecure_channel(tiny_services.target_address) as channel:
            call = pb_grpc.TargetServiceStub(channel).Sessions(metadata=VERSION)
            await call.write(pb.TargetCalls(calls=[pb.TargetCall(session_id="idle", open=target_open([1, 2]))]))
            await call.read()
            await asyncio.sleep(1.2)
            await call.write(pb.TargetCalls(calls=[pb.TargetCall(session_id="idle",
                                                                 verify=pb.VerifyRequest(position=2))]))
            reply = (await call.read()).replies[0]
            call.cancel()
            return reply

    TargetServicer.session_ttl_s = 0.5
    try:
        reply = run_async(go())
    finally:
        TargetServicer.session_ttl_s = 300.0
    assert reply.error.code == grpc.StatusCode.NOT_FOUND.value[0] and "evicted" in reply.error.message


def test_draft_sessions_on_one_stream_propose_as_on_their_own(tiny_services):
    tokens = [5, 6, 7, 8, 5, 6, 7]

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.draft_address) as channel:
            stub = pb_grpc.DraftServiceStub(channel)
            own = stub.Session(metadata=VERSION)
            await own.write(pb.DraftRequest(open=pb.DraftOpen(session_id="own", tokens=tokens,
                                                              drafter=pb.DRAFTER_KIND_NGRAM)))
            await own.read()
            await own.write(pb.DraftRequest(propose=pb.ProposeRequest(position=len(tokens), k=3)))
            expected = (await own.read()).block
            own.cancel()
            shared = stub.Sessions(metadata=VERSION)
            await shared.write(pb.DraftCalls(calls=[
                pb.DraftCall(session_id="m", open=pb.DraftOpen(tokens=tokens, drafter=pb.DRAFTER_KIND_NGRAM)),
                pb.DraftCall(session_id="m", propose=pb.ProposeRequest(position=len(tokens), k=3)),
            ]))
            replies = []
            while len(replies) < 2:
                replies += (await shared.read()).replies
            shared.cancel()
            return expected, replies

    expected, replies = run_async(go())
    assert [r.WhichOneof("kind") for r in replies] == ["opened", "block"]  # a session's calls in order
    assert list(replies[1].block.tokens) == list(expected.tokens) == [8, 5, 6]
    assert wait_for_zero(tiny_services) == (0, 0)


def test_the_orchestrator_gives_the_same_tokens_over_one_stream_as_over_a_stream_each(tiny_services,
                                                                                       tiny_target_dir):
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6], [4, 4, 4, 4, 4, 4]]

    async def generate(shared_from: int):
        config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir),
                                    shared_stream_from=shared_from)
        orch = await Orchestrator.connect(config)
        try:
            async def one(ids, drafter):
                request = GenerationRequest("", False, 16, SamplingParams(), (), 4, drafter, False, True,
                                            overlap=True)
                return [t async for e in orch.generate(request, ids) for t in e.token_ids]

            return await asyncio.gather(*(one(ids, kind) for ids in prompts
                                          for kind in (DrafterKind.NGRAM, DrafterKind.MODEL)))
        finally:
            await orch.close()

    # always shared; never; and from the third session on (a mix of both at once)
    assert run_async(generate(1)) == run_async(generate(0)) == run_async(generate(3))
    assert wait_for_zero(tiny_services) == (0, 0)


def test_a_model_free_drafters_calls_are_answered_as_read_in_order_each_one(tiny_services):
    """n-gram proposals need no waiting: the draft answers them as it reads them, a session's in order, and a
    call behind one that failed is answered too (its session is gone), never left without an answer."""
    tokens = [5, 6, 7, 8, 5, 6, 7]

    async def go():
        async with grpc.aio.insecure_channel(tiny_services.draft_address) as channel:
            shared = pb_grpc.DraftServiceStub(channel).Sessions(metadata=VERSION)
            await shared.write(pb.DraftCalls(calls=[
                pb.DraftCall(session_id=sid, open=pb.DraftOpen(tokens=tokens, drafter=pb.DRAFTER_KIND_NGRAM))
                for sid in ("m", "n")]))
            opened = []
            while len(opened) < 2:
                opened += (await shared.read()).replies
            await shared.write(pb.DraftCalls(calls=[
                pb.DraftCall(session_id="m", propose=pb.ProposeRequest(position=len(tokens), k=3)),
                pb.DraftCall(session_id="m", propose=pb.ProposeRequest(position=len(tokens), tokens=[8], k=2)),
                pb.DraftCall(session_id="n", propose=pb.ProposeRequest(position=99, k=3)),  # a stale position
                pb.DraftCall(session_id="n", propose=pb.ProposeRequest(position=len(tokens), k=3)),
                pb.DraftCall(session_id="m", propose=pb.ProposeRequest(position=len(tokens) + 1, tokens=[5], k=1)),
            ]))
            replies = []
            async with asyncio.timeout(10):
                while len(replies) < 5:
                    replies += (await shared.read()).replies
            shared.cancel()
            return replies

    replies = run_async(go())
    m = [r for r in replies if r.session_id == "m"]
    assert [list(r.block.tokens) for r in m] == [[8, 5, 6], [5, 6], [6]]  # each from the context the one before left
    n = [r for r in replies if r.session_id == "n"]
    assert [r.WhichOneof("kind") for r in n] == ["error", "error"]
    assert "position" in n[0].error.message
    assert n[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]  # closed by its error: open it again
    assert wait_for_zero(tiny_services) == (0, 0)
