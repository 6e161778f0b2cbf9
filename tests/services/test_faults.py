"""Faults survived with real processes: a killed draft, a restarted target, a target that stays down.

Services hold caches, never truth: whatever dies, the output is still exactly
the target's own greedy output, and nothing is lost, duplicated or retracted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from specsplit.bench.chaos.stack import Restartable
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import start_service
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from tests.conftest import reference_greedy, run_async

pytestmark = pytest.mark.services

PROMPT = "Once upon a time"
NEW_TOKENS = 300


@pytest.fixture(scope="module")
def expected(tiny_target_dir, gguf_tokenizer):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return reference_greedy(model, gguf_tokenizer.encode(PROMPT), NEW_TOKENS)


async def generate_with_fault(target_address, draft_address, tokenizer_dir, fault, policy=None,
                              drafter=DrafterKind.MODEL, reconnected: bool = False):
    """Generate greedily; call ``fault()`` (in a thread) after the 3rd round, and with ``reconnected`` wait until
    the orchestrator's draft channel is connected again; return ids, stats."""
    config = OrchestratorConfig(
        target_address, draft_address, tokenizer=str(tokenizer_dir), link_policy=policy or LinkPolicy()
    )
    orch = await Orchestrator.connect(config)
    request = GenerationRequest("", False, NEW_TOKENS, SamplingParams(), (), 4, drafter, False,
                                tree_branches=1 if drafter is DrafterKind.MODEL else 2)
    ids, texts, stats = [], [], None
    try:
        async for event in orch.generate(request, orch.encode(PROMPT, False)):
            ids.extend(event.token_ids)
            texts.append(event.text)
            if len(texts) == 3:
                await asyncio.to_thread(fault)
                if reconnected:
                    await draft_channel_ready(orch)
            stats = event.stats or stats
    finally:
        await orch.close()
    return ids, stats


async def draft_channel_ready(orch, timeout_s: float = 60.0) -> None:
    """Until the draft's channel is connected: gRPC reconnects after a backoff (up to 2 s here) that grew while
    the draft was down, and a tiny model's remaining rounds can all run within it (the draft, back, never
    asked). Once the channel is up, the link must re-attach within its ``draft_retry_s``."""
    channel = orch.draft.replicas[0].channel
    async with asyncio.timeout(timeout_s):
        while (state := channel.get_state(try_to_connect=True)) is not grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)


def test_killed_draft_falls_back_to_target_only(tmp_path, tiny_target_dir, tiny_draft_dir, tiny_services, expected):
    draft = start_service("specsplit.draft_service.server", "draft", ["--model", str(tiny_draft_dir)], tmp_path, 300)
    try:
        ids, stats = run_async(generate_with_fault(
            tiny_services.target_address, draft.address, tiny_target_dir,
            lambda: os.kill(draft.process.pid, signal.SIGKILL),
        ))
    finally:
        draft.stop()
    assert ids == expected
    assert stats.draft_fallback_rounds > 0 and stats.drafted_tokens > 0


def started(module: str, name: str, args: list[str], workdir) -> Restartable:
    """A service on a fixed port that a test can SIGKILL and start again in its place."""
    service = Restartable(module, name, args, workdir)
    service.start()
    return service


@pytest.fixture(scope="module")
def medusa_folder(tiny_target_dir, tmp_path_factory):
    """Random heads for the tiny target (what MEDUSA drafts from needs no training to be verified)."""
    import torch

    from specsplit.draft_service import medusa

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    torch.manual_seed(3)
    heads = medusa.new_heads(model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    return medusa.save_heads(heads, tmp_path_factory.mktemp("medusa"))


# A draft model's own session (MODEL), the target's successors recycled (RECYCLING: no model), the target's
# hidden features (MEDUSA: heads over a copy of the target): each is rebuilt after the target restarts (a new
# target session re-prefills and sends successors and features again).
DRAFTERS = [DrafterKind.MODEL, DrafterKind.RECYCLING, DrafterKind.MEDUSA]


def draft_args(drafter, tiny_target_dir, tiny_draft_dir, medusa_folder) -> list[str]:
    if drafter is DrafterKind.RECYCLING:
        return []
    if drafter is DrafterKind.MEDUSA:
        return ["--model", str(tiny_target_dir), "--medusa-head", str(medusa_folder)]
    return ["--model", str(tiny_draft_dir)]


def test_draft_is_reattached_when_it_comes_back(tmp_path, tiny_target_dir, tiny_draft_dir, tiny_services, expected):
    draft = started("specsplit.draft_service.server", "draft", ["--model", str(tiny_draft_dir)], tmp_path)
    try:
        policy = LinkPolicy(draft_retry_s=0.05)
        ids, stats = run_async(generate_with_fault(
            tiny_services.target_address, draft.address, tiny_target_dir, draft.kill_and_restart, policy,
            reconnected=True))
    finally:
        draft.stop()
    assert ids == expected
    assert stats.draft_reattached >= 1, stats


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: d.name.lower())
def test_target_restarted_mid_generation_is_reopened(
    tmp_path, tiny_target_dir, tiny_draft_dir, expected, medusa_folder, drafter
):
    target = started("specsplit.target_service.server", "target", ["--model", str(tiny_target_dir)], tmp_path)
    args = draft_args(drafter, tiny_target_dir, tiny_draft_dir, medusa_folder)
    draft = start_service("specsplit.draft_service.server", "draft", args, tmp_path, 300)
    try:
        ids, stats = run_async(generate_with_fault(
            target.address, draft.address, tiny_target_dir, target.kill_and_restart, drafter=drafter))
    finally:
        target.stop()
        draft.stop()
    assert ids == expected
    assert stats.target_reopens >= 1 and stats.drafted_tokens > 0, stats


def test_target_down_past_its_deadline_is_unavailable_not_a_hang(tmp_path, tiny_target_dir, tiny_services):
    target = start_service("specsplit.target_service.server", "target", ["--model", str(tiny_target_dir)], tmp_path, 300)
    policy = LinkPolicy(target_deadline_s=2.0)
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        run_async(generate_with_fault(
            target.address, tiny_services.draft_address, tiny_target_dir,
            lambda: os.kill(target.process.pid, signal.SIGKILL), policy))
    assert getattr(info.value, "code", None) == grpc.StatusCode.UNAVAILABLE, info.value
    assert "stayed unavailable" in str(info.value)
    assert time.monotonic() - started < 60


def test_sigterm_drains_in_flight_generations_and_refuses_new_ones(tmp_path, tiny_target_dir, tiny_services):
    import grpc

    from specsplit.v1 import specsplit_pb2 as pb
    from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

    orch = start_service(
        "specsplit.orchestrator.api.server", "orchestrator",
        ["--target", tiny_services.target_address, "--draft", "", "--tokenizer", str(tiny_target_dir),
         "--grace-s", "20"], tmp_path, 300,
    )

    async def go():
        async with grpc.aio.insecure_channel(orch.address) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="drain me", max_new_tokens=300, k=0))
            await call.read()
            orch.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            replies = []
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
            async with grpc.aio.insecure_channel(orch.address) as fresh:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await pb_grpc.GeneratorStub(fresh).Generate(pb.GenerateRequest(prompt="late"), timeout=5).read()
            return replies, refused.value

    try:
        replies, refused = run_async(go())
        assert replies[-1].HasField("stats") and replies[-1].stats.new_tokens == 300  # finished, not cut
        assert refused.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert orch.process.wait(30) == 0
    finally:
        orch.stop()
