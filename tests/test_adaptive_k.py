"""The K controller: cost fit, Leviathan's expectation, load, overlap, and the choice they drive."""

import pytest

from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from orchestrator.adaptive_k import ALONE, AdaptiveK, CostModel, Load, expected_tokens, expected_tokens_by_position
from orchestrator.loop import LoopConfig, LoopStats, _Block, _Loop

pytestmark = pytest.mark.unit


def fitted(a=0.05, b=0.006, draft=0.0, widths=(1, 2, 3, 5, 9, 1, 4, 9)) -> CostModel:
    """Forwards of x tokens cost a + b (x - 1): a decode step costs a."""
    costs = CostModel()
    for x in widths:
        costs.observe_verify(x, a + b * (x - 1))
        costs.observe_draft(x - 1, draft * (x - 1))
    return costs


def test_cost_model_recovers_a_linear_verify_cost():
    costs = fitted(a=0.05, b=0.006)
    assert costs.verify_s(1) == pytest.approx(0.05, rel=1e-6)
    assert costs.verify_s(11) == pytest.approx(0.11, rel=1e-6)


def test_expected_tokens_matches_leviathan():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    for alpha in (0.0, 0.3, 0.9):  # position-wise with a constant rate is Leviathan's E(k)
        assert expected_tokens_by_position([alpha] * 6, 6) == pytest.approx(expected_tokens(alpha, 6))
    assert expected_tokens_by_position([0.5, 1.0, 0.0], 3) == pytest.approx(1 + 0.5 + 0.5)


def test_runs_of_acceptance_keep_blocks_long():
    """Copy spans: a round either passes everything or fails at once. Overall acceptance is ~0.5, which
    the i.i.d. model would answer with short blocks; given the first token passed, the rest always do."""
    costs = fitted(a=0.07, b=0.01)
    controller = AdaptiveK(k_max=8, costs=costs)
    for _ in range(6):
        controller.observe(drafted=8, accepted=8)
        controller.observe(drafted=8, accepted=0)
    accept = controller.acceptance()
    assert accept[0] < 0.65 and min(accept[1:]) > 0.8
    iid = AdaptiveK(k_max=8, costs=costs)
    assert controller.choose() >= 4 > iid.best([controller.alpha] * 8)


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
            c.observe(drafted=16, accepted=12)
            c.observe(drafted=16, accepted=3)
    assert 0 < dear.choose() < cheap.choose()


def test_rounds_without_a_proposal_carry_no_evidence():
    controller = AdaptiveK(k_max=8, costs=fitted())
    before = controller.alpha
    controller.observe(drafted=0, accepted=0)
    assert controller.alpha == before


def test_negative_bound_is_refused():
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=-1, costs=CostModel())


def confident(costs: CostModel, k_max: int = 8) -> AdaptiveK:
    controller = AdaptiveK(k_max=k_max, costs=costs)
    for _ in range(10):
        controller.observe(drafted=4, accepted=3)
    return controller


def cpu_like() -> CostModel:
    """A forward costs 62 ms + 20 ms per token, measured over batch sizes 1..64 (SmolLM2, one core here)."""
    return fitted(a=0.062, b=0.02, widths=(1, 2, 5, 9, 8, 16, 32, 64, 9, 1))


def n_gram_like(costs: CostModel) -> AdaptiveK:
    """Acceptance like the n-gram drafter's on the demo prompts: runs that pass, or fail early."""
    controller = AdaptiveK(k_max=8, costs=costs)
    for _ in range(5):
        for accepted in (1, 3, 0, 2, 8):
            controller.observe(drafted=8, accepted=accepted)
    return controller


def test_alone_the_choice_is_leviathans():
    controller = n_gram_like(cpu_like())
    assert controller.choose(Load()) == controller.choose() > 0


def test_saturated_target_turns_speculation_off_and_load_falling_brings_it_back():
    controller = n_gram_like(cpu_like())
    alone = controller.choose(Load())
    saturated = Load(sessions=32, others_committed=31)
    assert controller.choose(saturated) == 0
    # never probe under saturation: even good drafts would not pay there
    rounds = 3 * controller.probe_every * saturated.sessions
    assert [controller.choose(saturated) for _ in range(rounds)] == [0] * rounds
    assert controller.choose(Load()) == alone


def test_one_sessions_copy_span_does_not_pad_a_busy_batch():
    """Others decode one token each: a block must bring more than the padding costs all of them."""
    controller = n_gram_like(cpu_like())
    assert controller.best(controller.acceptance(), Load()) > 0  # alone it pays
    assert controller.best(controller.acceptance(), Load(sessions=8, others_committed=7)) == 0


def test_k_shrinks_as_load_grows():
    controller = n_gram_like(cpu_like())
    ks = [controller.best(controller.acceptance(), Load(b, b - 1)) for b in (1, 2, 4, 8, 32)]
    assert ks == sorted(ks, reverse=True) and ks[0] > 0 and ks[-1] == 0


def test_unreached_positions_follow_the_last_measured_one():
    controller = AdaptiveK(k_max=8, costs=cpu_like())
    for _ in range(10):
        controller.observe(drafted=3, accepted=3)  # positions 4..8 never verified
    accept = controller.acceptance()
    assert accept[3:] == [accept[2]] * 5 and accept[2] > 0.9


def test_overlap_hides_drafting():
    dear = fitted(a=0.05, b=0.002, draft=0.008)
    controller = confident(dear, 16)
    accept = controller.acceptance()
    assert controller.rate(0, accept, overlap=True) == controller.rate(0, accept, overlap=False)
    for k in range(1, 6):  # drafting k + 1 ahead (8 ms each) fits within one verification (>= 50 ms)
        assert controller.rate(k, accept, overlap=True) > controller.rate(k, accept, overlap=False)
    # a draft slower than the verification is waited for, and on a miss paid again: overlap can lose then
    assert controller.rate(16, accept, overlap=True) < controller.rate(16, accept, overlap=False)
    assert controller.choose(overlap=True) > 0


def test_a_session_joining_a_busy_target_starts_from_its_load():
    """The load comes from decode rounds, shared through the target's cost model: a new session does not
    size its first blocks for a target of its own, and its prefill (a forward alone) does not reset it."""
    costs = cpu_like()
    config = LoopConfig(k=8, max_new_tokens=100, eos_ids=frozenset(), max_context=1000)

    def round_in(loop: _Loop, sessions: int) -> None:
        loop.commit(_Block([], k=0), pb.VerifyResult(accepted=0, next_token=7, batch_size=sessions,
                                                     others_committed=sessions - 1))

    busy = Load(sessions=8, others_committed=7)
    running = _Loop([1, 2, 3], config, None, LoopStats(), n_gram_like(costs), costs)
    round_in(running, 1)  # its prefill
    round_in(running, 8)  # a decode round among 8 sessions
    assert running.load == costs.load == busy

    joining = _Loop([4, 5, 6], config, None, LoopStats(), n_gram_like(costs), costs)
    assert joining.choose(joining.limit()) == 0  # alone this controller drafts (test above); here it would pad 7 rows
    round_in(joining, 1)  # its prefill ran alone
    assert joining.load == busy and joining.choose(joining.limit()) == 0
    assert joining.stats.batch_sizes == [1]  # the stats still record the forward it ran in
    round_in(joining, 1)  # the others finished: its decode round ran alone
    assert joining.load == costs.load == ALONE and joining.choose(joining.limit()) > 0
