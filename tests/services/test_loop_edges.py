"""The edges of a generation: where it stops, what it leaves running, what it learns.

* With ``return_token_ids`` and a stop string, the ids sent are those of the
  text sent: none past the stop string, ``new_tokens`` counts them, and
  ``decode(ids)`` is the text when the stop string starts at a token boundary
  (when it starts inside a token, that token is the last id sent). The tiny
  target greedily repeats one token, so no stop string is first seen mid-text;
  a seeded sample (COUPLED mode: the same tokens for the seed every time) is.
* When a generation ends (here by a stop string, which only the orchestrator's
  text side sees), the proposal drafted ahead is stopped before the last event
  goes out, not when the abandoned generator is garbage-collected.
* A forward that re-read the context (a target session re-opened after a loss)
  is not a decode forward: the cost fit that chooses k never sees it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specsplit.draft_service.engine import DraftEngine
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import Services, run_async
from tests.services.test_seeds import OneRoundTarget

pytestmark = pytest.mark.services

PROMPT = "Once upon a time"


async def public_generate(address, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        return [r async for r in pb_grpc.GeneratorStub(channel).Generate(request)]


def stop_at(text: str, heads: list[str], inside: int) -> tuple[int, str]:
    """(cut, stop): a stop string from ``inside`` characters into token ``cut``'s text to 2 characters into
    token ``cut + 1``'s, first seen there.

    ``heads[i]`` is the text of the first i ids. Token ``cut - 1`` must have
    text of its own (so it is sent with the text before the stop). The stop
    string completes in token ``cut + 1``, so the round that meets it commits
    at least one id past the last one to send: code that sent a round's ids
    whole would send it.
    """
    for cut in range(1, len(heads) - 2):
        start, end = len(heads[cut]) + inside, len(heads[cut + 1]) + 2
        stop = text[start:end]
        own_text = len(heads[cut]) > len(heads[cut - 1]) and len(heads[cut + 1]) > start
        first_seen = len(heads[cut + 2]) >= end and text.find(stop) == start and text.startswith(heads[cut + 2])
        if own_text and first_seen:
            return cut, stop
    raise AssertionError(f"no stop string {inside} characters into a token of {text!r}")


@pytest.mark.parametrize("inside", [0, 1], ids=["at-a-token-boundary", "inside-a-token"])
def test_token_ids_stop_where_the_text_stops(public_api, gguf_tokenizer, inside):
    sampling = pb.SamplingParams(temperature=1.0, seed=5)
    base = dict(prompt=PROMPT, max_new_tokens=32, return_token_ids=True, k=4, sampling=sampling)
    whole = run_async(public_generate(public_api, pb.GenerateRequest(**base)))
    ids = [t for r in whole for t in r.token_ids]
    text = "".join(r.text for r in whole)
    assert whole[-1].stats.new_tokens == len(ids)
    heads = [gguf_tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    assert heads[-1] == text
    cut, stop = stop_at(text, heads, inside)

    stopped = run_async(public_generate(public_api, pb.GenerateRequest(**base, stop=[stop])))
    sent_ids = [t for r in stopped for t in r.token_ids]
    sent_text = "".join(r.text for r in stopped)
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP_STRING
    assert sent_text == text[: text.index(stop)]
    if inside == 0:  # the ids decode to exactly the text sent
        assert sent_ids == ids[:cut] and heads[cut] == sent_text
    else:  # the token the stop string starts in is the last id sent; its text was partly sent
        assert sent_ids == ids[: cut + 1]
        assert sent_text.startswith(heads[cut]) and heads[cut + 1].startswith(sent_text)
        assert len(heads[cut]) < len(sent_text) < len(heads[cut + 1])
    assert stopped[-1].stats.new_tokens == len(sent_ids)


class SlowDraft(DraftEngine):
    """Proposes like the tiny draft, 0.2 s late: a proposal drafted ahead is still running when a round ends."""

    def propose(self, session, position, tokens, k, free_k=0, max_branches=1, features=None, successors=()):
        time.sleep(0.2)
        return super().propose(session, position, tokens, k, free_k, max_branches, features, successors)


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
                                    link_policy=LinkPolicy(draft_timeout_s=30, draft_deadline_s=30))
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
            return orch.measured.costs.verify.samples
        finally:
            await orch.close()

    try:
        assert run_async(fitted_samples(tiny_services)) > 0  # a steady session's decode forwards are fitted
        assert run_async(fitted_samples(forgetful)) == 0  # every forward re-read the context: none is
    finally:
        forgetful.stop()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_generation_keeps_its_draft_whatever_room_is_left(tiny_services, tiny_target_dir, overlap):
    """A round may have far more room (budget, context) than the draft's max block: every ask stays within the
    session's bound, so the draft never refuses one and never drops out. The first round asks prompt lookup
    whatever the costs (nothing has returned yet); whether later blocks are verified depends on the measured
    costs, so the test reads that the draft answered, not that its tokens were sent."""
    async def go():
        config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
        orch = await Orchestrator.connect(config)
        try:
            request = GenerationRequest("", False, 96, SamplingParams(), (), 8, DrafterKind.NGRAM, False, True,
                                        overlap=overlap)
            return [e async for e in orch.generate(request, orch.encode(PROMPT, False))][-1]
        finally:
            await orch.close()

    last = run_async(go())
    assert tiny_services.draft_engine.limits.max_block < 96
    assert last.stats.new_tokens == 96 and last.stats.draft_compute_s > 0  # the draft was asked and answered
    assert last.stats.draft_fallback_rounds == 0 and last.stats.draft_reattached == 0


def test_prompt_logprobs_come_on_each_samples_first_message_and_0_new_tokens_score_the_prompt_alone(
        public_api, gguf_tokenizer, tiny_target_dir):
    import math

    import torch

    from specsplit.lmkit import models

    ids = list(gguf_tokenizer.encode(PROMPT))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    chosen = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    sampled = run_async(public_generate(public_api, pb.GenerateRequest(
        prompt=PROMPT, max_new_tokens=5, k=3, n=2, prompt_logprobs=2, sampling=pb.SamplingParams(temperature=0.8, seed=3))))
    for index in (0, 1):
        messages = [r for r in sampled if r.index == index]
        scored = messages[0].prompt_logprobs
        assert [lp.token_id for lp in scored] == ids and math.isnan(scored[0].logprob) and not scored[0].top
        assert [lp.logprob for lp in scored[1:]] == pytest.approx(chosen, abs=1e-4)
        assert [[t.token_id for t in lp.top] for lp in scored[1:]] == want.topk(2).indices.tolist()
        assert all(not r.prompt_logprobs for r in messages[1:])
    alone = run_async(public_generate(public_api, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=0, prompt_logprobs=0)))
    assert "".join(r.text for r in alone) == "" and alone[-1].stats.new_tokens == 0
    assert alone[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [lp.logprob for lp in alone[0].prompt_logprobs[1:]] == pytest.approx(chosen, abs=1e-4)
    with pytest.raises(grpc.RpcError) as info:  # 0 new tokens only to score the prompt
        run_async(public_generate(public_api, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=0)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "0 only with prompt_logprobs" in info.value.details()
