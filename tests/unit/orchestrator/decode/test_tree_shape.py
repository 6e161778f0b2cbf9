"""Choosing which drafted tree nodes to verify, and the drafters' token trees."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.draft_service.chain import ChainDrafter
from specsplit.draft_service.ngram import NgramConfig, NgramDrafter
from specsplit.lmkit import token_tree
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.orchestrator.decode.links import DraftCall
from specsplit.orchestrator.decode.loop import LoopConfig, LoopStats, _Ahead, _Loop
from specsplit.orchestrator.decode.policy.controller import FixedK
from specsplit.orchestrator.decode.policy.measure import AcceptRule, Measurements, SiblingStats
from specsplit.orchestrator.decode.policy.model import choose_nodes, node_acceptance, path_probabilities
from specsplit.orchestrator.decode.replies import DraftedBlock

pytestmark = pytest.mark.unit

# primary chain 0-1-2, a sibling 3 of node 0, a child 4 of node 3
PARENTS = [-1, 0, 1, -1, 3]


def linear(a: float, s: float):
    return lambda n: a + s * (n + 1)  # t of a forward over the block plus the last committed token


def test_path_probabilities_multiply_down_the_tree():
    assert path_probabilities(PARENTS, [0.8, 0.5, 0.5, 0.1, 1.0]) == pytest.approx([0.8, 0.4, 0.2, 0.1, 0.1])


def test_a_flat_cost_keeps_every_useful_node_and_a_steep_one_keeps_a_chain_or_nothing():
    accept = [0.9, 0.8, 0.7, 0.3, 0.9]
    assert choose_nodes(PARENTS, accept, linear(1.0, 0.001)) == [0, 1, 2, 3, 4]
    # each node costs 0.25 of a forward's fixed part: only nodes with P > ~0.25 x the rate pay
    assert choose_nodes(PARENTS, accept, linear(1.0, 0.25)) == [0, 1, 2]
    assert choose_nodes(PARENTS, accept, linear(1.0, 10.0)) == []  # saturated target: no draft at all


def test_the_choice_is_the_best_rate_over_every_subtree():
    accept = [0.6, 0.9, 0.2, 0.35, 0.5]
    cost = linear(1.0, 0.3)

    def rate(nodes):
        probs = path_probabilities(PARENTS, accept)
        return (1 + sum(probs[i] for i in nodes)) / cost(len(nodes))

    subtrees = [
        [i for i in range(5) if mask >> i & 1] for mask in range(32)
        if all(PARENTS[i] == -1 or mask >> PARENTS[i] & 1 for i in range(5) if mask >> i & 1)
    ]
    best = max(subtrees, key=rate)
    assert rate(choose_nodes(PARENTS, accept, cost)) == pytest.approx(rate(best))


def test_other_sessions_commits_make_a_block_dearer():
    accept = [0.5, 0.5, 0.5, 0.2, 0.5]
    alone = choose_nodes(PARENTS, accept, linear(1.0, 0.2))
    loaded = choose_nodes(PARENTS, accept, linear(1.0, 0.2), others=6.0)
    assert len(loaded) < len(alone)


def test_choose_nodes_checks_its_input():
    with pytest.raises(ValueError, match="estimates"):
        choose_nodes(PARENTS, [0.5], linear(1, 0))
    with pytest.raises(ValueError, match="probabilities"):
        choose_nodes([-1], [1.5], linear(1, 0))


def test_sibling_stats_learn_which_siblings_the_target_takes():
    stats = SiblingStats(prior=0.1, prior_weight=1.0, decay=1.0)
    for _ in range(9):
        stats.observe(PARENTS, [3, 4])  # the target took the second root, rank 1 at depth 0
    stats.observe(PARENTS, [0, 1])
    assert stats.acceptance(1, 0) == pytest.approx((9 + 0.1) / (10 + 1))
    assert stats.acceptance(1, 3) == pytest.approx(0.1)  # never seen: the prior
    chain = [0.7, 0.6, 0.5]
    assert node_acceptance(PARENTS, chain, stats) == pytest.approx([0.7, 0.6, 0.5, stats.acceptance(1, 0), 0.6])


def _ngram(tokens, k_min=1, k_max=3):
    return NgramDrafter(NgramConfig(k_min, k_max), tokens)


def test_ngram_tree_merges_earlier_matches_with_the_chain_first():
    # "7 8" occurred three times, followed by 1 2, then 1 3, then 5 6
    context = [7, 8, 5, 6, 0, 7, 8, 1, 3, 0, 7, 8, 1, 2, 0, 7, 8]
    drafter = _ngram(context, 2, 2)
    tree = drafter.propose_tree(k=2, max_branches=4, max_nodes=32)
    assert drafter.propose(2).tokens == [1, 2]
    assert tree.tokens == [1, 2, 3, 5, 6] and tree.parents == [-1, 0, 0, -1, 3]
    assert [tree.tokens[i] for i in token_tree.primary_chain(tree.parents)] == [1, 2]
    assert drafter.propose_tree(k=2, max_branches=2, max_nodes=32).tokens == [1, 2, 3]
    capped = drafter.propose_tree(k=2, max_branches=4, max_nodes=4)
    assert capped.tokens == [1, 2, 3, 5] and capped.parents == [-1, 0, 0, -1]


def test_ngram_tree_of_one_continuation_is_a_chain():
    drafter = _ngram([1, 2, 3, 9, 1, 2])
    block = drafter.propose_tree(k=3, max_branches=4, max_nodes=32)
    assert block.tokens == [3, 9, 1] and block.parents is None
    assert _ngram([1, 2, 3]).propose_tree(3, 4, 32).tokens == []


def test_a_free_drafters_tree_is_as_deep_as_its_free_bound_and_carries_its_match_quality():
    context = [7, 8, 5, 6, 0, 7, 8, 1, 3, 0, 7, 8, 1, 2, 0, 7, 8]
    drafter = _ngram(context, 2, 2)
    tree = drafter.propose_tree_within(k=0, free_k=2, max_branches=4, max_nodes=32)  # nothing asked of a paid drafter
    assert tree.tokens == [1, 2, 3, 5, 6] and tree.quality == drafter.propose(2).quality
    chain = ChainDrafter([(DrafterKind.NGRAM, _ngram(context, 2, 2))])
    assert chain.propose_tree_within(0, 2, 4, 32).tokens == tree.tokens
    one = _ngram([1, 2, 3, 9, 1, 2]).propose_tree_within(0, 3, 4, 32)  # a single match: propose's own block
    assert one == _ngram([1, 2, 3, 9, 1, 2]).propose(3) and one.quality is not None


def test_a_chain_drafter_passes_its_members_tree_on():
    context = [7, 8, 1, 0, 7, 8, 2, 0, 7, 8]
    chain = ChainDrafter([(DrafterKind.NGRAM, _ngram(context, 2, 2))])
    block = chain.propose_tree(k=2, max_branches=3, max_nodes=8)
    assert block.tokens == [2, 0, 1, 0] and block.parents == [-1, 0, -1, 2]
    assert chain.last_kind is DrafterKind.NGRAM


class _Answered:
    """A draft link whose reply is already in: ``receive`` returns it."""

    def __init__(self, reply: DraftedBlock) -> None:
        self.reply = reply

    async def receive(self, call: DraftCall) -> DraftedBlock:
        return self.reply

    def take_costs(self) -> list:
        return []


def _take_ahead(reply: DraftedBlock, bonus: int):
    """Drafted during the verification of [5, 6] at position 3, assuming it accepted whole; the target accepts
    it and commits ``bonus``."""

    async def go():
        config = LoopConfig(max_new_tokens=100, eos_ids=frozenset(), max_context=1000, tree_branches=4)
        controller = FixedK(8, Measurements(), AcceptRule.of(VerificationMode.GREEDY, 0.0))
        loop = _Loop([1, 2, 3], config, _Answered(reply), LoopStats(), controller)
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(reply)
        loop.aheads = [_Ahead(DraftCall(answered, 0.0, 5, 0.0), 3, [5, 6], 3, guess=True)]
        loop.committed += [5, 6, bonus]
        return await loop.take_ahead()

    return asyncio.run(go())


def test_a_tree_drafted_ahead_is_used_below_the_bonus_guess_that_came_true():
    # two guesses of the bonus token, 7 and 8, each with what the draft would say after it
    tree = DraftedBlock(position=5, tokens=[7, 1, 2, 8, 3, 4], parents=[-1, 0, 1, -1, 3, 0])
    seven = _take_ahead(tree, 7)
    assert (seven.tokens, seven.parents) == ([1, 2, 4], [-1, 0, -1])
    eight = _take_ahead(tree, 8)
    assert (eight.tokens, eight.parents) == ([3], [])  # a chain below that guess
    assert _take_ahead(tree, 9) is None  # no guess came true: the round drafts afresh
    chain = DraftedBlock(position=5, tokens=[7, 1, 2])
    assert _take_ahead(chain, 7).tokens == [1, 2] and _take_ahead(chain, 8) is None
