"""Batched verification forwards: the same logits and caches as solo steps; when a batch is split."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import models
from specsplit.lmkit.kvcache import SessionCache
from specsplit.target_service.batched_forward import Step, forward_batch, split_by_width

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


def test_batched_step_gives_each_session_its_solo_logits_and_cache(model):
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]
    blocks = [torch.randint(0, 49152, (k,), generator=gen).tolist() for k in (3, 0, 8, 5)]

    def primed(context):  # a cache that holds all but the last 3 context tokens, as after earlier rounds
        cache = SessionCache(model)
        cache.logits(context[:-3], [])
        return cache

    solo = [primed(c).logits(c, b) for c, b in zip(contexts, blocks)]
    caches = [primed(c) for c in contexts]
    steps = [Step(cache, *cache.plan(c, b), len(b) + 1) for cache, c, b in zip(caches, contexts, blocks)]
    batched = forward_batch(model, steps)
    for want, have in zip(solo, batched):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, rtol=0, atol=1e-4)
        assert torch.equal(have.argmax(-1), want.argmax(-1))
    # each cache now holds its own context + block: the next step (solo) matches a fresh cache's
    for cache, c, b in zip(caches, contexts, blocks):
        assert cache.tokens == c + b
        nxt = [*c, *b, 7]
        torch.testing.assert_close(cache.logits(nxt, [1, 2]), SessionCache(model).logits(nxt, [1, 2]), rtol=0, atol=1e-4)


def test_one_wide_block_is_split_from_many_narrow_rows():
    widths = [1] * 15 + [9]
    groups = split_by_width(widths, overhead_tokens=6.0)  # 16 x 9 = 144 padded vs 15 + 9 + 6 = 30
    assert sorted(map(sorted, groups)) == [list(range(15)), [15]]


def test_similar_widths_or_a_dear_forward_keep_one_batch():
    assert split_by_width([9, 9, 8, 9], overhead_tokens=6.0) == [[2, 0, 1, 3]]
    assert split_by_width([1] * 15 + [9], overhead_tokens=float("inf")) == [list(range(16))]


def greedy_rounds(engine, contexts, blocks, together: bool) -> tuple[list[list[int]], list[int]]:
    """Sessions over ``contexts`` verify ``blocks`` round by round, all in one ``verify_batch`` or each alone;
    returns each session's tokens and the verifying forwards each round ran."""
    from specsplit.lmkit.kinds import VerificationMode
    from specsplit.lmkit.sampling import SamplingParams
    from specsplit.target_service.engine import VerifyItem

    sessions = [engine.open(f"s{i}", c, SamplingParams(), VerificationMode.GREEDY) for i, c in enumerate(contexts)]
    for session in sessions:  # prefills run alone on every path
        engine.verify(session, len(session.tokens), [], None)
    forwards = []
    for round_blocks in blocks:
        before = engine.forward_passes
        items = [VerifyItem(s, len(s.tokens), b, None) for s, b in zip(sessions, round_blocks)]
        if together:
            assert all(not isinstance(r, Exception) for r in engine.verify_batch(items))
        else:
            for item in items:
                engine.verify(item.session, item.position, item.draft_tokens, None)
        forwards.append(engine.forward_passes - before)
    tokens = [list(s.tokens) for s in sessions]
    for i in range(len(sessions)):
        engine.close(f"s{i}")
    return tokens, forwards


def test_a_batch_invariant_target_verifies_every_session_alone_in_bf16(tiny_target_dir):
    """``batch_invariant=True`` never shares a forward: each session's bf16 greedy tokens are its solo ones."""
    from specsplit.lmkit.sessions import SessionLimits
    from specsplit.target_service.engine import TargetEngine

    model = models.load_model(models.ModelSpec(str(tiny_target_dir), dtype="bfloat16"))
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (6, 19, 11, 30)]
    blocks = [[torch.randint(0, 49152, (k,), generator=gen).tolist() for k in ks] for ks in ((3, 0, 5, 1), (2, 4, 0, 3))]

    def engine(batch_invariant: bool) -> TargetEngine:
        return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8),
                            batch_invariant=batch_invariant)

    solo, _ = greedy_rounds(engine(False), contexts, blocks, together=False)
    invariant, forwards = greedy_rounds(engine(True), contexts, blocks, together=True)
    assert invariant == solo
    assert forwards == [len(contexts)] * len(blocks)  # one forward per session: the shapes it has alone
    _, shared = greedy_rounds(engine(False), contexts, blocks, together=True)
    assert shared == [1] * len(blocks)  # the default path shares one forward per round
