"""The loop, not the draft link, talks to the controller: it gives each request its wait and hands on what every
reply cost (``ask_draft``, ``learn_draft_costs``)."""

from __future__ import annotations

import pytest

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.decode.loop import ask_draft, learn_draft_costs
from specsplit.orchestrator.decode.policy.controller import Drafters, FixedK
from specsplit.orchestrator.decode.policy.measure import AcceptRule, Measurements
from specsplit.orchestrator.decode.replies import DraftedBlock, DraftReplyCost

pytestmark = pytest.mark.unit


class _Link:
    """A draft link as the loop sees it: what it was sent, and the costs of the replies it holds."""

    def __init__(self, up: bool = True, cold: bool = False, costs=()) -> None:
        self.up, self.cold = up, cold
        self.costs = list(costs)
        self.sent = []

    def since_open_s(self) -> float:
        return 10.0

    def send(self, committed, assumed, k, free_k=0, max_branches=1, wait_s=0.0):
        self.sent.append((len(committed), list(assumed), k, free_k, max_branches, wait_s))
        return object()

    def take_costs(self):
        costs, self.costs = self.costs, []
        return costs


def _controller(session=DrafterKind.MODEL) -> FixedK:
    return FixedK(4, Measurements(), AcceptRule.of(VerificationMode.GREEDY, 0.0), Drafters(session, paid=session))


def test_a_request_goes_out_with_the_wait_the_controller_gives_its_reply():
    controller = _controller()
    link = _Link()
    ask_draft(link, controller, [1, 2, 3], [4], 3, 0, 2)
    expected = controller.wait_s(3, False, 4, 10.0)
    assert expected > 0  # nothing measured yet: a reply is waited for (up to the draft's timeout)
    assert link.sent == [(3, [4], 3, 0, 2, expected)]


def test_a_session_first_request_is_priced_as_a_cold_one():
    controller = _controller()
    controller.costs.observe_read(4, 100.0, DrafterKind.MODEL)  # 25 s a context token: the read outlasts any saving
    warm, cold = _Link(), _Link(cold=True)
    ask_draft(warm, controller, [1, 2, 3, 4], [], 4)
    ask_draft(cold, controller, [1, 2, 3, 4], [], 4)
    assert cold.sent[0][-1] != warm.sent[0][-1]
    assert cold.sent[0][-1] == controller.wait_s(4, True, 4, 10.0)


def test_a_draft_that_is_down_is_asked_without_a_wait():
    link = _Link(up=False)
    ask_draft(link, _controller(), [1, 2, 3], [], 4)
    assert link.sent == [(3, [], 4, 0, 1, 0.0)]  # the link re-attaches in the background and returns None


def test_every_reply_cost_reaches_the_controller_once_with_its_drafter_and_read():
    controller = _controller()
    chained = DraftedBlock(5, [7, 8], drafter=DrafterKind.NGRAM, compute_s=0.002)
    own = DraftedBlock(3, [9, 9, 9], compute_s=0.006)
    first = DraftedBlock(3, [1], compute_s=0.5, read_s=0.4)
    link = _Link(costs=[DraftReplyCost(first, 0.6, read=(3, 0.4)), DraftReplyCost(chained, 0.003),
                        DraftReplyCost(own, 0.007)])
    assert not controller.costs.draft_measured
    learn_draft_costs(link, controller)
    costs = controller.costs
    assert costs.read_s(3, DrafterKind.MODEL) == pytest.approx(0.4)  # the first reply taught the read, not a price
    assert costs.draft_s_per_token(DrafterKind.NGRAM) == pytest.approx(0.001)  # the chain member it named
    assert costs.draft_s_per_token(DrafterKind.MODEL) == pytest.approx(0.002)  # the session's own drafter
    learn_draft_costs(link, controller)  # taken once: nothing is counted twice
    assert costs.draft_s_per_token(DrafterKind.MODEL) == pytest.approx(0.002)


def test_a_reply_sent_behind_another_teaches_its_cost_but_not_the_links_round_trip():
    controller = _controller()
    behind = DraftedBlock(3, [9, 9, 9], compute_s=0.006)
    learn_draft_costs(_Link(costs=[DraftReplyCost(behind, None)]), controller)
    assert controller.costs.draft_s_per_token(DrafterKind.MODEL) == pytest.approx(0.002)
    assert controller.costs.links.draft.samples == 0
    learn_draft_costs(_Link(costs=[DraftReplyCost(behind, 0.007)]), controller)
    assert controller.costs.links.draft.samples == 1 and controller.costs.links.draft.srtt == pytest.approx(0.001)

