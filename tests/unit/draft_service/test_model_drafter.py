"""The model drafter's cache rollback: after a rejection at any position, it proposes what a fresh drafter would."""

from __future__ import annotations

import pytest
import torch

from specsplit.draft_service.model_drafter import ModelDrafter
from specsplit.lmkit import models, token_tree
from specsplit.lmkit.sampling import SamplingParams

pytestmark = pytest.mark.unit

K = 5


@pytest.fixture(scope="module")
def draft_model(tiny_draft_dir):
    return models.load_model(models.ModelSpec(str(tiny_draft_dir)))


PROMPT = [11, 300, 4000, 27, 9]


@pytest.mark.parametrize("rejected_at", range(K + 1))
def test_rollback_matches_fresh_drafter(draft_model, rejected_at):
    drafter = ModelDrafter(draft_model, PROMPT, SamplingParams(), False)
    block = drafter.propose(K).tokens
    assert len(block) == K
    # The target accepted block[:rejected_at] and sent a correction that differs from the draft's token.
    correction = (block[rejected_at] + 1) % 49152 if rejected_at < K else 77
    committed = [*block[:rejected_at], correction]
    drafter.commit(len(PROMPT), committed)
    fresh = ModelDrafter(draft_model, PROMPT + committed, SamplingParams(), False)
    assert drafter.propose(K).tokens == fresh.propose(K).tokens
    # The cache kept the shared prefix instead of re-reading the prompt.
    assert drafter.cached_tokens >= len(PROMPT) + rejected_at


def test_sampling_returns_the_distributions_it_sampled_from(draft_model):
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    drafter = ModelDrafter(draft_model, PROMPT, params, True)
    block = drafter.propose(4)
    assert block.probs is not None and block.probs.shape == (4, 49152)
    assert torch.allclose(block.probs.sum(-1), torch.ones(4), atol=1e-5)
    for row, token in zip(block.probs, block.tokens):
        assert row[token] > 0
        assert int((row > 0).sum()) <= 20


def test_rollback_outside_context_is_refused(draft_model):
    drafter = ModelDrafter(draft_model, PROMPT, SamplingParams(), False)
    with pytest.raises(ValueError, match="outside the context"):
        drafter.rollback(len(PROMPT) + 1)
    with pytest.raises(ValueError, match="past the drafter's context"):
        drafter.commit(len(PROMPT) + 2, [1])


def _tied_head_model(model_dir, low: int, high: int):
    """The tiny draft with an LM head whose logits are a fixed vector: ``low`` and ``high`` tie for the top."""
    model = models.load_model(models.ModelSpec(str(model_dir)))
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.rand(model.config.vocab_size, generator=torch.Generator().manual_seed(0)))
        head.bias[low] = head.bias[high] = 5.0
    model.lm_head = head
    return model


def test_a_top_two_tie_gives_distinct_siblings(tiny_draft_dir):
    low, high = 7, 9000
    drafter = ModelDrafter(_tied_head_model(tiny_draft_dir, low, high), PROMPT, SamplingParams(), False)
    tree = drafter.propose_tree(3, max_branches=2, max_nodes=8)
    assert tree.tokens[0] == low  # the argmax takes the lower id of a tie
    groups = [[tree.tokens[i] for i in kids] for kids in token_tree.children(tree.parents) if len(kids) > 1]
    assert groups == [[low, high]]  # the runner-up is the other tied token, never the chain's


def test_a_fork_copies_the_sources_context_and_proposes_what_a_fresh_drafter_would(draft_model, tiny_target_dir):
    source = ModelDrafter(draft_model, PROMPT, SamplingParams(), False)
    source.prepare()
    source.propose(K)  # its cache now also holds a drafted block past the context
    fork = ModelDrafter(draft_model, PROMPT, SamplingParams(), False)
    assert fork.prepare_from(source) == len(PROMPT) - 1 and fork.cached_tokens == len(PROMPT) - 1
    assert fork.propose(K).tokens == ModelDrafter(draft_model, PROMPT, SamplingParams(), False).propose(K).tokens
    other_model = ModelDrafter(
        models.load_model(models.ModelSpec(str(tiny_target_dir))), PROMPT, SamplingParams(), False
    )
    other_context = ModelDrafter(draft_model, [12, *PROMPT[1:]], SamplingParams(), False)
    for drafter in (other_model, other_context):  # nothing exact to copy: each reads its own context
        assert drafter.prepare_from(source) == 0 and drafter.cached_tokens == len(PROMPT) - 1


@pytest.mark.parametrize("budget", [1, 3, 64])
def test_a_context_read_in_chunks_proposes_what_one_read_does(draft_model, budget):
    prompt = [(13 * i) % 500 + 2 for i in range(40)]
    whole = ModelDrafter(draft_model, prompt, SamplingParams(), False)
    assert whole.prepare() and whole.cached_tokens == len(prompt) - 1
    chunked, reads = ModelDrafter(draft_model, prompt, SamplingParams(), False), []
    while not chunked.prepare(budget):
        reads.append(chunked.cached_tokens)
    assert all(0 < b - a <= budget for a, b in zip([0, *reads], reads))  # each call reads at most the budget
    assert len(reads) == -(-(len(prompt) - 1) // budget) - 1
    assert chunked.cached_tokens == len(prompt) - 1 and chunked.prepare(budget)  # read: nothing more to do
    assert chunked.propose(K).tokens == whole.propose(K).tokens
