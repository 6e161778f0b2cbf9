"""The tensor-parallel target: --tp 2 over gloo on loopback equals TP=1 and the model's own generate.

Real processes: the supervisor starts two ranks; rank 0 serves gRPC and leads
every forward step, rank 1 replays it on its shard; each runs the decoder step over its part of the weights.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import start_service
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from specsplit.target_service.tp import check_divisible
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import reference_greedy, run_async

pytestmark = pytest.mark.services

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def tp2_target(tmp_path_factory, tiny_target_dir):
    service = start_service(
        "specsplit.target_service.server", "tp2", ["--model", str(tiny_target_dir), "--tp", "2", "--grace-s", "2"],
        tmp_path_factory.mktemp("tp2"), 300,
    )
    yield service
    assert service.stop(30) == 0, service.log_tail()  # SIGTERM: rank 0 drains, followers exit, all 0


async def run_prompts(target, draft, tokenizer_dir, k, drafter, sampling, draft_probs=False, max_new=20, branches=1,
                      stats=None):
    # Sampled verification gives the same text only from the same blocks: a block late for its round's
    # deadline (the target, TP or not, steps alone) changes them. A pinned deadline keeps every block.
    policy = LinkPolicy(draft_deadline_s=30.0, draft_timeout_s=30.0)
    orch = await Orchestrator.connect(OrchestratorConfig(target, draft, tokenizer=str(tokenizer_dir),
                                                         link_policy=policy))
    outputs = []
    try:
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, 1000 + i)
            request = GenerationRequest("", False, max_new, params, (), k, drafter, draft_probs,
                                        tree_branches=branches)
            ids: list[int] = []
            async for event in orch.generate(request, orch.encode(prompt, False)):
                ids.extend(event.token_ids)
                if event.stats is not None and stats is not None:
                    stats.append(event.stats)
            outputs.append(ids)
        return outputs, orch.target.info
    finally:
        await orch.close()


@pytest.mark.parametrize("drafter, branches", [(DrafterKind.MODEL, 1), (DrafterKind.NGRAM, 1), (DrafterKind.MODEL, 3)],
                         ids=["model", "ngram", "model-trees"])
def test_tp2_greedy_equals_tp1_and_generate(tp2_target, tiny_services, tiny_target_dir, gguf_tokenizer, drafter,
                                            branches):
    """Chains, and token trees (the model's second choices as leaves): every rank runs the tree on its shard and
    moves the accepted path alike."""
    greedy, stats = SamplingParams(), []
    tp2, info = run_async(run_prompts(tp2_target.address, tiny_services.draft_address, tiny_target_dir, 4, drafter,
                                      greedy, branches=branches, stats=stats))
    tp1, _ = run_async(run_prompts(tiny_services.target_address, tiny_services.draft_address, tiny_target_dir, 4,
                                   drafter, greedy, branches=branches))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    expected = [reference_greedy(model, gguf_tokenizer.encode(p), 20) for p in PROMPTS]
    assert info.tp_degree == 2
    # each rank runs the eager decoder step on its shard, one all-reduce per row-parallel projection
    assert info.forward.startswith("the decoder step, eager on this rank's shard") and info.token_trees
    assert tp2 == tp1 == expected
    if branches > 1:
        assert sum(s.tree_rounds for s in stats) > 0  # trees were verified by the sharded target


@pytest.mark.parametrize("draft_probs", [False, True], ids=["token-only", "draft-probs"])
def test_tp2_seeded_sampling_equals_tp1(tp2_target, tiny_services, tiny_target_dir, draft_probs):
    sampling = SamplingParams(temperature=1.0, top_k=40)
    args = (tiny_services.draft_address, tiny_target_dir, 4, DrafterKind.MODEL, sampling, draft_probs)
    tp2, _ = run_async(run_prompts(tp2_target.address, *args))
    tp1, _ = run_async(run_prompts(tiny_services.target_address, *args))
    assert tp2 == tp1
    assert len({tuple(o) for o in tp2}) == len(PROMPTS)  # sampling, not a degenerate repeat


def test_indivisible_head_count_is_refused_with_working_degrees():
    class Config:
        num_attention_heads = 9
        num_key_value_heads = 3

    with pytest.raises(ValueError, match=r"use --tp in \[1, 3\]"):
        check_divisible(Config(), 2, "smollm2-135m")
    check_divisible(Config(), 3, "smollm2-135m")


def child_with_rank(parent_pid: int, rank: int) -> int:
    children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children").read_text().split()
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} among {children}")


async def health(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


def test_killing_a_rank_takes_the_target_down_and_the_client_sees_unavailable(
    tmp_path, tiny_target_dir, tiny_services, background_loop
):
    from specsplit.orchestrator.api.server import start_server

    target = start_service(
        "specsplit.target_service.server", "tp2-kill",
        ["--model", str(tiny_target_dir), "--tp", "2", "--grace-s", "1", "--tp-timeout-s", "20"], tmp_path, 300,
    )
    try:
        config = OrchestratorConfig(target.address, tiny_services.draft_address, str(tiny_target_dir),
                                    link_policy=LinkPolicy(target_deadline_s=5.0))
        orch = background_loop.run(Orchestrator.connect(config))
        server, port = background_loop.run(start_server(orch))
        assert run_async(health(target.address)) == "SERVING"

        async def generate_until_failure():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.GeneratorStub(channel).Generate(
                    pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=4000, k=2), timeout=120
                )
                await call.read()  # generation is under way
                os.kill(child_with_rank(target.process.pid, 1), signal.SIGKILL)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                return info.value, time.monotonic() - started

        error, waited = run_async(generate_until_failure())
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert waited < 60
        assert run_async(health(target.address)) in ("NOT_SERVING", "UNAVAILABLE")
        assert target.process.wait(60) != 0  # the whole target exits, non-zero
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())
    finally:
        target.stop(5)
