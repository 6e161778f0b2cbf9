"""The fast verify forward: oneDNN-packed linears, KV buffers and packed rows give the stock forward's logits.

Chains and token trees, one session and several in one forward; caches after
every step (including a tree's kept path) equal a fresh cache fed the same
tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specsplit.lmkit import models, packed_rows, token_tree
from specsplit.lmkit.kv_buffer import KVBuffer
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.packed_linear import PackedLinear, pack_linears
from specsplit.target_service.batched_forward import Step, forward_batch

pytestmark = pytest.mark.unit

VOCAB = 49152


@pytest.fixture(scope="module")
def stock(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


@pytest.fixture(scope="module")
def fast(stock):
    model = copy.deepcopy(stock)
    # q, k, v, o, gate, up, down per layer, and the LM head; packed whatever their size, to test the packing
    assert pack_linears(model, min_values=0) == 2 * 7 + 1
    assert packed_rows.install(model)
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(have: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(have, want, rtol=0, atol=1e-4)
    assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_packed_linear_matches_linear():
    linear = torch.nn.Linear(32, 48)
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=0, atol=1e-5)
    assert not pack_linears(torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16)), min_values=0)  # fp32 only


def test_small_weights_stay_plain(stock):
    model = copy.deepcopy(stock)  # hidden 64: every layer's weight is under PACK_MIN_VALUES, the LM head is not
    assert pack_linears(model) == 1
    assert type(model.lm_head) is PackedLinear
    assert {type(m) for m in model.model.layers.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))} == {
        torch.nn.Linear}
    big = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(64, 64))
    assert pack_linears(big) == 1 and type(big[0]) is PackedLinear and type(big[1]) is torch.nn.Linear


def test_kv_buffer_grows_crops_and_keeps_a_path():
    kv = KVBuffer(n_layers=1)
    keys = torch.arange(300.0).view(1, 1, 300, 1)
    kv.write(0, 0, keys[:, :, :200], -keys[:, :, :200])
    kv.length = 200
    kv.write(0, 200, keys[:, :, 200:], -keys[:, :, 200:])  # past the first capacity: grows, keeps the past
    kv.length = 300
    assert kv.capacity >= 300
    assert torch.equal(kv.view(0, 300)[0], keys) and torch.equal(kv.view(0, 300)[1], -keys)
    kv.crop(250)
    kv.keep_path(240, [1, 4, 9])  # positions 241, 244, 249 move to 240, 241, 242
    assert kv.length == 243
    assert kv.view(0, 243)[0].flatten()[240:].tolist() == [241.0, 244.0, 249.0]
    with pytest.raises(ValueError):
        kv.crop(244)


def _warm(model, context):
    cache = SessionCache(model)
    cache.logits(context[:-3], [])  # holds all but the last 3 context tokens, as after earlier rounds
    return cache


@pytest.mark.parametrize("context_len", [5, 40, 300])
def test_chain_step_equals_the_stock_forward(stock, fast, context_len):
    context, block = _ids(context_len, context_len), _ids(6, 1)
    _close(_warm(fast, context).logits(context, block), _warm(stock, context).logits(context, block))


def test_generate_on_an_installed_model_is_the_stock_generate(stock, fast):
    prompt = torch.tensor([_ids(9, 3)])
    with torch.inference_mode():
        want = stock.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=2)
        have = fast.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert torch.equal(have, want)


def test_batched_packed_rows_equal_solo_steps(stock, fast):
    contexts = [_ids(n, n) for n in (5, 17, 280, 9)]
    blocks = [_ids(k, 100 + k) for k in (3, 0, 8, 5)]
    solo = [_warm(stock, c).logits(c, b) for c, b in zip(contexts, blocks)]
    caches = [_warm(fast, c) for c in contexts]
    steps = [Step(cache, *cache.plan(c, b), len(b) + 1) for cache, c, b in zip(caches, contexts, blocks)]
    for want, have in zip(solo, forward_batch(fast, steps)):
        _close(have, want)
    for cache, c, b in zip(caches, contexts, blocks):  # each cache holds its own context + block
        assert cache.tokens == c + b
        following = [*c, *b, 7]
        _close(cache.logits(following, [1, 2]), SessionCache(stock).logits(following, [1, 2]))


TREE_TOKENS = [11, 12, 13, 21, 22, 31, 14]
TREE_PARENTS = [-1, 0, 1, -1, 3, 0, 2]  # a chain 11-12-13-14, a second root 21-22, a sibling 31 of 12


def test_each_tree_node_gets_the_logits_of_its_root_path(stock, fast):
    context = _ids(30, 4)
    logits = _warm(fast, context).logits(context, TREE_TOKENS, TREE_PARENTS)  # [n + 1, vocab]
    assert logits.shape[0] == len(TREE_TOKENS) + 1
    _close(logits[0], SessionCache(stock).logits(context, [])[0])
    for node in range(len(TREE_TOKENS)):
        path = [TREE_TOKENS[i] for i in token_tree.path_to(TREE_PARENTS, node)]
        _close(logits[node + 1], SessionCache(stock).logits(context, path)[-1])


@pytest.mark.parametrize("path", [[], [3], [0, 5], [0, 1, 2, 6], [3, 4]])
def test_a_kept_tree_path_leaves_the_cache_of_that_chain(stock, fast, path):
    context = _ids(25, 5)
    cache = _warm(fast, context)
    cache.logits(context, TREE_TOKENS, TREE_PARENTS)
    cache.keep_path(len(context), path)
    kept = [*context, *(TREE_TOKENS[i] for i in path)]
    assert cache.tokens == kept and len(cache) == cache.kv.length
    following = [*kept, 9]
    _close(cache.logits(following, [1]), SessionCache(stock).logits(following, [1]))


def test_trees_of_several_sessions_in_one_forward_equal_their_solo_steps(fast):
    contexts = [_ids(n, 7 * n) for n in (12, 33, 8)]
    trees = [(TREE_TOKENS, TREE_PARENTS), ([5, 6], [-1, -1]), ([1, 2, 3], [-1, 0, 1])]
    solo = [_warm(fast, c).logits(c, t, p) for c, (t, p) in zip(contexts, trees)]
    caches = [_warm(fast, c) for c in contexts]
    steps = [
        Step(cache, *cache.plan(c, t), len(t) + 1, tuple(p)) for cache, c, (t, p) in zip(caches, contexts, trees)
    ]
    for want, have in zip(solo, forward_batch(fast, steps)):
        _close(have, want)


def test_trees_need_the_packed_forward(stock):
    with pytest.raises(ValueError, match="token trees"):
        SessionCache(stock).logits(_ids(4, 1), [1, 2], [-1, -1])
