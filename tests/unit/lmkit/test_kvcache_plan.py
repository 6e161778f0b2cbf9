"""A session cache plans a step from what its context gained since the last plan (``grown``), and the step is the
one a full comparison plans: the same positions kept, the same tokens fed, the same logits as a fresh forward."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.lmkit.kvcache import SessionCache

pytestmark = pytest.mark.unit

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    return tf.LlamaForCausalLM(config).eval()


def fresh_logits(model, context, block) -> torch.Tensor:
    """The oracle: the logits after context[-1] and each block token, from an empty cache."""
    return SessionCache(model).logits(list(context), list(block))


def test_planning_from_what_the_context_gained_keeps_and_feeds_what_a_full_comparison_does(model):
    rng = random.Random(7)
    cache = SessionCache(model)
    context = [rng.randrange(VOCAB) for _ in range(9)]  # the session's committed tokens: only ever appended to
    kept = []
    for round_ in range(40):
        block = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))]
        grown = cache.plan(context, block, grown=True)
        full = cache.plan(list(context), block)  # a new list: nothing assumed (and it matches the same prefix)
        assert grown == full, round_
        keep, feed = grown
        logits = cache.apply(keep, feed, len(block) + 1)
        torch.testing.assert_close(logits, fresh_logits(model, context, block), rtol=1e-4, atol=1e-4)
        kept.append(keep)
        if round_ % 13 == 12:
            cache.reset()  # a failed step: the next plan keeps nothing and reads the context again
        elif round_ % 7 == 6:
            cache.crop(max(len(context) - 3, 0))  # rolled back past committed tokens (a re-planned step)
        accepted = rng.randrange(0, len(block) + 1)
        context.extend([*block[:accepted], rng.randrange(VOCAB)])  # accepted + the correction or bonus
    assert max(kept) > 30 and 0 in kept[1:]  # long kept prefixes, and a reset that kept nothing


def test_a_replaced_cache_is_compared_from_its_start_again(model):
    """Tokens set whole (a copied prefix, a reset) forget what the last plan matched."""
    source, cache = SessionCache(model), SessionCache(model)
    context = list(range(1, 20))
    source.apply(*source.plan(context, []), 1)
    cache.apply(*cache.plan(context, []), 1)
    other = [5, 4, 3, *context[3:]]  # shares nothing with the context from its first token on
    cache.copy_prefix(SessionCache(model), 0)
    source_copy = SessionCache(model)
    source_copy.apply(*source_copy.plan(other, []), 1)
    cache.copy_prefix(source_copy, 10)  # holds other[:10] now
    keep, feed = cache.plan(context, [7], grown=True)
    assert keep == 0 and feed == [*context, 7]
