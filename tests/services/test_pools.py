"""Pools: `--target a,b` and `--draft c,d`, each session on the least loaded replica, moved when its replica dies.

Real service processes on loopback, two target replicas and two draft replicas of the tiny models. Sessions
spread over both of each; a replica killed mid-generation (SIGKILL) loses nothing: the sessions it held are
re-opened on the other from the committed tokens, and every output is still the target's own greedy text.
Two orchestrators share the pools, each balancing its own sessions. Replicas of different models are
refused at connect, naming both. The kill tests run last in the module.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import pytest

from specsplit.bench.pools import opened as sessions_opened
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.kvcache import kv_bytes_per_token
from specsplit.lmkit.processes import start_service
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from specsplit.orchestrator.decode.peers import draft_client, target_client
from tests.conftest import TINY_PROMPTS, reference_greedy, run_async

pytestmark = pytest.mark.services

LONG_TOKENS = 160


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_target_dir, tiny_draft_dir):
    """{"targets": [2], "drafts": [2]} service processes of the tiny models."""
    work = tmp_path_factory.mktemp("pools")
    started = {"targets": [], "drafts": []}
    try:
        for i in range(2):
            started["targets"].append(start_service("specsplit.target_service.server", f"target-{i}",
                                                    ["--model", str(tiny_target_dir)], work))
            started["drafts"].append(start_service("specsplit.draft_service.server", f"draft-{i}",
                                                   ["--model", str(tiny_draft_dir)], work))
        yield started
    finally:
        for service in (*started["targets"], *started["drafts"]):
            service.stop(5)


def addresses(services) -> str:
    return ",".join(service.address for service in services)


@pytest.fixture(scope="module")
def long_reference(tiny_target_dir, gguf_tokenizer):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    prompts = [gguf_tokenizer.encode(p) for p in TINY_PROMPTS[:4]]
    return prompts, [reference_greedy(model, ids, LONG_TOKENS) for ids in prompts]


def request(tokens: int) -> GenerationRequest:
    return GenerationRequest("", False, tokens, SamplingParams(), (), 4, DrafterKind.MODEL, False)


async def generate(orch: Orchestrator, prompt: list[int], tokens: int, started: asyncio.Event | None = None):
    """(ids, the last event's stats)."""
    ids, last = [], None
    async for event in orch.generate(request(tokens), prompt):
        ids += event.token_ids
        last = event
        if started is not None and len(ids) >= 16:
            started.set()
    return ids, last.stats


async def opened(replicas) -> list[int]:
    """Sessions each target, then each draft, has opened since it started."""
    return [*await sessions_opened([t.address for t in replicas["targets"]], target_client),
            *await sessions_opened([d.address for d in replicas["drafts"]], draft_client)]


def connect(replicas, folder: Path) -> Orchestrator:
    """An orchestrator over both pools; a lost draft re-attached within 0.02 s: the generations here are short
    (160 tokens of a tiny model: what is left of one after a kill can take well under a second)."""
    config = OrchestratorConfig(addresses(replicas["targets"]), addresses(replicas["drafts"]), str(folder),
                                link_policy=LinkPolicy(draft_retry_s=0.02))
    return Orchestrator.connect(config)


def test_sessions_spread_over_the_replicas_and_keep_the_targets_greedy_output(replicas, tiny_target_dir,
                                                                               tiny_reference):
    prompts, expected = tiny_reference

    async def go():
        before = await opened(replicas)
        orch = await connect(replicas, tiny_target_dir)
        try:
            done = await asyncio.gather(*(generate(orch, prompts[i], 24) for i in range(4)))
        finally:
            await orch.close()
        after = await opened(replicas)
        return done, [b - a for a, b in zip(before, after)]

    done, new_sessions = run_async(go())
    assert [ids for ids, _ in done] == expected[:4]
    assert new_sessions == [2, 2, 2, 2], new_sessions  # four sessions: two on each target, two on each draft
    assert all(stats.drafted_tokens > 0 for _, stats in done)


def test_two_orchestrators_share_one_pool_each_balancing_its_own_sessions(replicas, tiny_target_dir, tiny_reference):
    prompts, expected = tiny_reference

    async def go():
        before = await opened(replicas)
        orchs = [await connect(replicas, tiny_target_dir) for _ in range(2)]
        try:
            done = await asyncio.gather(*(generate(orchs[i % 2], prompts[i], 24) for i in range(4)))
        finally:
            for orch in orchs:
                await orch.close()
        after = await opened(replicas)
        return done, [b - a for a, b in zip(before, after)]

    done, new_sessions = run_async(go())
    assert [ids for ids, _ in done] == expected[:4]
    assert new_sessions == [2, 2, 2, 2], new_sessions  # each orchestrator put one of its two on each replica


def test_replicas_of_different_models_are_refused_at_connect_naming_both(replicas, tiny_draft_dir, tiny_target_dir,
                                                                        tmp_path):
    other = start_service("specsplit.draft_service.server", "draft-other", ["--model", str(tiny_target_dir)], tmp_path)
    try:
        config = OrchestratorConfig(replicas["targets"][0].address,
                                    f"{replicas['drafts'][0].address},{other.address}", str(tiny_target_dir))
        with pytest.raises(ValueError, match=rf"draft replicas at {replicas['drafts'][0].address} and "
                                             rf"{other.address} differ in model_id"):
            run_async(Orchestrator.connect(config))
    finally:
        other.stop(5)


def test_placement_counts_the_sessions_other_orchestrators_hold_on_a_replica(replicas, tiny_target_dir,
                                                                            long_reference):
    """One orchestrator holds two sessions on the first target replica; another, over both replicas, reads their
    Stats and opens both of its sessions on the second (counting only its own, it would put one on each)."""
    prompts, expected = long_reference
    first, second = replicas["targets"]

    async def go():
        holder = await Orchestrator.connect(OrchestratorConfig(first.address, "", str(tiny_target_dir)))
        orch = await Orchestrator.connect(OrchestratorConfig(f"{first.address},{second.address}", "",
                                                             str(tiny_target_dir), load_every_s=0.1))
        held = [holder.generate(request(24), prompt) for prompt in prompts[2:4]]
        try:
            for generation in held:
                await generation.__anext__()  # open on the first replica, unread
            reported = orch.target.replicas[0]
            async with asyncio.timeout(30):
                while reported.reported is None or reported.reported.active_sessions < 2:
                    await asyncio.sleep(0.05)
            before = await sessions_opened([first.address, second.address], target_client)
            done = await asyncio.gather(*(generate(orch, prompt, 24) for prompt in prompts[:2]))
            after = await sessions_opened([first.address, second.address], target_client)
            return [ids for ids, _ in done], [b - a for a, b in zip(before, after)]
        finally:
            for generation in held:
                await generation.aclose()
            await orch.close()
            await holder.close()

    ids, spread = run_async(go())
    assert ids == [e[:24] for e in expected[:2]]
    assert spread == [0, 2], spread


def test_a_full_replica_passes_a_new_session_to_one_with_room(replicas, tiny_target_dir, long_reference, tmp_path,
                                                              caplog):
    """A target replica whose KV budget another orchestrator's session holds refuses the next session for room
    (RESOURCE_EXHAUSTED); the pool opens it on the other replica instead of failing the generation."""
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    budget = kv_bytes_per_token(model) * 250  # one session of LONG_TOKENS (about 200 positions reserved) fits
    full = start_service("specsplit.target_service.server", "full", ["--model", str(tiny_target_dir),
                                                                     "--kv-budget-bytes", str(budget)], tmp_path)
    other = replicas["targets"][1]
    prompts, expected = long_reference

    async def go():
        holder = await Orchestrator.connect(OrchestratorConfig(full.address, "", str(tiny_target_dir)))
        # placed by its own sessions only (no Stats read between two placements), it tries `full` first
        orch = await Orchestrator.connect(OrchestratorConfig(f"{full.address},{other.address}", "",
                                                             str(tiny_target_dir), load_every_s=0))
        try:
            held = holder.generate(request(LONG_TOKENS), prompts[0])
            first = await held.__anext__()  # its session is open on `full`, its reservation held while unread
            before = await sessions_opened([full.address, other.address], target_client)
            moved, _ = await generate(orch, prompts[1], LONG_TOKENS)
            after = await sessions_opened([full.address, other.address], target_client)
            rest = [event async for event in held]
            return first.token_ids + [t for e in rest for t in e.token_ids], moved, [b - a for a, b in zip(before, after)]
        finally:
            await orch.close()
            await holder.close()

    try:
        with caplog.at_level(logging.INFO, logger="specsplit.orchestrator.decode.links"):
            held_ids, moved_ids, opened_by_orch = run_async(go())
    finally:
        full.stop(5)
    assert held_ids == expected[0] and moved_ids == expected[1]
    assert opened_by_orch == [0, 1]  # refused for room on `full`, opened on the other
    assert f"the target replica at {full.address} has no room" in caplog.text


@pytest.mark.parametrize("role", ["drafts", "targets"])
def test_a_draining_replica_takes_no_new_session_and_loses_nothing(replicas, role, tiny_target_dir, tiny_draft_dir,
                                                                     long_reference, tmp_path):
    """SIGTERM to a replica with a long grace period: sessions opened while it drains, on the shared streams
    too, are refused there and placed on the other replica at once; every output is the target's own."""
    model = tiny_target_dir if role == "targets" else tiny_draft_dir
    module = "specsplit.target_service.server" if role == "targets" else "specsplit.draft_service.server"
    draining = start_service(module, "draining", ["--model", str(model), "--grace-s", "60"], tmp_path)
    pools = {"targets": addresses(replicas["targets"][1:]), "drafts": addresses(replicas["drafts"][1:])}
    pools[role] = f"{draining.address},{pools[role]}"
    prompts, expected = long_reference
    survivor = replicas[role][1].address
    client = target_client if role == "targets" else draft_client

    async def go():
        config = OrchestratorConfig(pools["targets"], pools["drafts"], str(tiny_target_dir), shared_stream_from=1,
                                    link_policy=LinkPolicy(draft_retry_s=0.1))
        orch = await Orchestrator.connect(config)
        try:
            first = await asyncio.gather(*(generate(orch, prompts[i], 24) for i in range(2)))  # one on each
            draining.process.send_signal(signal.SIGTERM)
            while "draining for up to" not in draining.log_path.read_text():
                await asyncio.sleep(0.05)
            before = await sessions_opened([survivor], client)
            later = await asyncio.wait_for(asyncio.gather(*(generate(orch, p, LONG_TOKENS) for p in prompts[:3])), 50)
            return first, later, (await sessions_opened([survivor], client))[0] - before[0]
        finally:
            await orch.close()

    try:
        first, later, opened_there = run_async(go())
        assert [ids for ids, _ in first] == [e[:24] for e in expected[:2]]
        assert [ids for ids, _ in later] == expected[:3]
        assert "refused a new session: draining" in draining.log_path.read_text()
        assert opened_there == 3  # every later session, the ones first placed on the draining replica too
        assert all(s.drafted_tokens > 0 for _, s in later)
    finally:
        draining.stop(5)


@pytest.mark.parametrize("role", ["drafts", "targets"])
def test_a_replica_killed_mid_generation_loses_nothing(replicas, role, tiny_target_dir, long_reference):
    """Two long generations, one on each replica; one replica is SIGKILLed once both stream. A target's sessions
    re-open on the other target; a draft's re-attach to the other draft."""
    prompts, expected = long_reference

    async def go():
        orch = await connect(replicas, tiny_target_dir)
        try:
            started = [asyncio.Event(), asyncio.Event()]
            runs = [asyncio.ensure_future(generate(orch, prompts[i], LONG_TOKENS, started[i])) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
            replicas[role][0].process.send_signal(signal.SIGKILL)
            return await asyncio.gather(*runs)
        finally:
            await orch.close()

    try:
        done = run_async(go())
    finally:
        replicas[role][0].process.wait(10)
    assert [ids for ids, _ in done] == expected[:2]
    stats = [s for _, s in done]
    if role == "targets":
        assert sum(s.target_reopens for s in stats) >= 1, stats
    else:  # re-attached: to the survivor, the killed one being gone
        assert sum(s.draft_reattached for s in stats) >= 1, stats
    assert all(s.drafted_tokens > 0 for s in stats)  # the killed replica's sessions drafted on the survivor
