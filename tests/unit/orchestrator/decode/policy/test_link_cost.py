"""The link-cost model: RTT estimation (RFC 6298), E[max] of two legs (Clark), round times and deadlines,
and how the K controller's choices follow from each link's round trip."""

from __future__ import annotations

import random
import statistics

import pytest

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.decode.policy.controller import AdaptiveK, Drafters
from specsplit.orchestrator.decode.policy.measure import (
    SAMPLE_BOUND,
    SEED_SAMPLES,
    AcceptanceStats,
    AcceptRule,
    Costs,
    Links,
    Measurements,
    RttEstimator,
)
from specsplit.orchestrator.decode.policy.model import DEADLINE_FLOOR_S, Shape, deadline_s, expected_max, round_s

pytestmark = pytest.mark.unit


def test_rtt_estimator_follows_rfc_6298():
    rtt = RttEstimator()
    rtt.observe(0.010)
    assert (rtt.srtt, rtt.rttvar) == (0.010, 0.005)  # first sample: srtt = r, rttvar = r / 2
    rtt.observe(0.018)
    assert rtt.rttvar == pytest.approx(0.75 * 0.005 + 0.25 * 0.008)
    assert rtt.srtt == pytest.approx(0.875 * 0.010 + 0.125 * 0.018)


def test_rtt_estimator_converges_to_the_mean_and_the_spread_of_its_samples():
    rng = random.Random(0)
    rtt = RttEstimator()
    samples = [0.020 + rng.gauss(0, 0.002) for _ in range(4000)]
    sigmas = []
    for s in samples:
        rtt.observe(s)
        sigmas.append(rtt.sigma)
    assert rtt.srtt == pytest.approx(0.020, abs=0.0015)
    # rttvar follows the last few samples; over time it reads as the spread (sigma of a normal)
    assert statistics.fmean(sigmas[1000:]) == pytest.approx(statistics.stdev(samples), rel=0.15)


def test_one_reply_after_an_outage_moves_the_estimate_little_and_a_lasting_change_is_learned():
    rtt = RttEstimator()
    for _ in range(50):
        rtt.observe(0.001)
    rtt.observe(3.0)  # a reply that waited out a 3 s partition
    assert rtt.srtt < 0.002 and rtt.bound_s < 0.010
    for _ in range(3):
        rtt.observe(0.001)
    settled = rtt.srtt
    steps = 0
    while rtt.srtt < 0.040:  # the link now takes 50 ms for good
        rtt.observe(0.050)
        steps += 1
    assert settled < 0.002 and steps <= 25
    fresh = RttEstimator()
    fresh.observe(0.0)
    for _ in range(25):  # from a loopback zero, the floor lets a real round trip in
        fresh.observe(0.020)
    assert fresh.srtt > 0.015


def test_speculation_stays_on_after_one_reply_that_spanned_an_outage():
    """A warmed controller drafting over a 1 ms draft link keeps asking for blocks after a single 3 s reply (a
    partition's); the estimate it would have had unclamped (an eighth of the outage) turns drafting off."""
    warmed = controller(0.001, 0.0, 0.7, 0.0)
    assert warmed.ask(8, overlap=False) >= 1
    warmed.costs.links.draft.observe(3.0)
    assert warmed.ask(8, overlap=False) >= 1
    unclamped = controller(0.001 + 3.0 / 8, 0.0, 0.7, 0.0)  # srtt after the same sample without the bound
    assert unclamped.ask(8, overlap=False) == 0


def test_one_proposal_that_spanned_an_outage_moves_the_drafts_price_little_and_a_lasting_change_is_learned():
    """A draft paused mid-proposal reports the pause as compute: counted whole, one 1 s proposal of 8 tokens
    would price the drafter's tokens above the target's step and no ask would go out again."""
    costs = Costs()
    for _ in range(60):
        costs.observe_draft(8, 8 * 0.003, DrafterKind.MODEL)
    costs.observe_draft(8, 1.0, DrafterKind.MODEL)
    assert costs.draft_s_per_token(DrafterKind.MODEL) < 0.0035
    steps = 0
    while costs.draft_s_per_token(DrafterKind.MODEL) < 0.020:  # the drafter now takes 30 ms a token for good
        costs.observe_draft(8, 8 * 0.030, DrafterKind.MODEL)
        steps += 1
    assert steps <= 80


def test_speculation_stays_on_after_one_proposal_that_spanned_an_outage():
    warmed = controller(0.001, 0.0, 0.7, 0.004)
    for _ in range(60):
        warmed.costs.observe_draft(4, 4 * 0.004, DrafterKind.MODEL)
    assert warmed.ask(8, overlap=False) >= 1
    warmed.costs.observe_draft(4, 10.0, DrafterKind.MODEL)  # a proposal that waited out a 10 s partition
    assert warmed.ask(8, overlap=False) >= 1


def test_a_first_proposal_that_spanned_an_outage_is_not_where_the_drafts_price_starts():
    costs = Costs()
    costs.observe_draft(8, 1.0, DrafterKind.MODEL)  # paused mid-proposal: 125 ms a token
    assert costs.draft_unsettled(DrafterKind.MODEL)
    costs.observe_draft(8, 8 * 0.003, DrafterKind.MODEL)
    assert costs.draft_s_per_token(DrafterKind.MODEL) == pytest.approx(0.003)  # the lower of two
    costs.observe_draft(1, 0.004, DrafterKind.MODEL)
    assert not costs.draft_unsettled(DrafterKind.MODEL)
    assert costs.draft_s_per_token(DrafterKind.MODEL) == pytest.approx(0.004)  # of 125, 3 and 4 ms, the median
    costs.observe_draft(8, 10.0, DrafterKind.MODEL)  # settled: bounded as before
    assert costs.draft_s_per_token(DrafterKind.MODEL) < 0.004 * SAMPLE_BOUND


def fresh() -> AdaptiveK:
    """A controller on a measured CPU-like target (t(x) = 60 ms + 5 ms x) whose drafter has not answered yet."""
    costs = Costs(links=links(0.001, 0.0, n=0))
    for x in (1, 2, 3, 5, 9, 1, 4, 9):
        costs.observe_verify(x, 0.060 + 0.005 * x)
    stats = AcceptanceStats(prior=0.9)
    rule = AcceptRule.of(VerificationMode.GREEDY, 0.0)
    return AdaptiveK(8, Measurements(costs, stats), rule, Drafters(DrafterKind.MODEL, paid=DrafterKind.MODEL),
                     probe_every=4)


def answer(session: AdaptiveK, k: int, compute_s: float) -> None:
    """The draft answers an ask of k tokens over a 1 ms link."""
    session.observe_proposal(compute_s + 0.001, compute_s, k, DrafterKind.MODEL)


def test_a_fresh_session_whose_first_proposal_spanned_an_outage_drafts_again():
    """Priced by that one proposal, the drafter's tokens cost more than a target step: no block would pay, and
    without asks no proposal could bring the price back."""
    session = fresh()
    k = session.ask(8)
    assert k == 8
    answer(session, k, 1.0)  # the draft was paused through its first proposal
    asked = [session.ask(8) for _ in range(4)]
    assert asked == [0, 0, 0, 8]  # a whole block, not one token: a proposal's own overhead would price it
    answer(session, 8, 8 * 0.004)
    assert session.ask(8) >= 4  # the lower of two proposals' prices: the one that was not stalled
    answer(session, 8, 8 * 0.004)
    assert not session.costs.draft_unsettled(DrafterKind.MODEL)
    assert session.ask(8) >= 4


def test_a_drafter_whose_settled_price_is_too_high_gets_no_more_block_probes():
    session = fresh()
    for _ in range(SEED_SAMPLES):
        k = next((k for k in (session.ask(8) for _ in range(32)) if k), 0)  # rounds at 0, then a probe
        assert k == 8  # of a whole block while the price is unsettled
        answer(session, 8, 8 * 0.100)  # 100 ms a token against a 65 ms step: never pays
    assert not session.costs.draft_unsettled(DrafterKind.MODEL)
    assert set(session.ask(8) for _ in range(200)) == {0}


def test_expected_max_of_two_normals_matches_sampling():
    rng = random.Random(1)
    for mean_a, sigma_a, mean_b, sigma_b in [(1.0, 0.2, 1.1, 0.3), (1.0, 0.0, 0.5, 0.0), (2.0, 0.5, 0.0, 0.1)]:
        sampled = statistics.fmean(max(rng.gauss(mean_a, sigma_a), rng.gauss(mean_b, sigma_b)) for _ in range(40000))
        assert expected_max(mean_a, sigma_a, mean_b, sigma_b) == pytest.approx(sampled, abs=0.01)
    assert expected_max(1.0, 0.0, 0.5, 0.0) == 1.0  # no jitter: the slower leg


def links(draft_s: float, target_s: float, jitter_s: float = 0.0, n: int = 50) -> Links:
    out = Links()
    rng = random.Random(2)
    for _ in range(n):
        out.draft.observe(draft_s + rng.gauss(0, jitter_s) if jitter_s else draft_s)
        out.target.observe(target_s + rng.gauss(0, jitter_s) if jitter_s else target_s)
    return out


def test_round_time_adds_each_link_where_it_is_paid():
    lk = links(draft_s=0.010, target_s=0.020)
    verify, c = 0.050, 0.004
    for shape in Shape:  # no draft call
        assert round_s(shape, 0, verify, c, lk, hit=0.5) == pytest.approx(0.070)
    assert round_s(Shape.TARGET_ONLY, 3, verify, c, lk) == pytest.approx(0.070)
    assert round_s(Shape.SYNC, 3, verify, c, lk, hit=0.5) == pytest.approx(0.070 + 0.010 + 0.012)
    # drafted ahead: drafting (10 + 16 ms) hides behind the target leg (70 ms); a miss pays the draft again
    assert round_s(Shape.AHEAD, 3, verify, c, lk, hit=0.5) == pytest.approx(0.070 + 0.5 * (0.010 + 0.012))
    # no links measured: the round is the target's forward and the drafting it does not hide
    assert round_s(Shape.AHEAD, 3, verify, c, Links(), 0.5) == pytest.approx(verify + 0.5 * 3 * c)
    # a block in hand (a free block being cut): its draft round trip is paid whatever k is
    assert round_s(Shape.IN_HAND, 3, verify, 0.0, lk, 0.5) == pytest.approx(0.070)


def test_jitter_makes_two_parallel_legs_slower_on_average():
    calm, jittery = links(0.030, 0.030), links(0.030, 0.030, jitter_s=0.010, n=400)
    assert round_s(Shape.AHEAD, 2, 0.0, 0.0, jittery) > round_s(Shape.AHEAD, 2, 0.0, 0.0, calm) + 0.003


def test_draft_deadline_is_its_expected_time_plus_four_deviations_with_a_floor():
    lk = links(draft_s=0.020, target_s=0.0, jitter_s=0.002, n=200)
    expected = 4 * 0.005
    assert deadline_s(lk.draft, expected) == pytest.approx(lk.draft.srtt + 1.5 * expected + 4 * lk.draft.rttvar)
    assert deadline_s(Links().draft, 0.0) == DEADLINE_FLOOR_S


def controller(draft_rtt: float, target_rtt: float, alpha: float, draft_token_s: float, k_max: int = 8) -> AdaptiveK:
    """A warmed controller on a CPU-like target (t(x) = 60 ms + 5 ms x) with the given links."""
    costs = Costs(links=links(draft_rtt, target_rtt))
    for x in (1, 2, 3, 5, 9, 1, 4, 9):
        costs.observe_verify(x, 0.060 + 0.005 * x)
    costs.observe_draft(4, 4 * draft_token_s, DrafterKind.MODEL)
    # Acceptance alpha at every position: the server-wide prior, with no evidence to move it.
    stats = AcceptanceStats(prior=alpha)
    rule = AcceptRule.of(VerificationMode.GREEDY, 0.0)
    return AdaptiveK(k_max, Measurements(costs, stats), rule, Drafters(DrafterKind.MODEL, paid=DrafterKind.MODEL))


def test_a_long_target_round_trip_lengthens_blocks():
    near, far = controller(0.0, 0.0, 0.6, 0.0), controller(0.0, 0.100, 0.6, 0.0)
    assert far.ask(8) > near.ask(8) >= 1


def test_a_slow_draft_link_turns_speculation_off_in_sync_and_overlap_hides_it():
    # Drafts that would pay on loopback (alpha 0.5, free to make) do not pay a 100 ms draft round trip in sync ...
    assert controller(0.0, 0.0, 0.5, 0.0).ask(8, overlap=False) >= 1
    slow = controller(0.100, 0.0, 0.5, 0.0)
    assert slow.ask(8, overlap=False) == 0
    # ... and with overlap neither: a miss pays the round trip again; with drafts that pass nearly always it does.
    assert slow.ask(8, overlap=True) == 0
    assert controller(0.100, 0.100, 0.95, 0.0).ask(8, overlap=True) >= 1


def test_overlap_pays_only_where_drafting_ahead_is_hidden():
    # A draft costing 40 ms a token: drafting k + 1 ahead outlasts the verification, and misses pay again.
    assert not controller(0.0, 0.0, 0.3, 0.040).ahead_pays()
    # Free drafts over a draft link as long as the target's: drafting ahead hides behind the verification.
    assert controller(0.050, 0.050, 0.7, 0.0).ahead_pays()
