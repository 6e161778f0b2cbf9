"""The target engine over the CUDA-graph step's slots (``--compile cuda-graphs``; run uncaptured on the CPU).

Greedy output equals the model's own with target-only steps and with draft blocks half of whose tokens
are wrong (so blocks are rejected and slots rolled back), sessions interleaved in their slots, forks
sharing a prompt, token trees alone and verified together with chains, a feature drafter's hidden states as the
fast forward gives them; what the step does not do (layers it does not keep, more sessions than slots, a context
past the slot) is refused with a message that says what to do.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from specsplit.lmkit import errors, graph_step, models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service import server
from specsplit.target_service.engine import TargetEngine

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()
SLOTS, CONTEXT, MAX_BLOCK = 3, 96, 4


@pytest.fixture(scope="module")
def engine(tiny_target_dir) -> TargetEngine:
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    graph = graph_step.GraphStep(model, slots=SLOTS, capacity=CONTEXT + MAX_BLOCK + 1, max_width=MAX_BLOCK + 1,
                                 max_batch=2)  # three sessions: a bucket of 2 and one alone, or a group of 2 and 1
    slots = graph_step.Slots(SLOTS)
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=MAX_BLOCK),
                        new_cache=lambda: graph_step.GraphSessionCache(model, graph, slots), compile_mode="cuda-graphs",
                        max_context=CONTEXT)


def test_greedy_output_is_the_models_own_with_rejected_blocks_and_interleaved_slots(engine, tiny_reference):
    prompts, expected = tiny_reference
    sessions = [engine.open(f"s{i}", p, GREEDY, VerificationMode.GREEDY) for i, p in enumerate(prompts[:SLOTS])]
    accepted = 0
    for step in range(9):  # 1 + 2 + 4 tokens every three steps: 21 of the 24 known
        for i, session in enumerate(sessions):
            out = session.tokens[len(prompts[i]):]
            truth = expected[i][len(out):len(out) + 3]
            # every other step a block whose second token is wrong: one accepted, the rest rolled back
            block = [] if step % 3 == 0 else [truth[0], (truth[1] + 1) % 49152, truth[2]] if step % 3 == 1 else truth
            accepted += engine.verify(session, len(session.tokens), block, None).accepted
    for i, session in enumerate(sessions):
        out = session.tokens[len(prompts[i]):]
        assert out == expected[i][: len(out)] and len(out) == 21
    assert accepted > 0
    for i in range(SLOTS):
        engine.close(f"s{i}")


def test_sessions_verified_together_replay_as_one_and_decode_as_alone(engine, tiny_reference):
    """verify_batch over the slots: one shared forward a step (batch buckets), each session's tokens its own."""
    from specsplit.target_service.engine import VerifyItem

    prompts, expected = tiny_reference
    sessions = [engine.open(f"b{i}", p, GREEDY, VerificationMode.GREEDY) for i, p in enumerate(prompts[:SLOTS])]
    passes = engine.forward_passes
    try:
        for step in range(6):
            items = []
            for i, session in enumerate(sessions):
                out = session.tokens[len(prompts[i]):]
                truth = expected[i][len(out):len(out) + 3]
                block = truth if step % 2 else [truth[0], (truth[1] + 1) % 49152]  # every other block half wrong
                items.append(VerifyItem(session, len(session.tokens), block[: 1 + i], None))  # widths differ
            for outcome in engine.verify_batch(items):
                assert not isinstance(outcome, Exception), outcome
        # rows of unlike widths may run apart (the engine's padding trade-off), never one forward a session
        assert engine.forward_passes - passes < 6 * len(sessions)
        for i, session in enumerate(sessions):
            out = session.tokens[len(prompts[i]):]
            assert out == expected[i][: len(out)] and len(out) > 6
    finally:
        for i in range(len(sessions)):
            engine.close(f"b{i}")


def test_forks_copy_the_prompt_between_slots_and_decode_as_alone(engine, tiny_reference):
    prompts, expected = tiny_reference
    source = engine.open("source", prompts[1], GREEDY, VerificationMode.GREEDY)
    shared = engine.shared_tokens
    fork = engine.open("fork", prompts[1], GREEDY, VerificationMode.GREEDY, fork_from="source")
    assert engine.shared_tokens - shared == len(prompts[1]) - 1
    for session in (fork, source):
        for _ in range(5):
            engine.verify(session, len(session.tokens), [], None)
        assert session.tokens[len(prompts[1]):] == expected[1][:5]
    engine.close("source")
    engine.close("fork")


def _tree(truth: list[int]) -> tuple[list[int], list[int]]:
    """A tree whose true path is nodes 1 and 3 (a wrong sibling before each of its tokens)."""
    wrong = [(t + 1) % 49152 for t in truth]
    return [wrong[0], truth[0], wrong[1], truth[1]], [-1, -1, 1, 1]


def test_token_trees_verify_alone_and_with_chains_and_decode_as_the_model(engine, tiny_reference):
    """Trees replay the chains' graphs (the block mask and rotary positions are inputs): each round's tree holds the
    true continuation on a branch whose nodes are not consecutive, so its keys and values move (keep_path) before
    the next round reads them; alone (verify) and beside a chain session (verify_batch), the output is the model's."""
    from specsplit.target_service.engine import VerifyItem

    prompts, expected = tiny_reference
    assert engine.verifies_trees  # ModelInfo.token_trees
    sessions = [engine.open(f"t{i}", p, GREEDY, VerificationMode.GREEDY) for i, p in enumerate(prompts[:2])]
    try:
        for step in range(6):
            items = []
            for i, session in enumerate(sessions):
                out = session.tokens[len(prompts[i]):]
                truth = expected[i][len(out):len(out) + 3]
                if i == 0 or step % 2:
                    tokens, parents = _tree(truth)
                else:
                    tokens, parents = truth[:2], None
                items.append(VerifyItem(session, len(session.tokens), tokens, None, parents=parents))
            if step < 2:  # alone
                outcomes = [engine.verify(item.session, item.position, item.draft_tokens, None, parents=item.parents)
                            for item in items]
            else:
                outcomes = engine.verify_batch(items)
            for outcome in outcomes:
                assert not isinstance(outcome, Exception), outcome
            assert outcomes[0].accepted == 2
        for i, session in enumerate(sessions):
            out = session.tokens[len(prompts[i]):]
            assert out == expected[i][: len(out)] and len(out) >= 12
    finally:
        for i in range(len(sessions)):
            engine.close(f"t{i}")


def test_what_the_step_does_not_do_is_refused_with_what_to_do(engine, tiny_reference):
    prompts, _ = tiny_reference
    session = engine.open("chain", prompts[0], GREEDY, VerificationMode.GREEDY)
    with pytest.raises(errors.InvalidArgument, match="returns no hidden features.*--graph-feature-layers"):
        engine.open("eagle", prompts[0], GREEDY, VerificationMode.GREEDY, feature_layers=[2])
    others = [engine.open(f"o{i}", prompts[0], GREEDY, VerificationMode.GREEDY) for i in range(SLOTS - 1)]
    with pytest.raises(errors.ResourceExhausted, match="KV slots is held"):
        engine.open("one-too-many", prompts[0], GREEDY, VerificationMode.GREEDY)
    for i in range(len(others)):
        engine.close(f"o{i}")
    with pytest.raises(errors.InvalidArgument, match=f"context is {CONTEXT}"):
        engine.open("long", [5] * CONTEXT, GREEDY, VerificationMode.GREEDY)
    engine.close("chain")
    again = engine.open("after", prompts[0], GREEDY, VerificationMode.GREEDY)  # the closed sessions' slots are free
    engine.close("after")
    assert again.cache.slot is None  # released with the session


def test_the_flag_is_refused_where_nothing_can_be_captured():
    def args(**kw):
        return argparse.Namespace(**{"compile": "cuda-graphs", "device": "cpu", "stock_forward": False, "tp": 1,
                                     "graph_context": 4096, **kw})

    with pytest.raises(ValueError, match="needs --device cuda, not cpu"):
        server.compile_mode(args())
    with pytest.raises(ValueError, match="--tp 1 or --compile off"):
        server.compile_mode(args(device="cuda", tp=2))
    with pytest.raises(ValueError, match="--graph-context must be >= 2"):
        server.compile_mode(args(device="cuda", graph_context=1))
    assert server.compile_mode(args(device="cuda:1")) == "cuda-graphs"


def test_a_kv_budget_sizes_the_block_pool_and_every_reservation_fits_it(tiny_target_dir, tiny_reference):
    """--kv-budget-bytes under cuda-graphs: a pool of the budget's blocks (plus one a session for rounding), far
    fewer than three sessions at the full context; three sessions each decoding to the end of their reservation,
    with blocks half wrong, never find the pool short, and give the model's own tokens; a fourth session past the
    budget is refused at its open, and a closed session's blocks serve the next."""
    from specsplit.lmkit import forward

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    prompts, expected = tiny_reference
    reserves = [len(p) + 22 for p in prompts[:SLOTS]]  # 21 new tokens of the 24 known each
    budget = sum(reserves)
    new_cache, context = forward.slots(model, SLOTS + 1, 512, MAX_BLOCK + 1, 2, graphs=False, kv_tokens=budget,
                                       block_size=8)
    limits = SessionLimits(max_block=MAX_BLOCK, max_sessions=SLOTS + 1, kv_budget_tokens=budget)
    budgeted = TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=limits, new_cache=new_cache,
                            compile_mode="cuda-graphs", max_context=context)
    sessions = [budgeted.open(f"s{i}", p, GREEDY, VerificationMode.GREEDY, reserve_tokens=reserve)
                for i, (p, reserve) in enumerate(zip(prompts, reserves))]
    pool = sessions[0].cache._graph.blocks
    assert pool.count == -(-budget // 8) + SLOTS + 1 < (SLOTS + 1) * (512 + MAX_BLOCK + 1) // 8
    with pytest.raises(errors.ResourceExhausted, match="budget"):
        budgeted.open("past-the-budget", prompts[0], GREEDY, VerificationMode.GREEDY, reserve_tokens=reserves[0])
    for step in range(12):
        for i, session in enumerate(sessions):
            out = session.tokens[len(prompts[i]):]
            room = reserves[i] - len(session.tokens) - 1
            if room < 0:
                continue
            truth = expected[i][len(out):len(out) + min(3, room)]
            block = [truth[0], (truth[1] + 1) % 49152, *truth[2:]] if step % 2 and len(truth) > 1 else truth
            budgeted.verify(session, len(session.tokens), block, None)
    for i, session in enumerate(sessions):
        out = session.tokens[len(prompts[i]):]
        assert out == expected[i][: len(out)] and len(session.tokens) >= reserves[i] - 1
    held = pool.count - pool.free
    budgeted.close("s0")
    assert pool.count - pool.free < held
    again = budgeted.open("again", prompts[0], GREEDY, VerificationMode.GREEDY, reserve_tokens=reserves[0])
    budgeted.verify(again, len(again.tokens), expected[0][:3], None)
    assert again.tokens[len(prompts[0]):] == expected[0][:4]


def test_feature_sessions_get_the_fast_forwards_features_of_their_committed_positions(tiny_target_dir, tiny_reference):
    """A step keeping layers 0 and 2 (the embeddings, the final output): sessions reading [2] (Medusa's) and [0, 2]
    verify chains with rejected tokens and a tree, together, and each verdict's features equal the fast forward's
    for the same session; a session reading a layer the step does not keep is refused naming the layers it
    keeps."""
    from specsplit.lmkit import forward
    from specsplit.target_service.engine import VerifyItem

    prompts, expected = tiny_reference
    fast_model, graph_model = (models.load_model(models.ModelSpec(str(tiny_target_dir))) for _ in range(2))
    new_cache, context = forward.slots(graph_model, 3, 96, MAX_BLOCK + 1, 2, graphs=False, feature_layers=(0, 2))
    limits = SessionLimits(max_block=MAX_BLOCK)
    graph = TargetEngine(graph_model, model_id="tiny", vocab_fingerprint="", limits=limits, new_cache=new_cache,
                         compile_mode="cuda-graphs", max_context=context)
    fast = TargetEngine(fast_model, model_id="tiny", vocab_fingerprint="", limits=limits)
    layer_sets = ([2], [0, 2])
    for engine in (graph, fast):
        for i, layers in enumerate(layer_sets):
            engine.open(f"f{i}", prompts[i], GREEDY, VerificationMode.GREEDY, feature_layers=layers)
    verdicts = {id(graph): [], id(fast): []}
    for step in range(4):
        for engine in (graph, fast):
            items = []
            for i in range(len(layer_sets)):
                session = engine.sessions.find(f"f{i}", "")
                out = session.tokens[len(prompts[i]):]
                truth = expected[i][len(out):len(out) + 2]
                if step == 2 and i == 0:
                    tokens, parents = _tree(truth)
                else:
                    tokens, parents = [truth[0], (truth[1] + 1) % 49152] if step % 2 else truth, None
                items.append(VerifyItem(session, len(session.tokens), tokens, None, parents=parents))
            verdicts[id(engine)] += engine.verify_batch(items)
    for got, want in zip(verdicts[id(graph)], verdicts[id(fast)]):
        assert not isinstance(got, Exception), got
        assert got.accepted == want.accepted and got.next_token == want.next_token
        assert got.features.position == want.features.position
        torch.testing.assert_close(got.features.values, want.features.values, rtol=1e-4, atol=1e-4)
    with pytest.raises(errors.InvalidArgument, match=r"keeps the hidden states of layers \[0, 2\], not all of \[1, 2\]"):
        graph.open("eagle-3", prompts[0], GREEDY, VerificationMode.GREEDY, feature_layers=[1, 2])
