"""Batched verification forwards: the same logits and caches as solo steps; when a batch is split."""

from __future__ import annotations

import pytest
import torch

from lmkit import models
from lmkit.kvcache import SessionCache
from target_service.batched_forward import Step, forward_batch, split_by_width

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
