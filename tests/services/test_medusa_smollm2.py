"""The bundled Medusa heads on the real SmolLM2 target: greedy output equals the target's own generate(), and the
heads really draft (their tokens are accepted), as chains and as trees."""

from __future__ import annotations

import pytest

from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.draft_service import medusa
from specsplit.draft_service.engine import DraftEngine
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sessions import SessionLimits
from tests.conftest import Services, make_engines, reference_greedy, run_async
from tests.services.test_greedy_e2e import generate_all

pytestmark = [pytest.mark.services, pytest.mark.slow]

PROMPTS = [p for p in DEMO_PROMPTS if p.name in ("summarise", "story", "explain")]


@pytest.fixture(scope="module")
def smollm2_medusa(background_loop):
    target, _ = make_engines("smollm2-135m", None)
    model = target.model  # the heads read the target's LM head; in one process the two share it
    fingerprint = models.vocab_fingerprint(models.load_tokenizer("smollm2-135m"))
    heads = medusa.load_heads("smollm2-135m", model)  # the bundled heads, by their target's name
    draft = DraftEngine(model, model_id="smollm2-135m", vocab_fingerprint=fingerprint, limits=SessionLimits(),
                        derived={DrafterKind.MEDUSA: heads})
    services = Services(background_loop, target, draft)
    tokenizer = models.load_tokenizer("smollm2-135m")
    prompts_ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)["input_ids"])
        for p in PROMPTS
    ]
    yield services, prompts_ids, [reference_greedy(model, ids, 32) for ids in prompts_ids]
    services.stop()


@pytest.mark.parametrize("branches", [1, 4])
def test_smollm2_greedy_equals_generate_with_the_bundled_heads(smollm2_medusa, branches):
    services, prompts_ids, expected = smollm2_medusa
    stats: list = []
    got = run_async(generate_all(services, "smollm2-135m", prompts_ids, 3, DrafterKind.MEDUSA, 32, branches=branches,
                                 stats=stats))
    for prompt, want, have in zip(PROMPTS, expected, got):
        assert have == want, f"medusa diverged on {prompt.name}"
    drafted, accepted = sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    if branches == 1:
        assert 0 < accepted < drafted
    else:  # trees were verified; whether the policy keeps drafting depends on what the first ones accepted
        assert sum(s.tree_rounds for s in stats) > 0
