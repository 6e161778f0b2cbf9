"""The target's best successors of every verified position (TargetOpen.successors_k), what token recycling
drafts from: for a chain and a tree, solo and batched, each position's ids are the top k of the model's own
logits after it, and its token is the one at that position."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import errors, models, token_tree
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem

pytestmark = pytest.mark.unit

K = 3


@pytest.fixture(scope="module")
def engine(tiny_target_dir):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8))


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


def expected_ids(reference, context: list[int], block: list[int], parents: list[int] | None) -> list[list[int]]:
    """The top K ids after the last context token and after each node, from transformers' own forward of each
    node's root path."""
    paths = [[]] + ([list(range(i + 1)) for i in range(len(block))] if parents is None
                    else [token_tree.path_to(parents, i) for i in range(len(block))])
    rows = []
    with torch.inference_mode():
        for path in paths:
            logits = reference(torch.tensor([context + [block[j] for j in path]])).logits[0, -1]
            rows.append(logits.topk(K).indices.tolist())
    return rows


def open_session(engine, name: str, prompt: list[int], successors_k: int = K):
    session = engine.open(name, prompt, SamplingParams(), VerificationMode.GREEDY, successors_k=successors_k)
    engine.verify(session, len(session.tokens), [], None)  # the prefill
    return session


@pytest.mark.parametrize("parents", [None, [-1, 0, -1, 2, 0]], ids=["chain", "tree"])
def test_a_verified_blocks_successors_are_the_models_top_k(engine, reference, parents):
    session = open_session(engine, f"solo-{parents is None}", [5, 9, 14, 2])
    context = list(session.tokens)
    block = [7, 3, 11, 4, 8]
    done = engine.verify(session, len(context), block, None, parents)
    assert done.successors.k == K and done.successors.tokens == (context[-1], *block)
    got = [list(ids) for _, ids in done.successors.rows()]
    assert got == expected_ids(reference, context, block, parents)
    engine.close(session.session_id)


def test_batched_sessions_each_get_their_own_and_others_get_none(engine, reference):
    asking = [open_session(engine, f"batch-{i}", [3 + i, 8, 1 + 2 * i]) for i in range(3)]
    silent = open_session(engine, "batch-none", [4, 4, 4], successors_k=0)
    sessions = [asking[0], silent, *asking[1:]]
    blocks = [[6, 2], [1], [9, 9, 9], []]
    contexts = [list(s.tokens) for s in sessions]
    results = engine.verify_batch([VerifyItem(s, len(s.tokens), b, None) for s, b in zip(sessions, blocks)])
    assert {r.batch.size for r in results} == {4}  # one forward
    assert results[1].successors is None
    for result, context, block in zip(results, contexts, blocks):
        if result.successors is not None:
            assert [list(ids) for _, ids in result.successors.rows()] == expected_ids(reference, context, block, None)
    for s in sessions:
        engine.close(s.session_id)


@pytest.mark.parametrize("k", [-1, 17])
def test_a_successors_k_out_of_range_is_refused(engine, k):
    with pytest.raises(errors.InvalidArgument, match=r"successors_k must be in \[0, 16\]"):
        engine.open(f"bad-{k}", [1, 2], SamplingParams(), VerificationMode.GREEDY, successors_k=k)
