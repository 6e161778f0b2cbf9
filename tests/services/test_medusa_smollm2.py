"""The bundled Medusa heads on the real SmolLM2 target: greedy output equals the target's own generate(), and the
heads really draft (their tokens are accepted), as chains and as trees."""

from __future__ import annotations

import pytest

from specsplit.draft_service import medusa
from specsplit.lmkit.kinds import DrafterKind
from tests.conftest import run_async
from tests.services.smollm2_heads import PROMPTS, smollm2_with_head
from tests.services.test_greedy_e2e import generate_all

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2_medusa(background_loop):
    with smollm2_with_head(background_loop, DrafterKind.MEDUSA, medusa.load_heads) as built:  # the bundled head(s)
        yield built


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
