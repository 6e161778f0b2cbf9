"""Each family people serve (``bench/families.py``) runs through specsplit's caches with its own model's output.

Per family: greedy through a session cache (over the stock forward and over the forward ``lmkit.forward`` installs)
equals the model's own ``generate``; several sessions in one batched step, with a rejected block rolled back,
get their solo logits; token trees, where the forward verifies them, give each node its root path's logits; and
the static step of ``--compile cuda-graphs`` (run eagerly here), where the decoder step runs the family, gives
the same greedy output. The contexts pass the shrunk sliding windows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specsplit.lmkit import decoder_step, forward, kv_buffer, models, token_tree
from specsplit.lmkit.kvcache import SessionCache
from specsplit.target_service.batched_forward import Step, forward_batch
from specsplit.bench.families import FAMILIES, save_family

pytestmark = pytest.mark.unit

PROMPTS = ["The quick brown fox jumps over the lazy dog and", "def fibonacci(n):\n    if n < 2:", "Once upon a time"]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, gguf_tokenizer):
    """(name, folder, the model as transformers loads it, as specsplit loads it, with the fast forward installed)."""
    from transformers import AutoModelForCausalLM

    folder = save_family(tmp_path_factory.mktemp(request.param), request.param, gguf_tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    stock = models.load_model(models.ModelSpec(str(folder)))
    fast = copy.deepcopy(stock)
    runs = forward.install(fast, "off")
    return request.param, folder, reference, stock, fast, runs


def _generate(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def _greedy(cache: SessionCache, ids: list[int]) -> list[int]:
    context, out = list(ids), []
    for _ in range(NEW_TOKENS):
        out.append(int(cache.logits(context, [])[-1].argmax()))
        context.append(out[-1])
    return out


def _close(have: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(have, want, rtol=0, atol=1e-4)
    assert torch.equal(have.argmax(-1), want.argmax(-1))


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_through_the_caches_equals_the_models_own_generate(family, gguf_tokenizer):
    name, _, reference, stock, fast, runs = family
    for prompt in PROMPTS:
        ids = gguf_tokenizer.encode(prompt)
        want = _generate(reference, ids)
        assert len(set(want)) >= 4, f"{name}'s test model repeats itself: {want}"
        assert _generate(reference, ids[len(ids) // 2:]) != want, f"{name}'s test model ignores its context"
        assert _greedy(SessionCache(stock), ids) == want, f"{name}, stock forward, {prompt!r}"
        assert _greedy(SessionCache(fast), ids) == want, f"{name}, {runs}, {prompt!r}"


def test_sessions_batched_with_a_rollback_get_their_solo_logits(family):
    name, _, _, stock, fast, _ = family
    vocab = stock.config.vocab_size
    contexts = [_ids(n, n, vocab) for n in (5, 23, 40)]
    blocks = [_ids(k, 100 + k, vocab) for k in (3, 0, 6)]
    for model in (stock, fast):
        caches = [SessionCache(model) for _ in contexts]
        for cache, context in zip(caches, contexts):
            cache.logits([*context, *_ids(4, 7, vocab)], [])  # then rejected: the step below crops it away
        steps = [Step(cache, *cache.plan(c, b), len(b) + 1) for cache, c, b in zip(caches, contexts, blocks)]
        for have, context, block in zip(forward_batch(model, steps), contexts, blocks):
            _close(have, SessionCache(stock).logits(context, block))
        for cache, context, block in zip(caches, contexts, blocks):
            following = [*context, *block, 7]
            _close(cache.logits(following, [1, 2]), SessionCache(stock).logits(following, [1, 2]))


TREE_TOKENS = [11, 12, 13, 21, 22, 31, 14]
TREE_PARENTS = [-1, 0, 1, -1, 3, 0, 2]


def test_each_tree_node_gets_its_root_paths_logits_where_trees_run(family):
    """Through the fast forward and the static step (where the decoder step runs the family): a tree after a context
    longer than a sliding window, each node's logits its root path's, the window counted by the node's depth."""
    name, _, _, stock, fast, runs = family
    context = _ids(30, 4, stock.config.vocab_size)
    caches = [SessionCache(fast)]
    if not caches[0].supports_trees:
        pytest.skip(f"{name} runs {runs}: no token trees")
    if decoder_step.unsupported(stock, static=True) is None:
        caches.append(forward.slots(copy.deepcopy(stock), sessions=1, context=64, width=8, batch=1, graphs=False)[0]())
    for cache in caches:
        logits = cache.logits(context, TREE_TOKENS, TREE_PARENTS)
        for node in range(len(TREE_TOKENS)):
            path = [TREE_TOKENS[i] for i in token_tree.path_to(TREE_PARENTS, node)]
            _close(logits[node + 1], SessionCache(stock).logits(context, path)[-1])


def test_the_static_step_gives_the_same_greedy_output(family, gguf_tokenizer):
    name, _, reference, stock, _, _ = family
    if reason := decoder_step.unsupported(stock, static=True):
        pytest.skip(f"the static step does not run {name}: {reason}")
    new_cache, _ = forward.slots(copy.deepcopy(stock), sessions=2, context=128, width=8, batch=2, graphs=False)
    for prompt in PROMPTS:
        ids = gguf_tokenizer.encode(prompt)
        cache = new_cache()
        try:
            assert _greedy(cache, ids) == _generate(reference, ids), f"{name}, static step, {prompt!r}"
        finally:
            cache.release()


def test_sliding_layers_keep_their_window_and_a_rollback_and_the_output_stays_generates(family):
    """Greedy over 300 positions, each step verifying a wrong block of 3 that is then rolled back: the sliding
    layers' buffers stay within their window, the roll-back allowance and the minimum buffer (the full layers hold
    everything), and the tokens are generate's; a step back past what they hold feeds the context again."""
    name, _, reference, stock, fast, _ = family
    windows = decoder_step.windows(stock.config)
    if not any(windows) or SessionCache(fast).kv is None:
        pytest.skip(f"{name} has no sliding layers on packed rows")
    rollback, wrong = 4, [5, 6, 7]
    cache, context = SessionCache(fast, rollback=rollback), _ids(24, 5, stock.config.vocab_size)
    want = _generate_n(reference, context, 280)
    bound = max(kv_buffer._MIN_CAPACITY, 2 * (max(w or 0 for w in windows) + rollback + len(wrong) + 1))
    got = []
    for _ in range(280):
        got.append(int(cache.logits(context + got, wrong)[0].argmax()))
        for layer, window in enumerate(windows):
            held = cache.kv.held(layer)
            assert held <= bound if window else held == len(context) + len(got) - 1 + len(wrong), (layer, held)
    assert got == want, name
    assert min(cache.kv.fronts[layer] for layer, window in enumerate(windows) if window) > 0  # positions dropped
    # a tree there, its path 0 -> 1 -> 2 -> 6 kept: the next step reads the path where the chain would be
    full = context + got
    logits = cache.logits(full, TREE_TOKENS, TREE_PARENTS)
    path = token_tree.path_to(TREE_PARENTS, 6)
    cache.keep_path(len(full), path)
    chain = [TREE_TOKENS[i] for i in path]
    _close(logits[7], SessionCache(stock).logits(full, chain)[-1])
    _close(cache.logits(full + chain, [9])[-1], SessionCache(stock).logits(full + chain, [9])[-1])
    back = context + got[:100]
    assert cache.plan(back, [])[0] == 0  # past the floor: fed again
    _close(cache.logits(back, []), SessionCache(stock).logits(back, []))


def _generate_n(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=2)
    return out[0, len(ids):].tolist()
