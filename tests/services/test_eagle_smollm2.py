"""The bundled EAGLE head on the real SmolLM2 target: greedy output equals the target's own generate(), and
the head really drafts (its tokens are accepted), alone and behind n-gram lookup, with overlap and adaptive K."""

from __future__ import annotations

import pytest

from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.draft_service import eagle_head
from specsplit.draft_service.engine import DraftEngine
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sessions import SessionLimits
from tests.conftest import Services, make_engines, reference_greedy, run_async
from tests.services.test_drafters_e2e import run_greedy

pytestmark = [pytest.mark.services, pytest.mark.slow]

PROMPTS = [p for p in DEMO_PROMPTS if p.name in ("summarise", "story", "explain")]


@pytest.fixture(scope="module")
def smollm2_eagle(background_loop):
    target, _ = make_engines("smollm2-135m", None)
    model = target.model  # the draft reads the target's embedding; in one process the two share it
    fingerprint = models.vocab_fingerprint(models.load_tokenizer("smollm2-135m"))
    head = eagle_head.load_head("smollm2-135m", model)  # the bundled head, by its target's name
    draft = DraftEngine(model, model_id="smollm2-135m", vocab_fingerprint=fingerprint, limits=SessionLimits(),
                        derived={DrafterKind.EAGLE: head})
    services = Services(background_loop, target, draft)
    tokenizer = models.load_tokenizer("smollm2-135m")
    prompts_ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)["input_ids"])
        for p in PROMPTS
    ]
    yield services, prompts_ids, [reference_greedy(model, ids, 32) for ids in prompts_ids]
    services.stop()


@pytest.mark.parametrize("drafter,chain,k,adaptive,overlap", [
    pytest.param(DrafterKind.EAGLE, (), 3, False, False, id="eagle-k3"),
    pytest.param(DrafterKind.CHAIN, (DrafterKind.NGRAM, DrafterKind.EAGLE), 8, True, True, id="chain-adaptive-overlap"),
])
def test_smollm2_greedy_equals_generate_with_the_bundled_head(smollm2_eagle, drafter, chain, k, adaptive, overlap):
    services, prompts_ids, expected = smollm2_eagle
    got, drafted, accepted = run_async(
        run_greedy(services, "smollm2-135m", prompts_ids, k, drafter, chain, adaptive, overlap, max_new_tokens=32)
    )
    for prompt, want, have in zip(PROMPTS, expected, got):
        assert have == want, f"{drafter.name} diverged on {prompt.name}"
    assert accepted > 0 and accepted < drafted
    assert services.draft_engine.sessions.stats()[0] == 0
