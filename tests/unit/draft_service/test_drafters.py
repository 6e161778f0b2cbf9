"""Self-drafters (layer-skip, quantized) and drafter chains, without gRPC.

Rollback: after a rejection at every position 0..K, the next proposal equals a
fresh drafter's proposal on the committed tokens, for every drafter kind.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specsplit.draft_service import self_draft
from specsplit.draft_service.chain import ChainDrafter
from specsplit.draft_service.model_drafter import ModelDrafter
from specsplit.draft_service.ngram import NgramConfig, NgramDrafter
from specsplit.draft_service.registry import DRAFTERS, DraftRequestContext
from specsplit.draft_service.self_draft import ExitAdapter, QuantizeMode
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind, default_chain
from specsplit.lmkit.sampling import SamplingParams

pytestmark = pytest.mark.unit

K = 5
PROMPT = [11, 300, 4000, 27, 9]
VOCAB = 49152


@pytest.fixture(scope="module")
def target_model(tiny_target_dir):
    """The tiny target: its proposals depend on the whole context, so a drafter with a stale context fails."""
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


@pytest.fixture(scope="module")
def derived(target_model):
    return {
        DrafterKind.LAYERSKIP: self_draft.layerskip_view(target_model, 1),
        DrafterKind.QUANTIZED: self_draft.quantized_view(target_model, QuantizeMode.INT8),
    }


GREEDY = SamplingParams()


def build(kind, target_model, derived, prompt, chain=(), sampling=GREEDY, return_probs=False):
    context = DraftRequestContext(
        list(prompt), sampling, return_probs, NgramConfig(1, 3), target_model, derived, tuple(chain)
    )
    return DRAFTERS[kind].build(context)


def truncated_copy(model, layers: int):
    """What bench/derive_draft.py saves: an independent model with the first ``layers`` layers."""
    ref = copy.deepcopy(model)
    ref.model.layers = torch.nn.ModuleList(ref.model.layers[:layers])
    ref.config.num_hidden_layers = layers
    return ref


IDS = torch.tensor([[5, 100, 2000, 7, 9, 11, 40000]])


def test_layerskip_view_is_the_truncated_model_and_shares_its_weights(target_model):
    view = self_draft.layerskip_view(target_model, 1)
    with torch.inference_mode():
        assert torch.equal(view(IDS).logits, truncated_copy(target_model, 1)(IDS).logits)
        assert not torch.allclose(view(IDS).logits, target_model(IDS).logits)
    assert view.model.layers[0].self_attn.q_proj.weight.data_ptr() == target_model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert view.lm_head.weight.data_ptr() == target_model.lm_head.weight.data_ptr()
    # The full model is untouched.
    assert len(target_model.model.layers) == 2 and target_model.config.num_hidden_layers == 2


def test_exit_adapter_starts_as_identity_and_then_changes_the_draft(target_model):
    adapter = ExitAdapter(target_model.config.hidden_size)
    plain = self_draft.layerskip_view(target_model, 1)
    adapted = self_draft.layerskip_view(target_model, 1, adapter)
    with torch.inference_mode():
        assert torch.equal(adapted(IDS).logits, plain(IDS).logits)
        torch.nn.init.normal_(adapter.proj.weight, std=0.5)
        assert not torch.allclose(adapted(IDS).logits, plain(IDS).logits)


def test_layerskip_layer_count_is_checked(target_model):
    with pytest.raises(ValueError, match=r"must be in \[1, 2\]"):
        self_draft.layerskip_view(target_model, 3)
    with pytest.raises(ValueError, match=r"must be in \[1, 2\]"):
        self_draft.layerskip_view(target_model, 0)


@pytest.mark.parametrize("mode", list(QuantizeMode))
def test_quantized_view_is_int8_with_a_full_precision_head(target_model, mode):
    view = self_draft.quantized_view(target_model, mode)
    linears = [m for m in view.model.layers.modules() if type(m) is torch.nn.Linear]
    assert linears == [], "every transformer Linear must be quantized"
    assert view.lm_head is target_model.lm_head and view.lm_head.weight.dtype == torch.float32
    assert type(target_model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # the target is untouched
    with torch.inference_mode():
        full, quant = target_model(IDS).logits, view(IDS).logits
    assert not torch.equal(full, quant)  # it really is another computation
    # INT8_DYNAMIC scales a whole forward's activations by one number (per tensor), the others per token
    assert (full - quant).abs().max() < (0.15 if mode is QuantizeMode.INT8_DYNAMIC else 0.05) * full.abs().max()
    assert (full.argmax(-1) == quant.argmax(-1)).float().mean() >= 0.8


def test_int8_dynamic_depends_on_chunking_which_is_why_it_is_not_the_default(target_model):
    """torch.ao's per-call activation scale: the same context fed whole or token by token gives other logits (by
    far more than the float rounding that separates the two feeds of the per-token INT8 view)."""
    view = self_draft.quantized_view(target_model, QuantizeMode.INT8_DYNAMIC)
    exact = self_draft.quantized_view(target_model, QuantizeMode.INT8)
    for model, invariant in ((view, False), (exact, True)):
        whole = ModelDrafter(model, PROMPT, GREEDY, False)
        stepwise = ModelDrafter(model, PROMPT[:1], GREEDY, False)
        for token in PROMPT[1:]:
            stepwise.propose(1)
            stepwise.extend([token])
        with torch.inference_mode():
            a = whole._cache.logits(PROMPT, [])
            b = stepwise._cache.logits(PROMPT, [])
        assert bool((a - b).abs().max() < 1e-4) is invariant
        assert bool((a - b).abs().max() > 1e-2) is not invariant


def test_int8_linear_is_chunk_invariant_and_close():
    """Per-token activation scales: a token's output is the same whatever else is in the forward pass."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=True)
    q = self_draft.Int8Linear(linear)
    x = torch.randn(1, 7, 48) * torch.linspace(0.1, 10, 7)[None, :, None]  # very different token magnitudes
    whole = q(x)
    pieces = torch.cat([q(x[:, :3]), q(x[:, 3:4]), q(x[:, 4:])], dim=1)
    assert torch.equal(whole, pieces)
    reference = linear(x)
    assert ((whole - reference).abs().amax(-1) <= 0.03 * reference.abs().amax(-1)).all()


def test_int8_weight_linear_matches_dequantized_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=True)
    q = self_draft.Int8WeightLinear(linear)
    assert q.weight_int8.dtype == torch.int8
    x = torch.randn(3, 5, 48)
    dequantized = q.weight_int8.float() * q.scale[:, None]
    assert torch.allclose(q(x), x @ dequantized.T + linear.bias, atol=1e-4)
    assert (dequantized - linear.weight).abs().max() <= q.scale.max() / 2 + 1e-6


ROLLBACK_KINDS = [
    pytest.param(DrafterKind.LAYERSKIP, (), id="layerskip"),
    pytest.param(DrafterKind.QUANTIZED, (), id="quantized"),
    pytest.param(DrafterKind.CHAIN, (DrafterKind.NGRAM, DrafterKind.LAYERSKIP), id="chain-ngram-layerskip"),
    pytest.param(DrafterKind.CHAIN, (DrafterKind.QUANTIZED, DrafterKind.NGRAM), id="chain-quantized-ngram"),
]


@pytest.mark.parametrize("rejected_at", range(K + 1))
@pytest.mark.parametrize("kind,chain", ROLLBACK_KINDS)
def test_rollback_matches_fresh_drafter(target_model, derived, kind, chain, rejected_at):
    drafter = build(kind, target_model, derived, PROMPT, chain)
    block = drafter.propose(K).tokens
    assert len(block) == K
    # The target accepted block[:rejected_at] and sent a correction that differs from the draft's token.
    correction = (block[rejected_at] + 1) % VOCAB if rejected_at < K else 77
    committed = [*block[:rejected_at], correction]
    drafter.commit(len(PROMPT), committed)
    again = drafter.propose(K).tokens
    fresh = build(kind, target_model, derived, PROMPT + committed, chain).propose(K).tokens
    assert again == fresh
    # A second round on top of the first still agrees (the caches were cropped, not rebuilt wrongly).
    drafter.commit(len(PROMPT) + len(committed), [again[0] if again else 5])
    fresh2 = build(kind, target_model, derived, [*PROMPT, *committed, again[0] if again else 5], chain)
    assert drafter.propose(K).tokens == fresh2.propose(K).tokens


@pytest.mark.parametrize("kind,chain", ROLLBACK_KINDS)
def test_rollback_into_committed_tokens_matches_fresh_drafter(target_model, derived, kind, chain):
    """A commit that starts before the end (tokens the draft was given on speculation) replaces them everywhere."""
    context = [8, 9, 10, 11, 12, 8, 9, 10]  # n-gram members match here; model members see a real context
    drafter = build(kind, target_model, derived, context, chain)
    drafter.propose(K)
    replacement = [4000, 27, 9]
    drafter.commit(len(context) - 3, replacement)
    assert drafter.position == len(context)
    fresh = build(kind, target_model, derived, [*context[:-3], *replacement], chain)
    assert drafter.propose(K).tokens == fresh.propose(K).tokens
    drafter.commit(2, [300])  # far back, into the prompt
    assert drafter.propose(K).tokens == build(kind, target_model, derived, [8, 9, 300], chain).propose(K).tokens


def test_layerskip_rollback_keeps_the_shared_prefix_cached(target_model, derived):
    drafter = build(DrafterKind.LAYERSKIP, target_model, derived, PROMPT)
    block = drafter.propose(K).tokens
    drafter.commit(len(PROMPT), [*block[:2], (block[2] + 1) % VOCAB])
    drafter.propose(K)
    assert drafter.cached_tokens >= len(PROMPT) + 2  # the prompt was not re-read


def test_chain_uses_the_first_member_that_proposes(target_model, derived):
    chain = (DrafterKind.NGRAM, DrafterKind.LAYERSKIP)
    no_match = [11, 300, 4000, 27, 9]  # no repeated suffix: n-gram proposes nothing
    drafter = build(DrafterKind.CHAIN, target_model, derived, no_match, chain)
    layerskip = ModelDrafter(derived[DrafterKind.LAYERSKIP], no_match, SamplingParams(), False)
    assert drafter.propose(4).tokens == layerskip.propose(4).tokens
    assert drafter.last_kind is DrafterKind.LAYERSKIP

    repeats = [8, 9, 10, 11, 12, 8, 9]  # suffix "8 9" occurred before: n-gram copies "10 11 12 8"
    drafter = build(DrafterKind.CHAIN, target_model, derived, repeats, chain)
    assert drafter.propose(4).tokens == NgramDrafter(NgramConfig(1, 3), repeats).propose(4).tokens == [10, 11, 12, 8]
    assert drafter.last_kind is DrafterKind.NGRAM
    assert drafter.blocks_by_kind == {DrafterKind.NGRAM: 1, DrafterKind.LAYERSKIP: 0}


def test_a_chains_free_member_drafts_up_to_the_free_bound_and_its_model_member_k(target_model, derived):
    chain = (DrafterKind.NGRAM, DrafterKind.LAYERSKIP)
    repeats = [8, 9, 10, 11, 12, 13, 8, 9]
    drafter = build(DrafterKind.CHAIN, target_model, derived, repeats, chain)
    block = drafter.propose_within(2, 5)  # the model would be asked for 2; the free lookup drafts 5
    assert block.tokens == [10, 11, 12, 13, 8]
    assert block.drafter is DrafterKind.NGRAM and block.quality is not None and block.quality.length == 2
    assert len(drafter.propose_within(0, 5).tokens) == 5  # nothing asked of the model: the lookup still drafts
    no_match = [11, 300, 4000, 27, 9]
    drafter = build(DrafterKind.CHAIN, target_model, derived, no_match, chain)
    block = drafter.propose_within(2, 5)
    assert len(block.tokens) == 2 and block.drafter is DrafterKind.LAYERSKIP and block.quality is None
    assert drafter.propose_within(0, 5).tokens == []  # the model member is asked for nothing


def test_chain_members_stay_in_sync_after_rounds_they_sat_out(target_model, derived):
    """A model member skipped for rounds (n-gram answered) must catch up on what was committed meanwhile."""
    chain = (DrafterKind.NGRAM, DrafterKind.QUANTIZED)
    context = [8, 9, 10, 11, 12, 8, 9]
    drafter = build(DrafterKind.CHAIN, target_model, derived, context, chain)
    assert drafter.propose(3).tokens == [10, 11, 12]
    committed = [10, 11, 4242]  # two accepted, then a correction that breaks the match
    drafter.commit(len(context), committed)
    assert drafter.position == len(context) + 3
    got = drafter.propose(3)
    quantized = ModelDrafter(derived[DrafterKind.QUANTIZED], context + committed, SamplingParams(), False)
    assert drafter.last_kind is DrafterKind.QUANTIZED
    assert got.tokens == quantized.propose(3).tokens


@pytest.mark.parametrize("kind", [DrafterKind.LAYERSKIP, DrafterKind.QUANTIZED])
def test_self_drafters_return_the_distributions_they_sampled_from(target_model, derived, kind):
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    block = build(kind, target_model, derived, PROMPT, sampling=params, return_probs=True).propose(4)
    assert block.probs is not None and block.probs.shape == (4, VOCAB)
    assert torch.allclose(block.probs.sum(-1), torch.ones(4), atol=1e-3)
    for row, token in zip(block.probs, block.tokens):
        assert row[token] > 0 and int((row > 0).sum()) <= 20


def test_default_chain_prefers_ngram_then_a_self_drafter():
    served = [DrafterKind.MODEL, DrafterKind.NGRAM, DrafterKind.QUANTIZED, DrafterKind.CHAIN]
    assert default_chain(served) == (DrafterKind.NGRAM, DrafterKind.QUANTIZED)
    assert default_chain([DrafterKind.NGRAM, DrafterKind.MODEL]) == (DrafterKind.NGRAM, DrafterKind.MODEL)
    assert default_chain([DrafterKind.NGRAM]) == (DrafterKind.NGRAM,)


def test_chain_refuses_members_with_different_contexts():
    with pytest.raises(ValueError, match="different contexts"):
        ChainDrafter([(DrafterKind.NGRAM, NgramDrafter(NgramConfig(), [1, 2])), (DrafterKind.NGRAM, NgramDrafter(NgramConfig(), [1]))])


def test_a_draft_position_costs_what_its_drafter_keeps(target_model, derived):
    from specsplit.draft_service.engine import DraftEngine
    from specsplit.lmkit import errors
    from specsplit.lmkit.kvcache import kv_bytes_per_token
    from specsplit.lmkit.sessions import SessionLimits

    whole = kv_bytes_per_token(target_model)
    layers = int(target_model.config.num_hidden_layers)
    engine = DraftEngine(target_model, limits=SessionLimits(kv_budget_bytes=whole * 100), derived=derived)
    assert engine.position_bytes == {
        DrafterKind.MODEL: whole, DrafterKind.QUANTIZED: whole, DrafterKind.LAYERSKIP: whole // layers,
    }
    # A chain keeps what its members keep; the n-gram member nothing.
    engine.open("chain", PROMPT, GREEDY, DrafterKind.CHAIN, False, NgramConfig(), [DrafterKind.NGRAM,
                DrafterKind.LAYERSKIP], reserve_tokens=50)
    engine.open("ngram", PROMPT, GREEDY, DrafterKind.NGRAM, False, NgramConfig(), reserve_tokens=10**6)
    budget_left = whole * 100 - 50 * (whole // layers)
    with pytest.raises(errors.ResourceExhausted, match=f"{budget_left} are free"):
        engine.open("model", PROMPT, GREEDY, DrafterKind.MODEL, False, NgramConfig(), reserve_tokens=100)
    engine.open("model", PROMPT, GREEDY, DrafterKind.MODEL, False, NgramConfig(), reserve_tokens=budget_left // whole)
    assert DraftEngine(None, limits=SessionLimits()).position_bytes == {}
