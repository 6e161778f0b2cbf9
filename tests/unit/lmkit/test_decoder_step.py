"""The decoder step gives transformers' packed-rows forward's logits and features bit for bit, in float32.

Same linears on both sides (oneDNN-packed, and plain): chains at short and long contexts, several sessions
in one forward, token trees, feature layers; the caches after each step equal too. A layout the step does
not run is named, and the engine falls back to transformers' forward.
"""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import decoder_step, graph_step, packed_rows, token_tree
from specsplit.lmkit.kv_buffer import KVBuffer
from specsplit.lmkit.packed_linear import pack_linears

pytestmark = pytest.mark.unit

VOCAB = 49152
TREE_TOKENS = [11, 12, 13, 21, 22, 31, 14]
TREE_PARENTS = [-1, 0, 1, -1, 3, 0, 2]


class Toggle:
    """One model (the same linears), run through transformers' packed-rows forward or through its decoder step."""

    def __init__(self, model) -> None:
        assert packed_rows.install(model)
        self.model = model
        self.step = decoder_step.DecoderStep(model)

    def __call__(self, stepped: bool):
        packed_rows.use_step(self.model, self.step if stepped else None)
        return self.model


@pytest.fixture(scope="module", params=["packed", "plain"])
def pair(request, tiny_target_dir):
    from specsplit.lmkit import models

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    if request.param == "packed":
        assert pack_linears(model, min_values=0) == 15
    return Toggle(model)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tree_mask(start: int, parents: list[int]) -> torch.Tensor:  # [n, start + n] bool
    n = len(parents)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for node in range(n):
        for ancestor in token_tree.path_to(parents, node):
            mask[node, start + ancestor] = True
    return mask


def _run(toggle: Toggle, stepped: bool, plan, features=()):
    """Prefill each row's context, then one packed forward of every row's block; logits, features and caches."""
    model = toggle(stepped)
    layers = model.config.num_hidden_layers
    kvs = [KVBuffer(layers) for _ in plan]
    for kv, (context, _, _) in zip(kvs, plan):
        packed_rows.forward_rows(model, [packed_rows.RowStep(kv, 0, context, [len(context) - 1])])
    steps = []
    for kv, (context, block, parents) in zip(kvs, plan):
        start = len(context)
        if parents is None:
            steps.append(packed_rows.RowStep(kv, start, block, list(range(len(block))), feature_layers=features))
        else:
            depth = [len(token_tree.path_to(parents, i)) - 1 for i in range(len(block))]
            steps.append(packed_rows.RowStep(kv, start, block, list(range(len(block))),
                                             positions=[start + d for d in depth], mask=_tree_mask(start, parents),
                                             feature_layers=features))
    logits, feats = packed_rows.forward_rows_with_features(model, steps)
    caches = [(kv.length, [kv.view(i, kv.length) for i in range(layers)]) for kv in kvs]
    return logits, feats, caches


def _same(have, want) -> None:
    (logits_a, feats_a, caches_a), (logits_b, feats_b, caches_b) = have, want
    for a, b in zip(logits_a, logits_b, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    for a, b in zip(feats_a, feats_b, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    for (len_a, layers_a), (len_b, layers_b) in zip(caches_a, caches_b, strict=True):
        assert len_a == len_b
        for (ka, va), (kb, vb) in zip(layers_a, layers_b):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("context_len,width", [(5, 1), (40, 6), (300, 1), (300, 9)])
def test_a_chain_step_equals_transformers_forward(pair, context_len, width):
    plan = [(_ids(context_len, context_len), _ids(width, width), None)]
    _same(_run(pair, True, plan), _run(pair, False, plan))


def test_several_sessions_and_trees_in_one_forward_equal_transformers_forward(pair):
    plan = [
        (_ids(17, 1), _ids(1, 2), None),
        (_ids(280, 3), _ids(8, 4), None),
        (_ids(30, 5), TREE_TOKENS, TREE_PARENTS),
        (_ids(9, 6), [5, 6], [-1, -1]),
    ]
    _same(_run(pair, True, plan), _run(pair, False, plan))


def test_feature_layers_equal_transformers_hidden_states(pair):
    plan = [(_ids(12, 7), _ids(3, 8), None), (_ids(20, 9), _ids(1, 10), None)]
    have = _run(pair, True, plan, features=(0, 1))
    assert have[1][0].shape == (3, 2 * pair.model.config.hidden_size)
    _same(have, _run(pair, False, plan, features=(0, 1)))
    final = pair.model.config.num_hidden_layers  # the final norm's output: what Medusa heads read
    _same(_run(pair, True, plan, features=(1, final)), _run(pair, False, plan, features=(1, final)))


def test_the_step_is_what_runs(pair, monkeypatch):
    """The equalities above compare two different paths: the stepped model never calls its module forward."""
    monkeypatch.setattr(type(pair.model), "forward", lambda *a, **k: pytest.fail("transformers' forward ran"))
    _run(pair, True, [(_ids(6, 11), _ids(2, 12), None)])
    with pytest.raises(pytest.fail.Exception):
        _run(pair, False, [(_ids(6, 11), _ids(2, 12), None)])


def test_a_layout_it_does_not_run_is_named_and_left_to_transformers():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2)
    model = GPTNeoXForCausalLM(config)
    assert "(gpt_neox) is not a Llama" in decoder_step.unsupported(model)
    with pytest.raises(ValueError, match="cannot run this model"):
        decoder_step.DecoderStep(model)
    kind = packed_rows.install_fast_forward(model, "off")
    assert kind.startswith("transformers' forward over packed rows (GPTNeoXForCausalLM (gpt_neox)")
    assert packed_rows.step_of(model) is None


def test_routed_experts_run_eagerly_but_are_refused_by_the_static_step():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    model = MixtralForCausalLM(config)
    assert decoder_step.unsupported(model) is None
    assert "routed experts" in decoder_step.unsupported(model, static=True)
    with pytest.raises(ValueError, match="static step cannot run this model: its routed experts"):
        graph_step.GraphStep(model, slots=1, capacity=32, max_width=4)


def test_auto_resolves_to_the_measured_mode_and_unknown_modes_are_refused():
    assert decoder_step.resolve_compile("auto", "cpu") == "off"
    assert decoder_step.resolve_compile("inductor", "cpu") == "inductor"
    assert decoder_step.resolve_compile("auto", "cuda") == "off"  # cuda-graphs: not measured served yet
    with pytest.raises(ValueError, match="off, auto, inductor, cuda-graphs"):
        decoder_step.resolve_compile("tensorrt", "cpu")
    with pytest.raises(ValueError, match="needs --device cuda"):
        decoder_step.resolve_compile("cuda-graphs", "cpu")
