"""The round policy's interface: fixed K as a policy, the shared probe back-off, deadlines, trees priced in hand."""

import pytest

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.decode.policy.controller import NOTHING, AdaptiveK, Ask, Block, Drafters, FixedK
from specsplit.orchestrator.decode.policy.measure import (
    AcceptanceStats,
    AcceptRule,
    Backoff,
    Costs,
    Forward,
    Load,
    Measurements,
    StatsKey,
)
from specsplit.orchestrator.decode.policy.model import DEADLINE_FLOOR_S

pytestmark = pytest.mark.unit

GREEDY = AcceptRule.of(VerificationMode.GREEDY, 0.0)
MODEL, NGRAM = DrafterKind.MODEL, DrafterKind.NGRAM
PAID = Drafters(MODEL, paid=MODEL)


def measured(step_s=0.05, per_token_s=0.005, draft_s=None) -> Measurements:
    """A target whose forwards of x tokens took step_s + per_token_s (x - 1); a model drafter at ``draft_s``."""
    costs = Costs()
    for x in (1, 2, 5, 9) * 2:
        costs.observe_verify(x, step_s + per_token_s * (x - 1))
    if draft_s is not None:
        costs.observe_draft(4, 4 * draft_s, MODEL)
    return Measurements(costs)


def test_the_back_off_doubles_the_interval_per_probe_up_to_its_longest_and_resets_when_drafting_pays():
    backoff, due = Backoff(), []
    for _ in range(60):
        if backoff.skip(every=4, sessions=1):
            due.append(backoff.skipped)
            backoff.probed(every=4, longest=16)
    assert due == [4, 8, 16, 16, 16]  # 60 rounds
    backoff.paid(every=4)
    assert (backoff.skipped, backoff.interval) == (0, 4)
    assert [backoff.skip(4, sessions=2) for _ in range(8)] == [False] * 7 + [True]  # per session of the batch
    fixed = Backoff()  # longest = every: a constant interval
    for _ in range(3):
        fixed.probed(every=4, longest=4)
    assert fixed.interval == 4


def test_a_verified_block_restarts_its_keys_count_towards_a_probe():
    stats = AcceptanceStats()
    key = StatsKey(MODEL, GREEDY)
    for _ in range(3):
        stats.backoff(key).skip(8, 1)
    stats.observe(key, 2, 1)
    assert stats.backoff(key).skipped == 0


def test_fixed_k_asks_its_k_within_the_rounds_limit_and_ahead_only_of_a_block_with_overlap():
    plain = FixedK(4, measured(), GREEDY, PAID)
    assert plain.plan(10) == Ask(4) and plain.plan(2) == Ask(2) and plain.plan(-1) == NOTHING
    assert plain.plan_ahead(Block([5, 6]), 10) == NOTHING  # no overlap
    overlapped = FixedK(4, measured(), GREEDY, PAID, overlap=True)
    assert overlapped.plan_ahead(Block([5, 6]), 3) == Ask(3)
    assert overlapped.plan_ahead(Block([]), 10) == NOTHING  # a target-only round is not drafted past
    assert FixedK(0, measured(), GREEDY).plan(10).empty  # target-only decoding
    assert overlapped.cut(Block([1, 2, 3], drafter=MODEL)).tokens == [1, 2, 3]  # never cut


def test_every_policy_learns_the_same_from_a_verified_block_but_only_decode_forwards_teach_costs():
    shared = measured()
    fixed = FixedK(4, shared, GREEDY, PAID)
    samples = shared.costs.verify.samples
    busy = Load(4, 3.0, others_tokens=3)
    fixed.observe(Block([1, 2], drafter=MODEL, k=2), 1, [], Forward(0.09, 6, busy, (0.04, 0.01), prefill=True))
    assert shared.acceptance.blocks(StatsKey(MODEL, GREEDY)) == 1.0
    assert shared.costs.reported == (0.04, 0.01)  # the target's own fit, from any forward
    assert fixed.load != busy and shared.costs.verify.samples == samples  # a prefill runs alone by design
    fixed.observe(Block([], k=0), 0, [], Forward(0.06, 4, busy))
    assert fixed.load == shared.costs.load == busy and shared.costs.verify.samples > samples
    adaptive = AdaptiveK(4, shared, GREEDY, PAID)  # a new session starts from the load every session saw
    assert adaptive.load == busy


def test_a_second_guess_is_drafted_only_where_both_requests_come_back_within_the_verification():
    block = Block([5, 6, 7], drafter=MODEL, second_guess=(1, 9))
    unmeasured = FixedK(2, measured(), GREEDY, PAID, overlap=True)
    assert unmeasured.plan_second_guess(block, 4, Ask(2)) == NOTHING  # the draft's cost is not known yet
    cheap = FixedK(2, measured(draft_s=0.001), GREEDY, PAID, overlap=True)
    assert cheap.plan_second_guess(block, 4, Ask(2)) == Ask(2)
    dear = FixedK(2, measured(draft_s=0.02), GREEDY, PAID, overlap=True)  # 5 tokens of 20 ms > a 60 ms verify
    assert dear.plan_second_guess(block, 4, Ask(2)) == NOTHING
    off = FixedK(2, measured(draft_s=0.001), GREEDY, PAID, overlap=True, second_guess=False)
    assert off.plan_second_guess(block, 4, Ask(2)) == NOTHING
    assert cheap.plan_second_guess(Block([5, 6, 7], drafter=MODEL), 4, Ask(2)) == NOTHING  # none offered


def test_a_rounds_wait_for_the_draft_follows_what_is_known_of_its_cost():
    unknown = FixedK(4, Measurements(), GREEDY, PAID, draft_timeout_s=5.0)
    assert unknown.wait_s(4, False, 100, 0.0) == 5.0  # nothing measured: the draft timeout
    known = FixedK(4, measured(draft_s=0.002), GREEDY, PAID)
    assert DEADLINE_FLOOR_S <= known.wait_s(4, False, 100, 0.0) < 0.05
    pinned = FixedK(4, measured(draft_s=0.002), GREEDY, PAID, draft_deadline_s=0.3)
    assert pinned.wait_s(4, False, 100, 0.0) == 0.3
    reading = measured(draft_s=0.002)
    reading.costs.observe_read(100, 1.0, MODEL)  # the draft reads a context in 10 ms a token
    first = FixedK(4, reading, GREEDY, PAID)
    assert first.wait_s(4, True, 100, since_open_s=0.0) == 0.0  # 1 s left to read: more than 4 steps save
    assert 0.0 < first.wait_s(4, True, 100, since_open_s=2.0) <= 4 * 0.05 + DEADLINE_FLOOR_S  # read over


def test_a_far_target_makes_a_tree_in_hand_relatively_cheaper_to_verify():
    """A tree is priced by the round it is verified in, the target's round trip included: the same nodes that
    do not pay next to the target pay when every round costs a long round trip anyway."""
    parents = [-1, 0, 1, -1]
    stats = AcceptanceStats()
    key = StatsKey(MODEL, GREEDY)
    for _ in range(40):
        stats.observe(key, 3, 1)  # first positions pass, deeper ones rarely

    def kept(target_rtt_s: float) -> int:
        shared = measured(step_s=0.05, per_token_s=0.02)
        shared.acceptance = stats
        for _ in range(20):
            shared.costs.links.target.observe(target_rtt_s)
        controller = AdaptiveK(4, shared, GREEDY, PAID)
        return len(controller.cut(Block([1, 2, 3, 4], drafter=MODEL, parents=parents)).tokens)

    assert kept(1.0) > kept(0.0)


def test_the_first_free_drafter_is_the_sessions_own_else_a_chains_first():
    assert Drafters(NGRAM, frozenset({NGRAM})).first_free is NGRAM
    chain = Drafters(DrafterKind.CHAIN, frozenset({DrafterKind.NGRAM}), MODEL)
    assert chain.first_free is NGRAM
    assert Drafters(MODEL, paid=MODEL).first_free is None


def test_no_ask_exceeds_the_sessions_bound_whatever_room_the_round_has():
    """The draft refuses a block over its max block: the round's room (budget, context) is capped by k_max."""
    adaptive = AdaptiveK(8, measured(draft_s=0.0), GREEDY, Drafters(NGRAM, frozenset({NGRAM})))
    asks = [adaptive.plan(100)] + [adaptive.plan_ahead(Block([5, 6], drafter=NGRAM), 100) for _ in range(2)]
    assert all(ask.k <= 8 and ask.free_k <= 8 for ask in asks) and asks[0].free_k == 8
    assert FixedK(8, measured(), GREEDY, PAID).plan(100) == Ask(8)
