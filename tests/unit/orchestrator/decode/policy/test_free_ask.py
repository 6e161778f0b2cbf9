"""Whether to ask a free drafter at all: what asks returned, what a block saves, what an ask costs per mode."""

from __future__ import annotations

import pytest

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.decode.links import NO_DRAFT
from specsplit.orchestrator.decode.loop import LoopConfig, LoopStats, _Loop
from specsplit.orchestrator.decode.policy.controller import AdaptiveK, Ask, Block, Drafters
from specsplit.orchestrator.decode.policy.measure import (
    ALONE,
    NO_BLOCK,
    QUIET_EVERY,
    AcceptanceStats,
    AcceptRule,
    Costs,
    Links,
    Load,
    Measurements,
    QualityMix,
    StatsKey,
    quality_of,
)
from specsplit.orchestrator.decode.policy.model import Shape, best_saving_s, round_s
from specsplit.orchestrator.decode.replies import DraftedBlock

pytestmark = pytest.mark.unit

GREEDY = AcceptRule.of(VerificationMode.GREEDY, 0.0)
NGRAM = DrafterKind.NGRAM
LONG, SHORT = quality_of(16, 1), quality_of(1, 3)


def costs_over(draft_rtt: float, target_rtt: float) -> Costs:
    """SmolLM2-like on one CPU core: 65 ms for one token, 120 ms for two, 142 ms for nine; links as given."""
    costs = Costs(links=Links())
    for _ in range(20):
        costs.links.draft.observe(draft_rtt)
        costs.links.target.observe(target_rtt)
    for _ in range(4):
        for x, t in ((1, 0.065), (2, 0.120), (9, 0.142)):
            costs.observe_verify(x, t)
    return costs


def weak_traffic(stats: AcceptanceStats) -> None:
    """Code edits' first tokens: short matches pass 1 time in 4; long ones (9 passes in 10) are rare."""
    for i in range(40):
        stats.observe(StatsKey(NGRAM, GREEDY, SHORT), 4, 1 if i % 4 == 0 else 0)
        stats.observe(StatsKey(NGRAM, GREEDY, LONG), 8, 8 if i % 10 else 3)


def session(costs: Costs, stats: AcceptanceStats, returns=(), overlap=False, **kw) -> AdaptiveK:
    controller = AdaptiveK(8, Measurements(costs, stats), GREEDY, Drafters(NGRAM, frozenset({NGRAM})),
                           overlap=overlap, **kw)
    for quality in returns:
        controller.returned(NGRAM, quality)
    return controller


# Asks that find nothing or a one-token match.
MOSTLY_WEAK = [NO_BLOCK, SHORT, SHORT, NO_BLOCK, SHORT] * 4


def test_a_mix_shrinks_towards_every_sessions_and_is_empty_without_asks():
    own, everyone = QualityMix(0.5), QualityMix(0.99)
    assert own.shares(everyone, 2.0) == {}
    everyone.add(LONG)
    assert own.shares(everyone, 2.0) == {LONG: pytest.approx(1.0)}
    own.add(NO_BLOCK)
    own.add(SHORT)  # decays the earlier NO_BLOCK to 0.5
    shares = own.shares(everyone, 2.0)
    assert shares == {NO_BLOCK: pytest.approx(0.5 / 3.5), SHORT: pytest.approx(1 / 3.5), LONG: pytest.approx(2 / 3.5)}
    assert sum(shares.values()) == pytest.approx(1.0)


def test_a_block_saves_its_best_cut_and_never_less_than_nothing():
    rounds = [0.065 if k == 0 else 0.120 + 0.003 * k for k in range(9)]
    assert best_saving_s([0.1] * 8, rounds) == 0.0  # no cut pays: k = 0
    # all of 8 pass: 9 tokens for 0.144 s instead of 9 steps of 0.065 s
    assert best_saving_s([1.0] * 8, rounds) == pytest.approx(9 * 0.065 - 0.144)


def test_in_sync_a_long_draft_round_trip_is_not_paid_for_weak_matches():
    stats = AcceptanceStats()
    weak_traffic(stats)
    # one ask in twenty found a long match
    near = session(costs_over(0.0005, 0.0005), stats, [LONG, *MOSTLY_WEAK[1:]], returns_decay=0.95)
    far = session(costs_over(0.052, 0.052), stats, [LONG, *MOSTLY_WEAK[1:]], returns_decay=0.95)
    assert 0.002 < near.free_saving_s(NGRAM, 8) < 0.052
    assert near.ask_free(NGRAM, 8)
    assert not far.ask_free(NGRAM, 8)
    # where every ask finds a long match, even 52 ms pays
    assert session(costs_over(0.052, 0.052), stats, [LONG] * 10).ask_free(NGRAM, 8)


def test_a_new_session_asks_until_any_ask_has_returned():
    stats = AcceptanceStats()
    assert session(costs_over(0.052, 0.052), stats).ask_free(NGRAM, 8)
    session(costs_over(0.052, 0.052), stats, MOSTLY_WEAK)  # an earlier session's asks, server-wide
    assert not session(costs_over(0.052, 0.052), stats).ask_free(NGRAM, 8)


def test_with_overlap_an_ask_ahead_whose_reply_is_back_in_time_is_made():
    stats = AcceptanceStats()
    weak_traffic(stats)
    far = session(costs_over(0.052, 0.052), stats, MOSTLY_WEAK)
    assert not far.ask_free(NGRAM, 8)  # before the verification: the round would wait 52 ms
    # during the verification of a 4-token block (142 ms + 52 ms): the 52 ms reply is back before it
    assert far.ask_free(NGRAM, 8, during=4, hit=0.5)
    # a draft link far longer than the verification: the part that outlasts it is paid
    slower = session(costs_over(0.400, 0.052), stats, MOSTLY_WEAK)
    assert not slower.ask_free(NGRAM, 8, during=4, hit=0.5)


def asked_rounds(controller: AdaptiveK, rounds: int, load: Load = ALONE) -> list[int]:
    controller.load = load
    return [i for i in range(rounds) if controller.ask_free(NGRAM, 8)]


def test_a_free_drafter_not_asked_is_probed_ever_less_often():
    stats = AcceptanceStats()
    weak_traffic(stats)
    far = session(costs_over(0.052, 0.052), stats, MOSTLY_WEAK, probe_every=4, probe_backoff=4)
    asked = asked_rounds(far, 100)
    assert [b - a for a, b in zip([-1, *asked], asked)] == [4, 8, 16, 16, 16, 16, 16]
    # under load the interval is per session of the batch
    other = AcceptanceStats()
    weak_traffic(other)
    busy = session(costs_over(0.052, 0.052), other, MOSTLY_WEAK, probe_every=4)
    assert asked_rounds(busy, 40, Load(4, 3.0)) == [15]  # 4 rounds x 4 sessions
    # probes that find long matches again turn asking back on, with the interval reset
    for _ in range(4):
        far.returned(NGRAM, LONG)
    assert asked_rounds(far, 5) == [0, 1, 2, 3, 4]


def test_probes_are_counted_over_every_sessions_rounds():
    """Short sessions (a few rounds each) still probe: the rounds not asked are counted server-wide."""
    stats = AcceptanceStats()
    weak_traffic(stats)
    asked = [session(costs_over(0.052, 0.052), stats, MOSTLY_WEAK, probe_every=4).ask_free(NGRAM, 8)
             for _ in range(12)]
    assert asked == [False] * 3 + [True] + [False] * 7 + [True]


def test_no_probe_where_even_drafts_that_nearly_always_pass_would_not_pay():
    stats = AcceptanceStats()
    weak_traffic(stats)
    hopeless = session(costs_over(5.0, 0.0005), stats, MOSTLY_WEAK, probe_every=2)
    assert asked_rounds(hopeless, 50) == []


def loop_of(controller: AdaptiveK) -> _Loop:
    cfg = LoopConfig(max_new_tokens=100, eos_ids=frozenset(), max_context=1000, ahead_max=8)
    return _Loop([1, 2, 3], cfg, NO_DRAFT, LoopStats(), controller)


def test_the_loop_asks_nothing_where_the_controller_says_no_and_records_what_asks_return():
    stats = AcceptanceStats()
    weak_traffic(stats)
    loop = loop_of(session(costs_over(0.052, 0.052), stats, MOSTLY_WEAK, overlap=True))
    assert loop.controller.plan(8) == Ask(0, 0)  # a target-only step: no free bound, so no draft request
    # ahead during a verification it hides behind: asked (the block's acceptance gives the hit probability)
    block = Block([5, 6], drafter=NGRAM, quality=LONG)
    assert 0 < loop.controller.hit_probability(block) < 1
    assert loop.controller.plan_ahead(block, 8) == Ask(0, 8)
    before = stats.returns(StatsKey(NGRAM, GREEDY)).total
    loop.returned(DraftedBlock(0, [4, 5], match=(16, 1)), 8)
    loop.returned(DraftedBlock(0, []), 8)  # nothing matched
    loop.returned(None, 8)  # a late reply says nothing
    loop.returned(DraftedBlock(0, [4]), 0)  # the free drafter was not asked
    assert stats.returns(StatsKey(NGRAM, GREEDY)).total == pytest.approx(before * 0.998 ** 2 + 0.998 + 1)


def test_what_an_ask_slows_the_forward_it_overlaps_by_is_measured_against_forwards_without():
    costs = Costs()
    for _ in range(3):  # asks before any quiet one-token forward was measured: nothing to compare with
        costs.observe_verify(1, 0.072, ahead=True)
    assert costs.ahead_excess_s() == 0.0
    for _ in range(10):
        costs.observe_verify(1, 0.065)
    assert costs.ahead_excess_s() == 0.0  # and the forwards with an ask never entered the fit
    assert costs.verify_s(1) == pytest.approx(0.065)
    for _ in range(3):
        costs.observe_verify(1, 0.072, ahead=True)
    assert costs.ahead_excess_s() == 0.0  # fewer than min_samples (a decayed count: 2.94)
    costs.observe_verify(1, 0.072, ahead=True)
    assert costs.ahead_excess_s() == pytest.approx(0.007)
    assert costs.verify_s(1) == pytest.approx(0.065)
    faster = Costs()
    for t in (0.065,) * 5 + (0.060,) * 5:
        faster.observe_verify(1, t, ahead=t < 0.065)
    assert faster.ahead_excess_s() == 0.0  # never below nothing


def test_after_quiet_every_forwards_with_an_ask_one_runs_without():
    costs = Costs()
    for _ in range(QUIET_EVERY - 1):
        costs.observe_verify(1, 0.07, ahead=True)
    assert not costs.quiet_due()
    costs.observe_verify(1, 0.07, ahead=True)
    assert costs.quiet_due()
    costs.observe_verify(1, 0.065)
    assert not costs.quiet_due()


def test_an_ask_ahead_that_slows_the_target_more_than_it_saves_is_not_made():
    """Draft and target on one CPU: an ask handled during the forward takes its cores."""
    stats = AcceptanceStats()
    weak_traffic(stats)
    near = costs_over(0.0005, 0.0005)
    rare = [LONG, *MOSTLY_WEAK[1:]]  # one ask in twenty finds a long match: ~7 ms saved an ask
    assert 0.004 < session(near, stats, rare).free_saving_s(NGRAM, 8) < 0.01
    assert session(near, stats, rare).ask_free(NGRAM, 8, during=0)
    for _ in range(5):
        near.observe_verify(1, 0.065 + 0.010, ahead=True)  # 10 ms more with an ask on its way
    assert near.ahead_excess_s() == pytest.approx(0.010, rel=0.05)
    assert not session(near, stats, rare).ask_free(NGRAM, 8, during=0)
    # long matches pay for an ask, but after the verification: there it costs only the 0.5 ms round trip
    assert session(near, stats, [LONG] * 10).ask_free(NGRAM, 8)
    assert not session(near, stats, [LONG] * 10).ask_free(NGRAM, 8, during=0, hit=0.9)
    # over a 52 ms link an ask ahead that hides the round trip is worth its 10 ms
    far = costs_over(0.052, 0.0005)
    for _ in range(5):
        far.observe_verify(1, 0.075, ahead=True)
    assert session(far, stats, [LONG] * 10).ask_free(NGRAM, 8, during=0, hit=0.9)
    # and the excess prices overlapped rounds, not a sync one
    links = near.links
    assert round_s(Shape.AHEAD, 4, 0.1, 0.0, links, 0.5, excess_s=0.01) == pytest.approx(
        round_s(Shape.AHEAD, 4, 0.1, 0.0, links, 0.5) + 0.01, abs=1e-3)
    assert round_s(Shape.SYNC, 4, 0.1, 0.0, links, 0.5, excess_s=0.01) == round_s(Shape.SYNC, 4, 0.1, 0.0, links, 0.5)


def test_the_loop_sends_no_ask_ahead_when_a_quiet_forward_is_due():
    stats = AcceptanceStats()
    weak_traffic(stats)
    controller = session(costs_over(0.0005, 0.0005), stats, [LONG] * 10, overlap=True)
    loop = loop_of(controller)
    loop.draft = _UpDraft()
    block = Block([5, 6], drafter=NGRAM, quality=LONG)
    loop.start_ahead(block)
    assert len(loop.draft.sent) == 1
    for _ in range(QUIET_EVERY):
        controller.costs.observe_verify(3, 0.13, ahead=True)
    loop.aheads = []
    loop.start_ahead(block)
    assert len(loop.draft.sent) == 1  # skipped: this forward runs without an ask


class _UpDraft:
    """Records what the loop sends; each call comes back as a pending task-less call."""

    up = True
    cold = False

    def __init__(self) -> None:
        self.sent = []

    def since_open_s(self) -> float:
        return 1.0

    def send(self, committed, assumed, k, free_k=0, max_branches=1, wait_s=0.0):
        self.sent.append((len(committed), list(assumed), k, free_k))
        return object()


def test_the_bound_on_a_saving_answers_as_the_full_price_does():
    """Where even whole passes would not pay (a loaded target) the per-quality pricing is skipped: same answers."""
    stats = AcceptanceStats()
    weak_traffic(stats)
    costs = costs_over(0.0005, 0.0005)
    mixes = [MOSTLY_WEAK, [LONG, *MOSTLY_WEAK[1:]], [LONG] * 10, [NO_BLOCK] * 5, [SHORT, LONG, quality_of(3, 1)]]
    for returns in mixes:
        for load in (ALONE, Load(2, 1.0), Load(8, 7.0), Load(32, 31.0)):
            controller = session(costs, stats, returns)  # (its returns join every session's: price it alone)
            controller.load = load
            priced_qualities = []
            price = controller.free_acceptance
            controller.free_acceptance = (
                lambda key, n, priced_qualities=priced_qualities, price=price: priced_qualities.append(key)
                or price(key, n))
            full = controller.free_saving_s(NGRAM, 8)
            priced_for_full = len(priced_qualities)
            for needed in (0.0, 0.0005, 0.002, 0.01, 0.05):
                priced = controller.free_saving_s(NGRAM, 8, needed)
                assert (priced > needed) == (full > needed), (returns, load, needed)
                assert priced >= full - 1e-12  # a bound, never below the price
            if load.sessions == 32 and returns != [NO_BLOCK] * 5:
                assert full == 0.0  # 32 rows each widened by the block: no cut pays
                assert len(priced_qualities) == priced_for_full > 0  # each quality priced for ``full`` only
