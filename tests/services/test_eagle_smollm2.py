"""The bundled EAGLE head on the real SmolLM2 target: greedy output equals the target's own generate(), and
the head really drafts (its tokens are accepted), alone and behind n-gram lookup, with overlap and adaptive K."""

from __future__ import annotations

import pytest

from specsplit.draft_service import eagle_head
from specsplit.lmkit.kinds import DrafterKind
from tests.conftest import run_async
from tests.services.smollm2_heads import PROMPTS, smollm2_with_head
from tests.services.test_drafters_e2e import run_greedy

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2_eagle(background_loop):
    with smollm2_with_head(background_loop, DrafterKind.EAGLE, eagle_head.load_head) as built:  # the bundled head(s)
        yield built


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
