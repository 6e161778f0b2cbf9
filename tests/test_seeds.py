"""Seeds through the whole system: what a seed promises, kept under faults, K, overlap and batching.

Every draw is keyed by (seed, stream, absolute position, index) (``lmkit.draws``),
so a lost target session re-opened from the committed tokens decides each
position with the same draws it would have used had nothing happened: the
output of a seed does not depend on how often the target loses its sessions.
"""

from __future__ import annotations

import pytest

from lmkit import errors
from lmkit.kinds import DrafterKind
from lmkit.sampling import SamplingParams
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import GenerationRequest, Orchestrator
from orchestrator.links import LinkPolicy
from target_service.engine import TargetEngine
from tests.conftest import Services, run_async

pytestmark = pytest.mark.services

PROMPT = [504, 2365, 6354]  # a few SmolLM2 token ids
NEW = 16


class OneRoundTarget(TargetEngine):
    """Loses every session after its first verification: the next block finds it gone (NOT_FOUND)."""

    def verify_batch(self, items):
        lost = [item.session.rounds > 0 for item in items]
        done = iter(super().verify_batch([item for item, gone in zip(items, lost) if not gone]))
        return [errors.NotFound("session lost (test: one round per session)") if gone else next(done) for gone in lost]


@pytest.fixture(scope="module")
def forgetful_target(background_loop, tiny_services):
    """A second target server over the same model whose sessions last one round each."""
    plain = tiny_services.target_engine
    engine = OneRoundTarget(plain.model, model_id=plain.model_id, vocab_fingerprint=plain.vocab_fingerprint,
                            limits=plain.limits)
    services = Services(background_loop, engine, tiny_services.draft_engine)
    yield services
    services.stop()


async def collect(orch: Orchestrator, request: GenerationRequest) -> tuple[list[int], object]:
    ids, stats = [], None
    async for event in orch.generate(request, PROMPT):
        ids.extend(event.token_ids)
        stats = event.stats or stats
    return ids, stats


async def generate_on_each(services_list, tokenizer_dir, requests) -> list[list[tuple[list[int], object]]]:
    """Every request through an orchestrator on each of ``services_list``: results[service][request]."""
    results = []
    for services in services_list:
        config = OrchestratorConfig(services.target_address, services.draft_address, str(tokenizer_dir),
                                    link_policy=LinkPolicy(target_retry_s=0.01))
        orch = await Orchestrator.connect(config)
        try:
            results.append([await collect(orch, request) for request in requests])
        finally:
            await orch.close()
    return results


@pytest.mark.parametrize(
    "k, drafter, draft_probs",
    [(0, DrafterKind.NGRAM, False), (4, DrafterKind.MODEL, False), (4, DrafterKind.MODEL, True)],
    ids=["target-only", "token-only", "draft-probs"],
)
def test_a_target_losing_every_session_gives_the_same_tokens_for_a_seed(
    tiny_services, forgetful_target, tiny_target_dir, k, drafter, draft_probs
):
    requests = [
        GenerationRequest("", False, NEW, SamplingParams(temperature=1.0, top_k=50, seed=seed), (), k, drafter,
                          draft_probs)
        for seed in (1, 2, 3)
    ]
    steady, lost = run_async(generate_on_each([tiny_services, forgetful_target], tiny_target_dir, requests))
    assert all(stats.target_reopens >= 2 for _, stats in lost)  # the sessions really were lost
    assert [ids for ids, _ in lost] == [ids for ids, _ in steady]
