"""The target engine verifies token trees: greedy output stays the target's own, caches stay exact.

Random trees around the target's own greedy continuation (the right path
present or not, as any branch), solo and batched; after every round the
session's cache holds its committed tokens but the last, with the keys/values
a fresh cache would compute for them, and nothing else after a tree (a chain's
rejected tail is cropped lazily, by the next round's plan).
"""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.lmkit import errors, models, token_tree
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem
from tests.conftest import reference_greedy

pytestmark = pytest.mark.unit

PROMPTS = [[1, 400, 2000, 31, 77], [5, 6, 7, 8, 9, 10, 11], [42] * 3]
NEW = 30


@pytest.fixture(scope="module")
def stock(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


@pytest.fixture(scope="module")
def engine(tiny_target_dir):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=32))


@pytest.fixture(scope="module")
def expected(stock):
    return [reference_greedy(stock, prompt, NEW + 12) for prompt in PROMPTS]


def random_tree(rng: random.Random, truth: list[int]) -> tuple[list[int], list[int]]:
    """A few continuations, one of them a prefix of the truth with a wrong tail (sometimes none), merged."""
    sequences = []
    for _ in range(rng.randint(1, 4)):
        sequences.append([rng.randrange(49152) for _ in range(rng.randint(1, 4))])
    if rng.random() < 0.8:
        good = rng.randint(1, 5)
        sequences.insert(rng.randrange(len(sequences) + 1), truth[:good] + [rng.randrange(49152)])
    return token_tree.merge(sequences)


def holds_committed(cache, tokens: list[int], tree: bool) -> bool:
    """The cache holds the committed tokens but the last; after a tree (``keep_path``) nothing more."""
    cached = cache.tokens if tree else cache.tokens[: len(tokens) - 1]
    return cached == tokens[:-1] and cache.kv.length == len(cache.tokens)


def check_cache(session, stock, tree: bool) -> None:
    """``holds_committed``, and the cache equals a fresh cache over the committed tokens."""
    cache = session.cache
    assert holds_committed(cache, session.tokens, tree)
    following = [*session.tokens, 3]
    torch.testing.assert_close(cache.logits(following, [5]), SessionCache(stock).logits(following, [5]), rtol=0, atol=1e-4)
    cache.crop(len(session.tokens) - 1)


def test_random_trees_commit_the_targets_greedy_output(engine, stock, expected):
    rng = random.Random(0)
    branch_accepted = 0
    for i, (prompt, want) in enumerate(zip(PROMPTS, expected)):
        session = engine.open(f"solo-{i}", prompt, SamplingParams(), VerificationMode.GREEDY)
        try:
            while len(session.tokens) - len(prompt) < NEW:
                done = len(session.tokens) - len(prompt)
                tokens, parents = random_tree(rng, want[done:])
                result = engine.verify(session, len(session.tokens), tokens, None, parents)
                if result.path:
                    assert list(result.path) == token_tree.path_to(parents, result.path[-1])
                    branch_accepted += list(result.path) != token_tree.primary_chain(parents)[: result.accepted]
                assert session.tokens[len(prompt):] == want[: len(session.tokens) - len(prompt)]
                check_cache(session, stock, not token_tree.is_chain(parents))
        finally:
            engine.close(f"solo-{i}")
    assert branch_accepted > 0  # some rounds accepted a branch that was not the primary chain


def test_trees_of_several_sessions_in_one_forward(engine, expected):
    rng = random.Random(1)
    sessions = [engine.open(f"b-{i}", p, SamplingParams(), VerificationMode.GREEDY) for i, p in enumerate(PROMPTS)]
    try:
        for _ in range(6):
            items, trees = [], []
            for session, prompt, want in zip(sessions, PROMPTS, expected):
                tokens, parents = random_tree(rng, want[len(session.tokens) - len(prompt):])
                items.append(VerifyItem(session, len(session.tokens), tokens, None, parents))
                trees.append(not token_tree.is_chain(parents))
            results = engine.verify_batch(items)
            assert all(not isinstance(r, Exception) for r in results)
            assert {r.batch.size for r in results} == {3}
            assert all(holds_committed(s.cache, s.tokens, tree) for s, tree in zip(sessions, trees))
        for session, prompt, want in zip(sessions, PROMPTS, expected):
            assert session.tokens[len(prompt):] == want[: len(session.tokens) - len(prompt)]
    finally:
        for i in range(len(PROMPTS)):
            engine.close(f"b-{i}")


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([1, 2], [-1, 5], "parent must come before"),
        ([1, 2], [-1], "one parent index per token"),
        ([1, 1], [-1, -1], "same token"),
    ],
)
def test_bad_trees_are_refused(engine, tokens, parents, message):
    session = engine.open("bad", [1, 2, 3], SamplingParams(), VerificationMode.GREEDY)
    try:
        with pytest.raises(errors.InvalidArgument, match=message):
            engine.verify(session, 3, tokens, None, parents)
        assert session.tokens == [1, 2, 3]  # nothing committed, the session still serves
        engine.verify(session, 3, [4, 5], None, [-1, -1])
    finally:
        engine.close("bad")


def test_trees_need_a_tree_mode_and_the_packed_forward(engine, tiny_target_dir):
    session = engine.open("s", [1, 2, 3], SamplingParams(temperature=0.8), VerificationMode.DRAFT_PROBS)
    try:
        with pytest.raises(errors.InvalidArgument, match="GREEDY, TOKEN_ONLY and COUPLED modes; DRAFT_PROBS takes chains"):
            engine.verify(session, 3, [4, 5], torch.full((2, 49152), 1 / 49152), [-1, -1])
    finally:
        engine.close("s")
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    stock_engine = TargetEngine(model, model_id="t", vocab_fingerprint="", limits=SessionLimits(), fast_forward=False)
    assert not stock_engine.verifies_trees and engine.verifies_trees
    session = stock_engine.open("s", [1, 2, 3], SamplingParams(), VerificationMode.GREEDY)
    with pytest.raises(errors.InvalidArgument, match="token trees"):
        stock_engine.verify(session, 3, [4, 5], None, [-1, -1])
    assert stock_engine.verify(session, 3, [4, 5], None, [-1, 0]).accepted in (0, 1, 2)  # a chain is fine


def test_the_model_drafters_tree_leaves_nothing_behind_whichever_branch_wins(tiny_draft_dir):
    from specsplit.draft_service.model_drafter import ModelDrafter

    model = models.load_model(models.ModelSpec(str(tiny_draft_dir)))
    prompt = [1, 400, 2000, 31, 77]
    drafter = ModelDrafter(model, prompt, SamplingParams(), False)
    tree = drafter.propose_tree(k=4, max_branches=3, max_nodes=32)
    assert len(tree.tokens) == 6 and tree.parents is not None
    chain = [tree.tokens[i] for i in token_tree.primary_chain(tree.parents)]
    assert chain == ModelDrafter(model, prompt, SamplingParams(), False).propose(4).tokens
    leaves = [i for i, rank in enumerate(token_tree.ranks(tree.parents)) if rank == 1]
    accepted = [tree.tokens[i] for i in token_tree.path_to(tree.parents, leaves[-1])]  # through a second choice
    committed = [*prompt, *accepted, 9]
    drafter.commit(len(prompt), [*accepted, 9])
    assert drafter.propose(4).tokens == ModelDrafter(model, committed, SamplingParams(), False).propose(4).tokens
    assert drafter.cached_tokens <= len(committed) + 4
