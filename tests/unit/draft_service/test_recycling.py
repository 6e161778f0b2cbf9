"""The token-recycling drafter: a bounded table token -> the target's best successors, drafted as a tree."""

from __future__ import annotations

import pytest

from specsplit.draft_service.engine import DraftEngine
from specsplit.draft_service.ngram import NgramConfig
from specsplit.draft_service.recycling import RecyclingDrafter, SuccessorTable
from specsplit.lmkit import token_tree
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.lmkit.successors import Successors

pytestmark = pytest.mark.unit


def report(table: dict[int, tuple[int, ...]]) -> Successors:
    k = len(next(iter(table.values())))
    return Successors(k, tuple(table), tuple(i for ids in table.values() for i in ids))


GRAPH = {1: (2, 5, 9), 2: (3, 6, 10), 3: (4, 7, 11), 4: (1, 8, 12), 5: (6, 2, 13), 6: (7, 3, 14)}


def drafter(prompt=(0, 1), shared=None) -> RecyclingDrafter:
    d = RecyclingDrafter(list(prompt), shared)
    d.add_successors(report(GRAPH))
    return d


def test_a_chain_follows_first_successors_from_the_last_token():
    assert drafter().propose(5).tokens == [2, 3, 4, 1, 2]
    assert drafter(prompt=(7,)).propose(5).tokens == []  # nothing known after 7
    assert drafter(prompt=(0, 1)).propose(0).tokens == []


@pytest.mark.parametrize("k,branches,nodes", [(4, 3, 8), (3, 2, 5), (6, 4, 16), (2, 8, 3)])
def test_a_tree_keeps_its_bounds_and_its_primary_chain_is_the_first_choices(k, branches, nodes):
    block = drafter().propose_tree(k, branches, nodes)
    parents = block.parents or token_tree.chain_parents(len(block.tokens))
    token_tree.check_parents(parents, len(block.tokens))
    assert len(block.tokens) <= nodes and max(token_tree.depths(parents)) < k
    leaves = sum(1 for kids in token_tree.children(parents)[1:] if not kids)
    assert leaves <= branches
    for siblings in token_tree.children(parents):  # siblings carry distinct tokens: the target refuses others
        assert len({block.tokens[i] for i in siblings}) == len(siblings)
    for i, parent in enumerate(parents):  # every node is a known successor of its parent's token
        assert block.tokens[i] in GRAPH[1 if parent == -1 else block.tokens[parent]]
    primary = [block.tokens[i] for i in token_tree.primary_chain(parents)]
    assert primary == [2, 3, 4, 1, 2, 3][: len(primary)] and primary


def test_a_wider_tree_spends_its_nodes_where_the_priors_say():
    """Scores: 2 (first choice) 1/2, then 5 and 2 -> 3 1/4 each, then 9, 2 -> 6 and 5 -> 6 1/8 each: best first."""
    block = drafter().propose_tree(3, 4, 6)
    assert (block.tokens, block.parents) == ([2, 5, 3, 9, 6, 6], [-1, -1, 0, -1, 0, 1])


def test_the_sessions_own_table_comes_before_its_callers():
    shared = SuccessorTable(100)
    shared.update(report({1: (9, 9 + 1)}))
    mine = RecyclingDrafter([0, 1], shared)
    assert mine.propose(1).tokens == [9]  # the shared table is warm before the session reported anything
    mine.add_successors(report({1: (2, 3)}))
    assert mine.propose(1).tokens == [2]
    other = RecyclingDrafter([1], shared)
    assert other.propose(1).tokens == [2]  # what one session reported reaches the caller's other sessions


def test_tables_are_bounded_dropping_the_least_recently_reported():
    table = SuccessorTable(3)
    for token in range(10):
        table.update(report({token: (token + 1,)}))
    table.update(report({8: (99,)}))
    assert len(table) == 3 and table.get(6) is None and table.get(8) == (99,)
    table.update(report({20: (1,), 21: (2,)}))
    assert table.get(9) is None and table.get(8) == (99,)  # 8 was reported later than 9
    with pytest.raises(ValueError, match="at least one token"):
        SuccessorTable(0)


def test_rollback_and_extend_move_where_drafts_start():
    d = drafter(prompt=(0, 1, 2))
    assert d.propose(1).tokens == [3]
    d.commit(2, [5])
    assert d.position == 3 and d.propose(2).tokens == [6, 7]


def test_the_engine_keeps_one_table_per_caller_and_forwards_reports():
    engine = DraftEngine(None, limits=SessionLimits(max_block=8), successor_table_tokens=50)
    assert DrafterKind.RECYCLING in engine.drafters
    traits = {t.kind: t for t in engine.traits}
    assert traits[DrafterKind.RECYCLING].successors_k > 0 and traits[DrafterKind.NGRAM].successors_k == 0
    opened = {}
    for name, caller in (("a1", "alice"), ("a2", "alice"), ("b1", "bob")):
        opened[name] = engine.open(name, [0, 1], SamplingParams(), DrafterKind.RECYCLING, False, NgramConfig(),
                                   caller=caller)
    assert opened["a1"].free  # no model: served on the event loop
    first = engine.propose(opened["a1"], 2, [], 3, successors=[report(GRAPH)]).proposal
    assert first.tokens == [2, 3, 4]
    assert engine.propose(opened["a2"], 2, [], 2).proposal.tokens == [2, 3]  # alice's other session
    assert engine.propose(opened["b1"], 2, [], 2).proposal.tokens == []  # bob learns nothing from alice's text
    assert engine.successor_tables["alice"].capacity == 50


def test_without_a_shared_table_each_session_drafts_from_its_own_reports():
    engine = DraftEngine(None, limits=SessionLimits(max_block=8), successor_table_tokens=0)
    first, second = (engine.open(name, [0, 1], SamplingParams(), DrafterKind.RECYCLING, False, NgramConfig())
                     for name in ("s1", "s2"))
    assert engine.propose(first, 2, [], 2, successors=[report(GRAPH)]).proposal.tokens == [2, 3]
    assert engine.propose(second, 2, [], 2).proposal.tokens == [] and not engine.successor_tables
