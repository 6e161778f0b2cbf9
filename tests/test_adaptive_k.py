"""The K controller: cost fit, Leviathan's expectation, and the choice it drives."""

import pytest

from orchestrator.adaptive_k import AdaptiveK, CostModel, expected_tokens


def fitted(a=0.05, b=0.006, draft=0.0) -> CostModel:
    costs = CostModel()
    for k in [0, 1, 2, 4, 8, 0, 3, 8]:
        costs.observe_verify(k, a + b * k)
        costs.observe_draft(k, draft * k)
    return costs


def test_cost_model_recovers_a_linear_verify_cost():
    costs = fitted(a=0.05, b=0.006)
    assert costs.verify_s(0) == pytest.approx(0.05, rel=1e-6)
    assert costs.verify_s(10) == pytest.approx(0.11, rel=1e-6)


def test_expected_tokens_matches_leviathan():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_high_acceptance_and_cheap_drafts_use_the_bound():
    controller = AdaptiveK(k_max=8, costs=fitted())
    for _ in range(10):
        controller.observe(drafted=8, accepted=8)
    assert controller.choose() == 8


def test_rejections_switch_speculation_off_then_probe():
    controller = AdaptiveK(k_max=8, costs=fitted(b=0.01), probe_every=4)
    for _ in range(10):
        controller.observe(drafted=4, accepted=0)
    choices = [controller.choose() for _ in range(8)]
    assert choices == [0, 0, 0, 1, 0, 0, 0, 1]


def test_expensive_draft_shortens_blocks():
    cheap = AdaptiveK(k_max=16, costs=fitted(draft=0.0))
    dear = AdaptiveK(k_max=16, costs=fitted(draft=0.03))
    for c in (cheap, dear):
        for _ in range(10):
            c.observe(drafted=4, accepted=3)
    assert 0 < dear.choose() < cheap.choose()


def test_rounds_without_a_proposal_carry_no_evidence():
    controller = AdaptiveK(k_max=8, costs=fitted())
    before = controller.alpha
    controller.observe(drafted=0, accepted=0)
    assert controller.alpha == before


def test_negative_bound_is_refused():
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=-1, costs=CostModel())
