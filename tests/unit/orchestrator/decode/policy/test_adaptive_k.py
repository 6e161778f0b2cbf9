"""The K controller: the round model, server-wide acceptance by quality, load, overlap, and the loop's use of them."""

import pytest

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.decode.links import NO_DRAFT
from specsplit.orchestrator.decode.loop import LoopConfig, LoopStats, _Loop
from specsplit.orchestrator.decode.policy.controller import AdaptiveK, Ask, Block, Drafters, FixedK
from specsplit.orchestrator.decode.policy.measure import (
    ALONE,
    AcceptanceStats,
    AcceptRule,
    Costs,
    Load,
    Measurements,
    StatsKey,
    quality_of,
)
from specsplit.orchestrator.decode.policy.model import (
    Shape,
    best_k,
    chain_rounds,
    expected_tokens,
    expected_tokens_by_position,
    rate,
)
from specsplit.orchestrator.decode.replies import DraftedBlock, VerifiedBlock, verified_of
from specsplit.v1 import specsplit_pb2 as pb

pytestmark = pytest.mark.unit

GREEDY = AcceptRule.of(VerificationMode.GREEDY, 0.0)
SAMPLED = AcceptRule.of(VerificationMode.TOKEN_ONLY, 0.7)
MODEL, NGRAM = DrafterKind.MODEL, DrafterKind.NGRAM
SYNC, AHEAD, IN_HAND = Shape.SYNC, Shape.AHEAD, Shape.IN_HAND


def fitted(a=0.05, b=0.006, draft=0.0, widths=(1, 2, 3, 5, 9, 1, 4, 9), drafter=MODEL) -> Costs:
    """Forwards of x tokens cost a + b (x - 1): a decode step costs a."""
    costs = Costs()
    for x in widths:
        costs.observe_verify(x, a + b * (x - 1))
        costs.observe_draft(x - 1, draft * (x - 1), drafter)
    return costs


def cpu_like() -> Costs:
    """A forward costs 62 ms + 20 ms per token over batch sizes 1..64, as SmolLM2 does on one CPU core."""
    return fitted(a=0.062, b=0.02, widths=(1, 2, 5, 9, 8, 16, 32, 64, 9, 1))


def best(accept, limit, costs, load=ALONE, shape=SYNC, draft_s=0.0) -> int:
    """The block size the round model picks for a chain of this acceptance."""
    return best_k(accept, chain_rounds(costs, load, accept, limit, shape, draft_s), load.others_committed)[0]


def chain_rate(k, accept, costs, load=ALONE, shape=SYNC, draft_s=0.0) -> float:
    """The rate of a chain block of k."""
    seconds = chain_rounds(costs, load, accept, k, shape, draft_s)[k]
    return rate(expected_tokens_by_position(accept, k), seconds, load.others_committed)


def paid(costs: Costs, k_max=8, stats=None, **kw) -> AdaptiveK:
    """A session whose drafter (a model) pays per token."""
    return AdaptiveK(k_max, Measurements(costs, stats or AcceptanceStats()), GREEDY, Drafters(MODEL, paid=MODEL), **kw)


def feed(controller: AdaptiveK, rounds, key=None) -> None:
    key = key or controller.key(MODEL)
    for drafted, accepted in rounds:
        controller.record(key, drafted, accepted)


# -- the round model ---------------------------------------------------------------------------------------
def test_cost_model_recovers_a_linear_verify_cost():
    costs = fitted(a=0.05, b=0.006)
    assert costs.verify_s(1) == pytest.approx(0.05, rel=1e-6)
    assert costs.verify_s(11) == pytest.approx(0.11, rel=1e-6)


def test_the_targets_own_fit_stands_in_until_forwards_of_that_kind_are_measured():
    costs = fitted(a=0.05, b=0.006, widths=(1, 2))  # too few forwards of either kind for their own figures
    costs.observe_target_fit(0.0, 0.0)  # a target without a fit yet changes nothing
    assert costs.verify_s(11) == pytest.approx(0.11, rel=1e-6)
    costs.observe_target_fit(0.04, 0.01)
    assert costs.verify_s(10) == pytest.approx(0.14)
    assert costs.verify_s(1) == pytest.approx(0.05)
    for _ in range(3):  # measured one-token forwards: their mean replaces the line at x = 1 only
        costs.observe_verify(1, 0.03)
    assert costs.verify_s(1) < 0.04  # mostly the measured 0.03, not the line's 0.05
    assert costs.verify_s(10) == pytest.approx(0.14)


def test_a_target_step_is_known_roughly_from_the_first_measured_forward_of_any_width():
    """Before a one-token forward is measured or the target reports its fit, a session's first block is waited
    for up to k steps of the line through the wider forwards measured so far, not the draft timeout."""
    costs = Costs()
    assert costs.step_s() is None  # nothing measured: no scale at all
    costs.observe_verify(4, 0.1)
    assert 0.05 < costs.step_s() <= 0.1  # one token costs at most what four did
    for _ in range(3):
        costs.observe_verify(1, 0.06)
    assert costs.step_s() == pytest.approx(0.06)  # measured


def step_costs(one=0.065, two=0.12, nine=0.142) -> Costs:
    """A CPU's forwards: one token takes matrix-vector products, two or more matrix-matrix ones (a step)."""
    costs = Costs()
    costs.observe_target_fit(0.06, 0.01)  # the target's line through every width misses the step
    for _ in range(4):
        for x, t in ((1, one), (2, two), (9, nine), (1, one)):
            costs.observe_verify(x, t)
    return costs


def test_a_one_token_forward_is_priced_apart_from_the_line_through_wider_ones():
    costs = step_costs()
    assert costs.verify_s(1) == pytest.approx(0.065, rel=1e-3)
    assert costs.verify_s(2) == pytest.approx(0.12, rel=1e-3)
    assert costs.verify_s(9) == pytest.approx(0.142, rel=1e-3)
    assert costs.verify_s(5) == pytest.approx(0.12 + 3 * 0.022 / 7, rel=1e-3)


def test_where_leaving_the_one_token_forward_costs_a_step_short_weak_blocks_are_not_verified():
    costs = step_costs()
    # A one-token block passing 7 times in 10: 1.7 tokens in 120 ms is slower than 1 in 65 ms.
    assert best([0.7], 1, costs) == 0
    # Long blocks of the same first position, deeper ones passing 9 in 10, pay for the step.
    assert best([0.7] + [0.9] * 7, 8, costs) == 8
    # On the target's line alone (no forwards measured) the same one-token block looked worth verifying.
    line = Costs()
    line.observe_target_fit(0.06, 0.01)
    assert best([0.7], 1, line) == 1


def test_expected_tokens_matches_leviathan():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    for alpha in (0.0, 0.3, 0.9):  # position-wise with a constant rate is Leviathan's E(k)
        assert expected_tokens_by_position([alpha] * 6, 6) == pytest.approx(expected_tokens(alpha, 6))
    assert expected_tokens_by_position([0.5, 1.0, 0.0], 3) == pytest.approx(1 + 0.5 + 0.5)


def test_alone_the_rate_is_leviathans_tokens_over_time():
    costs = fitted(a=0.05, b=0.006)
    accept = [0.8] * 4
    assert chain_rate(4, accept, costs) == pytest.approx(expected_tokens(0.8, 4) / costs.verify_s(5))


def test_overlap_hides_drafting():
    dear = fitted(a=0.05, b=0.002, draft=0.008)
    accept, draft_s = [0.75] * 16, dear.draft_s_per_token(MODEL)
    assert chain_rate(0, accept, dear, shape=AHEAD, draft_s=draft_s) == chain_rate(0, accept, dear)
    for k in range(1, 6):  # drafting k + 1 ahead (8 ms each) fits within one verification (>= 50 ms)
        assert chain_rate(k, accept, dear, shape=AHEAD, draft_s=draft_s) > chain_rate(k, accept, dear, draft_s=draft_s)
    # a draft slower than the verification is waited for, and on a miss paid again: overlap can lose then
    assert chain_rate(16, accept, dear, shape=AHEAD, draft_s=draft_s) < chain_rate(16, accept, dear, draft_s=draft_s)


def test_k_shrinks_as_load_grows():
    accept = [0.5, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]
    ks = [best(accept, 8, cpu_like(), Load(b, b - 1)) for b in (1, 2, 4, 8, 32)]
    assert ks == sorted(ks, reverse=True) and ks[0] > 0 and ks[-1] == 0


def test_a_block_in_a_packed_forward_adds_its_own_tokens_and_in_a_padded_one_widens_every_row():
    padded, packed = Load(8, 7.0), Load(8, 7.0, others_tokens=7)
    assert [padded.tokens(k) for k in (0, 1, 4)] == [8, 16, 40]
    assert [packed.tokens(k) for k in (0, 1, 4)] == [8, 9, 12]
    assert ALONE.tokens(4) == Load(1, 0.0, others_tokens=0).tokens(4) == 5


def test_the_load_signal_reads_the_forwards_tokens_where_its_rows_were_packed():
    from specsplit.orchestrator.decode.loop import load_of

    packed = VerifiedBlock(0, 0, 0, batch_size=8, batch_width=2, others_committed=9, batch_tokens=13, batch_packed=True)
    assert load_of(packed, fed=3) == Load(8, 9.0, others_tokens=10)
    padded = VerifiedBlock(0, 0, 0, batch_size=8, batch_width=3, others_committed=9, batch_tokens=24)
    assert load_of(padded, fed=3) == Load(8, 9.0)  # padded rows: every row as wide as the widest
    assert load_of(verified_of(pb.VerifyResult()), fed=1) == ALONE  # a result without a forward report: alone


def test_drafting_pays_under_load_where_rows_are_packed_and_not_where_they_are_padded():
    """Eight sessions on cpu_like costs (62 ms + 20 ms a token): drafts that pass 9 times in 10 add 20 ms a token
    to a 202 ms forward packed, but widen all eight rows padded."""
    accept = [0.9] * 8
    assert best(accept, 8, cpu_like(), Load(8, 7.0)) == 0
    assert best(accept, 8, cpu_like(), Load(8, 7.0, others_tokens=7)) > 0


# -- acceptance statistics ------------------------------------------------------------------------------------
def test_a_key_without_evidence_leans_on_its_pool_and_the_pool_on_the_prior():
    stats = AcceptanceStats(prior=0.5)
    key = StatsKey(NGRAM, GREEDY, quality_of(12, 1))
    assert stats.acceptance(key, 4) == pytest.approx([0.5] * 4)
    for _ in range(50):  # blocks of another quality fill the pool
        stats.observe(StatsKey(NGRAM, GREEDY, quality_of(3, 1)), 4, 2)
    pool = stats.acceptance(key.pool, 4)
    assert pool[0] > 0.9 and pool[2] < 0.1  # two of four pass, every time
    assert stats.acceptance(key, 4) == pytest.approx(pool)


def test_a_keys_own_evidence_overrides_its_pool():
    stats = AcceptanceStats()
    good, poor = StatsKey(NGRAM, GREEDY, quality_of(20, 1)), StatsKey(NGRAM, GREEDY, quality_of(1, 3))
    for _ in range(40):
        stats.observe(good, 8, 8)
        stats.observe(poor, 8, 0)
    assert min(stats.acceptance(good, 8)) > 0.9
    assert stats.acceptance(poor, 8)[0] < 0.1


def test_unreached_positions_follow_the_last_measured_one():
    stats = AcceptanceStats()
    key = StatsKey(MODEL, GREEDY)
    for _ in range(30):
        stats.observe(key, 3, 3)  # positions 4..8 never verified
    accept = stats.acceptance(key, 8)
    assert accept[3:] == pytest.approx([accept[2]] * 5) and accept[2] > 0.9


def test_greedy_and_sampled_verification_are_kept_apart():
    stats = AcceptanceStats()
    quality = quality_of(6, 1)
    for _ in range(30):
        stats.observe(StatsKey(NGRAM, GREEDY, quality), 4, 4)
    assert stats.acceptance(StatsKey(NGRAM, SAMPLED, quality), 4) == pytest.approx([stats.prior] * 4)
    assert AcceptRule.of(VerificationMode.TOKEN_ONLY, 0.71) == SAMPLED  # temperatures to 0.1
    assert AcceptRule.of(VerificationMode.GREEDY, 0.7) == GREEDY


def test_quality_buckets_order_match_lengths_and_occurrences():
    lengths = [quality_of(n, 1).length for n in (1, 2, 3, 4, 5, 6, 11, 12, 32)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert quality_of(4, 1) == quality_of(5, 1) != quality_of(6, 1)
    assert quality_of(4, 1) != quality_of(4, 2) == quality_of(4, 9)


def test_empty_blocks_carry_no_evidence_and_bad_counts_are_refused():
    stats = AcceptanceStats()
    key = StatsKey(MODEL, GREEDY)
    stats.observe(key, 0, 0)
    assert stats.blocks(key) == 0.0
    with pytest.raises(ValueError, match="accepted"):
        stats.observe(key, 2, 3)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceStats(prior=1.0)


# -- ask: a drafter that pays per token ------------------------------------------------------------------------
def test_runs_of_acceptance_keep_blocks_long():
    """Copy spans: a round either passes everything or fails at once. Overall acceptance is ~0.5, which
    the i.i.d. model would answer with short blocks; given the first token passed, the rest always do."""
    costs = fitted(a=0.07, b=0.01)
    controller = paid(costs)
    feed(controller, [(8, 8), (8, 0)] * 6)
    accept = controller.paid_acceptance()
    assert accept[0] < 0.65 and min(accept[1:]) > 0.8
    assert controller.ask(8) >= 4 > best([accept[0]] * 8, 8, costs)


def test_high_acceptance_and_cheap_drafts_use_the_bound():
    controller = paid(fitted())
    feed(controller, [(8, 8)] * 10)
    assert controller.ask(8) == 8
    assert controller.ask(3) == 3  # the round's own limit (budget, context) caps it


def test_rejections_switch_speculation_off_then_probe_ever_less_often():
    controller = paid(fitted(b=0.01), probe_every=4, probe_backoff=4)
    feed(controller, [(4, 0)] * 10)
    asked = [controller.ask(8) for _ in range(4 + 8 + 16 + 16 + 16)]
    assert [i + 1 for i, k in enumerate(asked) if k] == [4, 12, 28, 44, 60]  # 4, 8, 16, then 16 apart (4 × 4)
    assert set(asked) == {0, 1}


def test_the_probe_interval_resets_when_drafting_pays_again():
    controller = paid(fitted(b=0.01), probe_every=4)
    feed(controller, [(4, 0)] * 10)
    asked = [controller.ask(8) for _ in range(12)]
    assert [i + 1 for i, k in enumerate(asked) if k] == [4, 12]
    feed(controller, [(8, 8)] * 10)  # its drafts pass now
    assert controller.ask(8) > 0
    feed(controller, [(4, 0)] * 60)  # and fail again: probes start over at probe_every
    asked = [controller.ask(8) for _ in range(4)]
    assert asked == [0, 0, 0, 1]


def test_probes_are_counted_over_every_sessions_rounds():
    """Short sessions one after another: a per-session count would probe each new session after 4 rounds; counted
    server-wide, the interval keeps backing off across them (4, 8, 16, 16 rounds of 6-round sessions)."""
    costs, stats = fitted(b=0.01), AcceptanceStats()
    feed(paid(costs, stats=stats), [(4, 0)] * 10)
    asked = []
    for _ in range(9):
        session = paid(costs, stats=stats, probe_every=4, probe_backoff=4)
        asked += [session.ask(8) for _ in range(6)]
    assert [i + 1 for i, k in enumerate(asked) if k] == [4, 12, 28, 44]


def test_a_session_that_may_overlap_probes_where_only_overlap_pays():
    """A draft nearly as slow as a target step pays only when drafted during verification. After rejections the
    loop asks in sync (overlap stopped paying): a session that may overlap still probes there, since only a probe
    brings back the figures that would start overlap again; a sync-only session has nothing to probe for."""
    costs = fitted(a=0.07, b=0.01, draft=0.06)
    draft_s = costs.draft_s_per_token(MODEL)
    assert best([0.9] * 8, 8, costs, shape=SYNC, draft_s=draft_s) == 0
    assert best([0.9] * 8, 8, costs, shape=AHEAD, draft_s=draft_s) > 0
    for may_overlap, probes in ((True, [4, 12]), (False, [])):
        controller = paid(costs, probe_every=4, overlap=may_overlap)
        feed(controller, [(2, 0)] * 10)
        assert not controller.ahead_pays()
        asked = [controller.ask(8, overlap=False) for _ in range(12)]
        assert [i + 1 for i, k in enumerate(asked) if k] == probes


def test_expensive_draft_shortens_blocks():
    cheap, dear = paid(fitted(draft=0.0), 16), paid(fitted(draft=0.03), 16)
    for c in (cheap, dear):
        feed(c, [(16, 12), (16, 3)] * 10)
    assert 0 < dear.ask(16) < cheap.ask(16)


def test_acceptance_follows_every_verified_block_and_each_caller_gets_its_own_list():
    stats, key = AcceptanceStats(), StatsKey(MODEL, GREEDY)
    first = stats.acceptance(key, 4)
    first[0] = 9.0
    assert stats.acceptance(key, 4) == [0.5] * 4  # the prior: a caller's edit does not stick
    stats.observe(key, 4, 4)
    assert stats.acceptance(key, 4)[0] > 0.5
    stats.observe(StatsKey(NGRAM, GREEDY, quality_of(12, 2)), 4, 0)  # a block of another key moves its own
    assert stats.acceptance(StatsKey(NGRAM, GREEDY), 2)[0] < 0.5


def test_a_new_session_starts_from_what_other_sessions_measured():
    stats, costs = AcceptanceStats(), fitted(b=0.01)
    veteran = paid(costs, stats=stats)
    feed(veteran, [(4, 0)] * 30)  # this drafter's blocks fail on this server
    newcomer = paid(costs, stats=stats)
    assert newcomer.paid_acceptance()[0] < 0.1 and newcomer.ask(8) == 0
    assert paid(costs).ask(8) > 0  # a server without that record would draft
    feed(newcomer, [(8, 8)] * 10)  # its own rounds take over
    assert newcomer.ask(8) > 0


def test_a_session_without_a_paid_drafter_asks_for_nothing():
    controller = AdaptiveK(8, Measurements(fitted()), GREEDY, Drafters(NGRAM, frozenset({NGRAM})))
    assert controller.ask(8) == 0


def test_negative_bound_is_refused():
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(-1, Measurements(), GREEDY)
    with pytest.raises(ValueError, match="k_max"):
        FixedK(-1, Measurements(), GREEDY)


# -- cut: a block drafted for free -----------------------------------------------------------------------------
FREE_NGRAM = Drafters(NGRAM, frozenset({NGRAM}))


def free(costs: Costs, stats: AcceptanceStats, rule=GREEDY, k_max=8, drafters=FREE_NGRAM, **kw) -> AdaptiveK:
    return AdaptiveK(k_max, Measurements(costs, stats), rule, drafters, **kw)


def cut(controller: AdaptiveK, key: StatsKey, available: int, load: Load = ALONE) -> int:
    controller.load = load
    return controller.cut_k(key, available)


def copy_traffic(stats: AcceptanceStats, rule=GREEDY, rounds=40) -> tuple[StatsKey, StatsKey]:
    """Earlier sessions' blocks: long matches pass in runs, one-token matches rarely pass."""
    long_match = StatsKey(NGRAM, rule, quality_of(16, 1))
    short_match = StatsKey(NGRAM, rule, quality_of(1, 3))
    for i in range(rounds):
        stats.observe(long_match, 8, 8 if i % 5 else 2)
        stats.observe(short_match, 4, 1 if i % 8 == 0 else 0)
    return long_match, short_match


def test_a_new_session_cuts_by_quality_as_well_as_a_warm_one():
    stats, costs = AcceptanceStats(), cpu_like()
    long_match, short_match = copy_traffic(stats)
    new = free(costs, stats)
    assert cut(new, long_match, 8) == 8  # no history of its own: the server's record of that quality decides
    assert cut(new, short_match, 8) == 0
    assert cut(new, long_match, 3) == 3  # never more than the block holds
    assert cut(new, long_match, 8, Load(32, 31)) == 0  # under saturation even good copies do not pay


def test_on_a_cheap_verify_a_fair_match_is_worth_one_token():
    """With a CPU-like decode step of ~50 ms and ~6 ms an extra token, a first token passing 1 time in 4
    already pays, deeper ones (1 in 4 times 1 in 4) do not."""
    stats = AcceptanceStats()
    key = StatsKey(NGRAM, GREEDY, quality_of(1, 1))
    for i in range(40):
        stats.observe(key, 4, 1 if i % 4 == 0 else 0)
    assert cut(free(fitted(a=0.05, b=0.006), stats), key, 8) == 1


def test_a_free_blocks_cut_ignores_the_draft_round_trip_it_already_paid():
    """A free block is asked for every round and cut once it is back: a far draft (10 ms round trip beside an
    11 ms forward) makes the block no dearer to verify, so a first token passing 1 time in 4 is still kept, as
    on loopback; a paid drafter's block, not drafted yet, does not pay at that acceptance over that link."""
    stats = AcceptanceStats()
    key = StatsKey(NGRAM, SAMPLED, quality_of(1, 1))
    for i in range(40):
        stats.observe(key, 4, 1 if i % 4 == 0 else 0)
    near, far = fitted(a=0.011, b=0.0001), fitted(a=0.011, b=0.0001)
    for _ in range(20):
        far.links.draft.observe(0.010)
        far.links.target.observe(0.001)
    assert cut(free(near, stats, SAMPLED), key, 4) == cut(free(far, stats, SAMPLED), key, 4) == 1
    accept = stats.acceptance(key, 4)
    assert best(accept, 4, near) == 1 and best(accept, 4, far) == 0


def test_sampled_verification_stops_where_it_does_not_pay():
    """The same copies, verified by sampling (accepted with p(x), here rarely), are not drafted, while greedy
    keeps drafting them: speculation never makes sampled traffic slower."""
    stats, costs = AcceptanceStats(), cpu_like()
    long_match, _ = copy_traffic(stats, GREEDY)
    sampled = StatsKey(NGRAM, SAMPLED, long_match.quality)
    for _ in range(40):
        stats.observe(sampled, 8, 0)
    assert cut(free(costs, stats, GREEDY), long_match, 8) == 8
    assert cut(free(costs, stats, SAMPLED), sampled, 8) == 0


def test_a_session_whose_copies_fail_where_others_pass_stops_verifying_them():
    """Server-wide, long matches pass; this session's (new values after copied keys) fail. After a few misses
    its own record outweighs the server's; another session still verifies the same quality in full."""
    stats, costs = AcceptanceStats(), cpu_like()
    long_match, _ = copy_traffic(stats)
    failing, other = free(costs, stats), free(costs, stats)
    cuts = []
    for _ in range(6):
        cuts.append(cut(failing, long_match, 8))
        if cuts[-1]:
            failing.record(long_match, cuts[-1], 0)
    assert cuts[0] == 8 and cuts[-1] == 0
    assert failing.free_scale() < 0.5
    assert other.free_scale() == 1.0 and cut(other, long_match, 8) == 8
    for _ in range(3):  # blocks that pass as predicted keep a session's scale near 1
        other.record(long_match, 8, 8)
    assert other.free_scale() == pytest.approx(1.0, abs=0.15)


def test_a_quality_cut_to_nothing_is_probed_now_and_then_server_wide():
    stats, costs = AcceptanceStats(), fitted(b=0.01)
    _, short_match = copy_traffic(stats)
    one, other = free(costs, stats, probe_every=4), free(costs, stats, probe_every=4)
    cuts = [cut(c, short_match, 8) for c in (one, other) * 4]  # two sessions share the count
    assert cuts == [0, 0, 0, 1, 0, 0, 0, 1]
    assert [cut(one, short_match, 8, Load(32, 31)) for _ in range(200)] == [0] * 200  # not where it cannot pay


# -- the loop's use of them ----------------------------------------------------------------------------------
def loop_with(controller) -> _Loop:
    cfg = LoopConfig(max_new_tokens=100, eos_ids=frozenset(), max_context=1000)
    return _Loop([1, 2, 3], cfg, NO_DRAFT, LoopStats(), controller)


def reply(tokens, length=0, occurrences=1, drafter=None) -> DraftedBlock:
    return DraftedBlock(0, tokens, match=(length, occurrences) if length else None, drafter=drafter)


def test_a_free_block_is_cut_by_its_quality_and_recorded_under_it():
    stats, costs = AcceptanceStats(), cpu_like()
    long_match, short_match = copy_traffic(stats)
    loop = loop_with(free(costs, stats))
    assert loop.controller.plan(8) == Ask(0, 8)  # nothing asked of a paid drafter, up to 8 of the free one
    block = loop.finish_block(reply(list(range(10, 18)), length=16), k=0)
    assert block.tokens == list(range(10, 18)) and loop.controller.key_of(block) == long_match and block.proposed == 8
    block = loop.finish_block(reply(list(range(10, 18)), length=1, occurrences=3), k=0)
    assert block.tokens == [] and loop.controller.key_of(block) == short_match
    before = stats.blocks(long_match)
    loop.commit(loop.finish_block(reply([5, 6, 7], length=16), 0), VerifiedBlock(0, accepted=2, next_token=9))
    assert stats.blocks(long_match) > before and loop.committed[-3:] == [5, 6, 9]


def test_a_block_drafted_ahead_is_one_token_better_matched_after_its_guess():
    stats = AcceptanceStats()
    loop = loop_with(free(cpu_like(), stats))
    block = loop.finish_block(reply([4, 5, 6, 7], length=5), k=0, guess=4)
    assert block.quality == quality_of(6, 1) and block.tokens[:1] == [5]


def test_blocks_of_paid_drafters_and_fixed_k_sessions_are_not_cut():
    stats, costs = AcceptanceStats(), cpu_like()
    copy_traffic(stats)
    model_loop = loop_with(paid(costs, stats=stats))
    block = model_loop.finish_block(reply([1, 2, 3, 4]), k=4)
    assert block.tokens == [1, 2, 3, 4] and model_loop.controller.key_of(block) == StatsKey(MODEL, GREEDY)
    # a chain's n-gram member is cut even though the session's drafter is a chain
    chain = Drafters(DrafterKind.CHAIN, frozenset({NGRAM}), MODEL)
    chain_loop = loop_with(AdaptiveK(8, Measurements(costs, stats), GREEDY, chain))
    block = chain_loop.finish_block(reply([1, 2, 3, 4], length=1, occurrences=3, drafter=NGRAM), k=4)
    assert block.tokens == [] and block.drafter is NGRAM
    fixed = loop_with(FixedK(8, Measurements(costs, stats), GREEDY, FREE_NGRAM))
    assert fixed.controller.plan(8) == Ask(8, 0)
    assert fixed.finish_block(reply([1, 2], length=1, occurrences=3), 8).tokens == [1, 2]


def test_a_fixed_k_sessions_verified_blocks_count_for_every_session():
    """A fixed-K session's blocks are real evidence: recorded server-wide, a new adaptive session of the same
    drafter starts from them instead of the prior."""
    stats = AcceptanceStats()
    fixed = loop_with(FixedK(3, Measurements(acceptance=stats), GREEDY, Drafters(MODEL, paid=MODEL)))
    for _ in range(20):
        fixed.commit(fixed.finish_block(reply([4, 5, 6]), 3), VerifiedBlock(0, accepted=3, next_token=7))
    assert stats.blocks(StatsKey(MODEL, GREEDY)) > 15
    assert min(paid(cpu_like(), stats=stats).paid_acceptance()[:3]) > 0.8


def test_a_session_joining_a_busy_target_starts_from_its_load():
    """The load comes from decode rounds, shared through the target's cost model: a new session does not
    size its first blocks for a target of its own, and its prefill (a forward alone) does not reset it."""
    stats, costs = AcceptanceStats(), cpu_like()
    long_match, _ = copy_traffic(stats)

    def round_in(loop: _Loop, sessions: int) -> None:
        forward_us = int((0.062 + 0.02 * (sessions - 1)) * 1e6)  # as cpu_like() predicts
        loop.commit(Block([], k=0), VerifiedBlock(0, accepted=0, next_token=7, compute_s=forward_us / 1e6,
                                            batch_size=sessions, others_committed=sessions - 1))

    def cut(loop: _Loop) -> int:
        return len(loop.finish_block(reply(list(range(10, 18)), length=5), k=0).tokens)

    busy = Load(sessions=8, others_committed=7)
    running = loop_with(free(costs, stats))
    round_in(running, 1)  # its prefill
    round_in(running, 8)  # a decode round among 8 sessions
    assert running.controller.load == costs.load == busy

    joining = loop_with(free(costs, stats))
    assert cut(joining) == 0  # alone this block would be verified (below); here it would pad 7 rows
    round_in(joining, 1)  # its prefill ran alone
    assert joining.controller.load == busy and cut(joining) == 0
    assert joining.stats.batch_sizes == [1]  # the stats still record the forward it ran in
    round_in(joining, 1)  # the others finished: its decode round ran alone
    assert joining.controller.load == costs.load == ALONE and cut(joining) > 0
