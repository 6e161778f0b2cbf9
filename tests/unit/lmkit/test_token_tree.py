"""Token trees: the pure layout (parents, depths, masks, positions, merging) and the greedy tree verifier."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import token_tree
from specsplit.target_service.rejection import verify_greedy, verify_token_only
from specsplit.target_service.tree_verify import uniform_columns, verify_tree_greedy, verify_tree_token_only

pytestmark = pytest.mark.unit

# 0:a ─ 1:b ─ 2:c            (the primary chain a b c, then d under c)
#   │     └── 6:d
#   └─ 5:e                  (e: a sibling of b)
# 3:x ─ 4:y                  (x: a second child of the context)
TOKENS = [10, 11, 12, 20, 21, 13, 14]
PARENTS = [-1, 0, 1, -1, 3, 0, 2]


def test_layout_of_a_tree():
    token_tree.check_parents(PARENTS, 7)
    assert token_tree.depths(PARENTS) == [0, 1, 2, 0, 1, 1, 3]
    assert token_tree.children(PARENTS) == [[0, 3], [1, 5], [2], [6], [4], [], [], []]
    assert token_tree.ranks(PARENTS) == [0, 0, 0, 1, 0, 1, 0]
    assert token_tree.primary_chain(PARENTS) == [0, 1, 2, 6]
    assert token_tree.path_to(PARENTS, 6) == [0, 1, 2, 6] and token_tree.path_to(PARENTS, 4) == [3, 4]
    assert not token_tree.is_chain(PARENTS) and token_tree.is_chain(token_tree.chain_parents(4))


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2], [-1, 0, 5]])
def test_bad_parents_are_refused(parents):
    with pytest.raises(ValueError, match="parent"):
        token_tree.check_parents(parents, len(parents))
    with pytest.raises(ValueError, match="entries"):
        token_tree.check_parents([-1], 2)


def test_each_node_attends_to_its_ancestors_and_itself():
    mask = token_tree.ancestor_mask(PARENTS)
    for i in range(len(PARENTS)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(token_tree.path_to(PARENTS, i))


def test_step_layout_places_nodes_by_depth_after_a_causal_tail():
    positions, mask = token_tree.step_layout(start=5, tail=2, parents=[-1, 0, -1])
    assert positions == [5, 6, 7, 8, 7]
    assert mask.shape == (5, 10)
    assert mask[:, :5].all()  # everything sees the cache
    assert mask[0, 5:].tolist() == [True, False, False, False, False]  # the tail is causal
    assert mask[1, 5:].tolist() == [True, True, False, False, False]
    assert mask[3, 5:].tolist() == [True, True, True, True, False]  # node 1 sees the tail, node 0 and itself
    assert mask[4, 5:].tolist() == [True, True, False, False, True]  # node 2 does not see its cousins


def test_a_chain_layout_is_causal():
    positions, mask = token_tree.step_layout(start=3, tail=1, parents=token_tree.chain_parents(4))
    assert positions == list(range(3, 8))
    assert torch.equal(mask, torch.ones(5, 8, dtype=torch.bool).tril(diagonal=3))


def test_merge_shares_prefixes_and_keeps_the_first_sequence_as_primary():
    tokens, parents = token_tree.merge([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]])
    assert tokens == [1, 2, 3, 4, 5, 6]
    assert parents == [-1, 0, 1, 1, 0, -1]
    assert token_tree.primary_chain(parents) == [0, 1, 2]


def test_subtree_reindexes_and_refuses_orphans():
    assert token_tree.subtree(TOKENS, PARENTS, [0, 5, 3]) == ([10, 20, 13], [-1, -1, 0])
    with pytest.raises(ValueError, match="without its parent"):
        token_tree.subtree(TOKENS, PARENTS, [0, 2])


def test_below_keeps_a_nodes_descendants_rerooted():
    tokens, parents = token_tree.merge([[7, 1, 2], [7, 1, 3, 4], [8, 5], [7, 6]])
    assert tokens == [7, 1, 2, 3, 4, 8, 5, 6]
    assert token_tree.below(tokens, parents, 0) == ([1, 2, 3, 4, 6], [-1, 0, 0, 2, -1])
    assert token_tree.below(tokens, parents, 5) == ([5], [-1])
    assert token_tree.below(tokens, parents, 7) == ([], [])


def _logits_choosing(choices: list[int], vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def _tree_logits(argmax_after: dict[int, int]) -> torch.Tensor:
    """Row 0 after the context (key -1), row i + 1 after node i; unspecified rows choose token 0."""
    return _logits_choosing([argmax_after.get(node, 0) for node in range(-1, len(TOKENS))])


@pytest.mark.parametrize(
    "argmax_after, path, next_token",
    [
        ({-1: 10, 0: 11, 1: 12, 2: 14, 6: 30}, [0, 1, 2, 6], 30),  # the whole primary chain, then the bonus
        ({-1: 10, 0: 13, 5: 31}, [0, 5], 31),  # the sibling e, then the bonus after the leaf
        ({-1: 20, 3: 21, 4: 9}, [3, 4], 9),  # the second root
        ({-1: 10, 0: 11, 1: 7}, [0, 1], 7),  # c rejected: 7 recovered
        ({-1: 8}, [], 8),  # nothing accepted
    ],
)
def test_greedy_tree_follows_the_argmax(argmax_after, path, next_token):
    verdict = verify_tree_greedy(_tree_logits(argmax_after), torch.tensor(TOKENS), PARENTS)
    assert (verdict.path, verdict.next_token, verdict.accepted) == (path, next_token, len(path))


def test_a_chain_tree_agrees_with_verify_greedy():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        logits = torch.randn(k + 1, 5, generator=gen)
        tokens = torch.randint(0, 5, (k,), generator=gen)
        tree = verify_tree_greedy(logits, tokens, token_tree.chain_parents(k))
        chain = verify_greedy(logits, tokens)
        assert (tree.accepted, tree.next_token) == (chain.accepted, chain.next_token)
        assert tree.path == list(range(chain.accepted))


def test_tree_verifier_checks_its_input():
    with pytest.raises(ValueError, match="same token"):
        verify_tree_greedy(_logits_choosing([0, 0, 0]), torch.tensor([4, 4]), [-1, -1])
    with pytest.raises(ValueError, match=r"\[n\+1, vocab\]"):
        verify_tree_greedy(_logits_choosing([0, 0]), torch.tensor([4, 5]), [-1, -1])
    with pytest.raises(ValueError, match="NaN"):
        verify_tree_greedy(torch.full((2, 4), float("nan")), torch.tensor([1]), [-1])


def test_a_chain_tree_samples_as_verify_token_only():
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        probs = torch.softmax(torch.randn(k + 1, 5, generator=gen) * 2, dim=-1)
        tokens = torch.randint(0, 5, (k,), generator=gen)
        uniforms = torch.rand(k + 1, 2, dtype=torch.float64, generator=gen)
        tree = verify_tree_token_only(probs, tokens, token_tree.chain_parents(k), uniforms)
        chain = verify_token_only(probs, tokens, uniforms)
        assert (tree.accepted, tree.next_token) == (chain.accepted, chain.next_token)


def test_siblings_are_tried_in_turn_against_the_residual():
    # p after the context: token 1: 0.5, token 2: 0.3, token 3: 0.2; the children are 1, then 2 (both leaves)
    probs = torch.tensor([[0.0, 0.5, 0.3, 0.2], [0.25] * 4, [0.0, 0.0, 0.0, 1.0]])
    tokens, parents = torch.tensor([1, 2]), [-1, -1]
    assert uniform_columns(parents) == 3

    def verdict(accept_first, sample, accept_second):
        uniforms = torch.tensor([[accept_first, sample, accept_second], [0.1, 0.99, 0.1]], dtype=torch.float64)
        result = verify_tree_token_only(probs, tokens, parents, uniforms)
        return result.path, result.next_token

    assert verdict(0.49, 0.5, 0.9) == ([0], 3)  # u < 0.5: token 1, then the bonus after it (u = 0.99 of uniform)
    # 1 rejected; token 2 holds 0.3 of the remaining 0.5: accepted iff u < 0.6; its bonus is token 3 surely
    assert verdict(0.51, 0.5, 0.59) == ([1], 3)
    assert verdict(0.51, 0.5, 0.61) == ([], 3)  # both rejected: the residual holds token 3 alone


def test_tree_sampling_checks_its_draws():
    probs = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match=r"uniforms must be \[2, 3\]"):
        verify_tree_token_only(probs, torch.tensor([1, 2]), [-1, -1], torch.full((2, 2), 0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="not 1"):
        verify_tree_token_only(probs * 2, torch.tensor([1, 2]), [-1, -1], torch.full((2, 3), 0.5, dtype=torch.float64))
