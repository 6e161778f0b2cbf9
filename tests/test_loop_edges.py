"""The edges of a generation: where it stops, what it leaves running, what it learns.

* When a generation ends (here by a stop string, which only the orchestrator's
  text side sees), the proposal drafted ahead is stopped before the last event
  goes out, not when the abandoned generator is garbage-collected.
* A forward that re-read the context (a target session re-opened after a loss)
  is not a decode forward: the cost fit that chooses k never sees it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from draft_service.engine import DraftEngine
from lmkit.kinds import DrafterKind
from lmkit.sampling import SamplingParams
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import GenerationRequest, Orchestrator
from orchestrator.links import LinkPolicy
from tests.conftest import Services, run_async
from tests.test_seeds import OneRoundTarget

pytestmark = pytest.mark.services

PROMPT = "Once upon a time"


class SlowDraft(DraftEngine):
    """Proposes like the tiny draft, 0.2 s late: a proposal drafted ahead is still running when a round ends."""

    def propose(self, session, position, tokens, k, free_k=0, max_branches=1, features=None):
        time.sleep(0.2)
        return super().propose(session, position, tokens, k, free_k, max_branches, features)


@pytest.fixture(scope="module")
def slow_draft(background_loop, tiny_services):
    plain = tiny_services.draft_engine
    engine = SlowDraft(plain.model, model_id=plain.model_id, vocab_fingerprint=plain.vocab_fingerprint,
                       limits=plain.limits)
    services = Services(background_loop, tiny_services.target_engine, engine)
    yield services
    services.stop()


def pending_look_aheads() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_coro().__qualname__ == "DraftLink._propose"]


def test_the_look_ahead_stops_before_the_last_event_of_a_stopped_generation(slow_draft, tiny_target_dir, gguf_tokenizer):
    async def go():
        config = OrchestratorConfig(slow_draft.target_address, slow_draft.draft_address, str(tiny_target_dir),
                                    link_policy=LinkPolicy(draft_timeout_s=30))
        orch = await Orchestrator.connect(config)
        prompt = orch.encode(PROMPT, False)
        try:
            plain = GenerationRequest("", False, 16, SamplingParams(), (), 4, DrafterKind.MODEL, False, False,
                                      overlap=True)
            text = "".join([e.text async for e in orch.generate(plain, prompt)])
            stop = text[len(text) // 2 :][:3]
            request = GenerationRequest("", False, 16, SamplingParams(), (stop,), 4, DrafterKind.MODEL, False, False,
                                        overlap=True)
            seen_at_last = None
            async for event in orch.generate(request, prompt):
                if event.finish is not None:
                    seen_at_last = pending_look_aheads()
                    finish = event.finish
            return seen_at_last, finish, event.stats, pending_look_aheads()
        finally:
            await orch.close()

    at_last, finish, stats, after = run_async(go())
    assert finish.name == "STOP_STRING"
    assert stats.drafted_tokens > 0
    assert at_last == [] and after == []


def test_a_reopened_sessions_prefill_is_not_fitted_as_a_decode_forward(tiny_services, tiny_target_dir, background_loop):
    plain = tiny_services.target_engine
    engine = OneRoundTarget(plain.model, model_id=plain.model_id, vocab_fingerprint=plain.vocab_fingerprint,
                            limits=plain.limits)
    forgetful = Services(background_loop, engine, tiny_services.draft_engine)

    async def fitted_samples(services) -> float:
        config = OrchestratorConfig(services.target_address, services.draft_address, str(tiny_target_dir),
                                    link_policy=LinkPolicy(target_retry_s=0.01))
        orch = await Orchestrator.connect(config)
        try:
            request = GenerationRequest("", False, 12, SamplingParams(), (), 2, DrafterKind.MODEL, False, False)
            events = [e async for e in orch.generate(request, orch.encode(PROMPT, False))]
            assert events[-1].stats.rounds > 2
            return orch.costs.verify.samples
        finally:
            await orch.close()

    try:
        assert run_async(fitted_samples(tiny_services)) > 0  # a steady session's decode forwards are fitted
        assert run_async(fitted_samples(forgetful)) == 0  # every forward re-read the context: none is
    finally:
        forgetful.stop()
