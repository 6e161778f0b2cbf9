"""Adding a drafter is one module plus one registry entry: a drafter defined in the tests alone is served,
listed in ``Info``, and selectable end to end through the public API."""

from __future__ import annotations

import sys

import grpc
import pytest

from specsplit.client import AsyncClient
from specsplit.lmkit.processes import start_service
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import TINY_PROMPTS, run_async

pytestmark = pytest.mark.services

REPEAT = 90  # tests/services/plugin_drafter.py's kind; this process never imports that module


@pytest.fixture(scope="module")
def plugin_stack(tmp_path_factory, tiny_target_dir, background_loop):
    """The plugin drafter's service (a process), the tiny target and an orchestrator (in-process) over them."""
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import Orchestrator
    from specsplit.orchestrator.api.server import start_server
    from specsplit.target_service.server import start_server as start_target
    from tests.conftest import make_engines

    assert "tests.services.plugin_drafter" not in sys.modules
    draft = start_service("tests.services.plugin_drafter", "plugin-draft", [], tmp_path_factory.mktemp("plugin"), 300)
    target_engine, _ = make_engines(str(tiny_target_dir), None)
    target_server, target_port = background_loop.run(start_target(target_engine))
    config = OrchestratorConfig(f"127.0.0.1:{target_port}", draft.address, str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch))
    try:
        yield draft.address, f"127.0.0.1:{port}"
    finally:
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())
        background_loop.run(target_server.stop(0))
        assert draft.stop() == 0, draft.log_tail()


async def _info(address: str) -> pb.ModelInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.DraftServiceStub(channel).Info(pb.InfoRequest(), timeout=30)


def test_the_plugin_drafter_is_listed_in_info_with_its_name_and_traits(plugin_stack):
    info = run_async(_info(plugin_stack[0]))
    assert REPEAT in info.drafters and pb.DRAFTER_KIND_NGRAM in info.drafters
    named = {d.name: d for d in info.drafter_info}
    assert named["REPEAT"].kind == REPEAT and not named["REPEAT"].has_probs
    assert named["NGRAM"].kind == pb.DRAFTER_KIND_NGRAM


def test_the_plugin_drafter_drafts_and_greedy_output_is_the_targets(plugin_stack, tiny_reference):
    prompts_ids, expected = tiny_reference

    async def generate_all():
        async with AsyncClient(plugin_stack[1]) as client:
            return [
                await client.complete(prompt, chat=False, max_new_tokens=24, k=4, drafter=REPEAT,
                                      return_token_ids=True, adaptive_k=False)
                for prompt in TINY_PROMPTS
            ]

    done = run_async(generate_all())
    for completion, want in zip(done, expected):
        assert completion.token_ids == want
        assert completion.stats.drafter == REPEAT
        assert completion.stats.drafted_tokens > 0  # the plugin really drafted: it always proposes k tokens
    assert sum(c.stats.accepted_tokens for c in done) > 0  # "a b a b ..." repeats, so some blocks pass


def test_a_drafter_no_service_serves_is_refused_naming_the_served_ones(plugin_stack):
    async def ask():
        async with AsyncClient(plugin_stack[1]) as client:
            return await client.complete("hi", max_new_tokens=4, drafter=91)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run_async(ask())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "91" in caught.value.details() and "REPEAT" in caught.value.details()
