"""Medusa heads: the Medusa-1 checkpoint layout read and written, refused for another target, drafted as a tree."""

from __future__ import annotations

import json

import pytest
import torch

from specsplit.draft_service import medusa
from specsplit.lmkit import models, token_tree
from specsplit.lmkit.features import FeatureBlock

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


def random_heads(target, num_heads=3, num_layers=1, own=True, seed=0) -> medusa.MedusaHeads:
    torch.manual_seed(seed)
    config = medusa.MedusaConfig(num_heads, num_layers, "tiny")
    heads = medusa.MedusaHeads(config, target.config.hidden_size, target.config.num_hidden_layers,
                               target.get_output_embeddings(), target.config.vocab_size, next(target.parameters()), own)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    return heads


@pytest.mark.parametrize("own", [True, False], ids=["own-lm-heads", "target-lm-head"])
def test_heads_round_trip_through_the_medusa1_layout(target, tmp_path, own):
    heads = random_heads(target, own=own)
    medusa.save_heads(heads, tmp_path)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "medusa_lm_head.safetensors")))
    assert {"0.0.linear.weight", "0.0.linear.bias", "2.0.linear.bias"} <= names
    assert ("1.1.weight" in names) == own  # a head's own LM head follows its blocks
    assert json.loads((tmp_path / "config.json").read_text())["medusa_num_heads"] == 3
    loaded = medusa.load_heads(tmp_path, target)
    hidden = torch.randn(target.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(loaded.logits(hidden), heads.logits(hidden))
    assert loaded.feature_layers == (target.config.num_hidden_layers,)


def test_a_pt_checkpoint_loads_too(target, tmp_path):
    heads = random_heads(target, num_heads=2, num_layers=2)
    medusa.save_heads(heads, tmp_path)
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    torch.save(heads.state(), tmp_path / "medusa_lm_head.pt")
    hidden = torch.randn(target.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(medusa.load_heads(tmp_path, target).logits(hidden), heads.logits(hidden))


def test_heads_for_another_target_are_refused_naming_both(target, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    medusa.save_heads(random_heads(other), tmp_path)
    with pytest.raises(ValueError, match=r"shape \(32, 32\), but target tiny-t has hidden size 64"):
        medusa.load_heads(tmp_path, target, "tiny-t")
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(ValueError, match="has no Medusa weights"):
        medusa.load_heads(tmp_path, target)
    with pytest.raises(ValueError, match="has no config.json"):
        medusa.read_config(tmp_path / "nowhere")


def test_the_draft_is_a_tree_of_the_heads_best_and_its_primary_chain_their_argmax(target):
    heads = random_heads(target, num_heads=3)
    width = target.config.hidden_size
    features = torch.randn(4, width)
    drafter = medusa.MedusaDrafter(heads, [5, 6, 7, 8, 9])
    assert drafter.propose(3).tokens == []  # no features yet: the first round is target-only
    drafter.add_features(FeatureBlock(0, features))  # positions 0..3: the last token (9) has none yet
    with torch.inference_mode():
        best = heads.logits(features[-1]).argmax(-1).tolist()
    assert drafter.propose(3).tokens == best
    block = drafter.propose_tree(3, 4, 8)
    parents = block.parents or token_tree.chain_parents(len(block.tokens))
    assert len(block.tokens) <= 8 and sum(1 for kids in token_tree.children(parents)[1:] if not kids) <= 4
    assert [block.tokens[i] for i in token_tree.primary_chain(parents)] == best
    drafter.extend([11])  # a token drafted ahead of its features: the first head's position is past
    assert drafter.propose(3).tokens == best[1:]
    drafter.rollback(3)  # the features' own position goes: nothing to draft from
    assert drafter.propose(2).tokens == []
    with pytest.raises(ValueError, match="width"):
        drafter.add_features(FeatureBlock(0, torch.randn(1, width + 1)))


def test_serve_draft_refuses_heads_without_a_target_or_a_config(tmp_path):
    from specsplit.draft_service.server import build_parser, check_self_draft_flags

    with pytest.raises(ValueError, match="--medusa-head derive from --model"):
        check_self_draft_flags(build_parser().parse_args(["--medusa-head", str(tmp_path)]))
    with pytest.raises(ValueError, match="is not a Medusa head folder"):
        check_self_draft_flags(build_parser().parse_args(["--model", "m", "--medusa-head", str(tmp_path)]))


def test_heads_run_once_per_feature_and_only_as_deep_as_asked(target):
    heads = random_heads(target, num_heads=3)
    with torch.inference_mode():
        hidden = torch.randn(1, target.config.hidden_size)
        best = heads.logits(hidden[0]).argmax(-1).tolist()
    calls = []
    run = heads.logits
    heads.logits = lambda h, first=0, count=None: calls.append((first, count)) or run(h, first, count)
    drafter = medusa.MedusaDrafter(heads, [5, 6, 7])
    drafter.add_features(FeatureBlock(1, hidden))  # position 1: the last token (7) has none yet
    assert drafter.propose(1).tokens == best[:1] and calls == [(0, 1)]
    assert drafter.propose(3).tokens == best and calls == [(0, 1), (1, 2)]
    assert drafter.propose_tree(3, 4, 8).tokens and calls == [(0, 1), (1, 2)]  # a tree reuses the heads' rankings


@pytest.mark.parametrize("own", [True, False], ids=["own-lm-heads", "target-lm-head"])
def test_a_reduced_vocabulary_drafts_its_tokens_with_the_full_heads_logits_renormalised(target, tmp_path, own):
    """Over the folder's draft vocabulary each head ranks those tokens exactly as the whole vocabulary's logits do
    (the same rows), mapped back to target ids; --medusa-vocab 0 or no file: the whole vocabulary."""
    heads = random_heads(target, own=own)
    medusa.save_heads(heads, tmp_path)
    hidden = torch.randn(target.config.hidden_size)
    with torch.inference_mode():
        full = heads.logits(hidden)  # [heads, vocab]
    assert medusa.load_heads(tmp_path, target).draft_ids is None  # no draft_vocab.safetensors: whole vocabulary
    ranked = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(1))[:600]
    medusa.save_draft_vocab(ranked, tmp_path)
    loaded = medusa.load_heads(tmp_path, target, draft_vocab=500)
    assert torch.equal(loaded.draft_ids, ranked[:500])
    with torch.inference_mode():
        ids, probs = loaded.best(hidden, 1, 2, 8)
    for row, head in enumerate((1, 2)):
        subset = full[head, ranked[:500]]
        want_probs, want = subset.softmax(-1).topk(8)
        assert torch.equal(ids[row], ranked[want]) and torch.allclose(probs[row], want_probs)
        assert set(ids[row].tolist()) <= set(ranked[:500].tolist())
    assert medusa.load_heads(tmp_path, target, draft_vocab=0).draft_ids is None
    with pytest.raises(ValueError, match="--medusa-vocab must be >= 0"):
        medusa.read_draft_vocab(tmp_path, -1)
    with pytest.raises(ValueError, match="token ids below"):
        loaded.restrict(torch.tensor([target.config.vocab_size]))
    drafter = medusa.MedusaDrafter(loaded, [5, 6, 7, 8, 9])
    drafter.add_features(FeatureBlock(0, torch.randn(5, target.config.hidden_size)))
    drafter.extend([10])
    proposal = drafter.propose_tree(3, 4, 8)
    assert proposal.tokens and set(proposal.tokens) <= set(ranked[:500].tolist())
