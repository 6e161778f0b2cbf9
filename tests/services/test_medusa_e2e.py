"""Medusa drafting through the real services: the target sends its final hidden state of committed positions,
the draft's heads turn the last one into a tree, and the output stays the target's (greedy, token for token;
sampled, in distribution)."""

from __future__ import annotations

import pytest
import torch

from specsplit.draft_service import medusa
from specsplit.draft_service.engine import DraftEngine
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine
from tests.conftest import Services, run_async
from tests.services.test_greedy_e2e import generate_all
from tests.services.test_sampling_e2e import assert_distributed_as, exact_first_two, sample_many

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def medusa_services(background_loop, tiny_target_dir, tmp_path_factory):
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(str(tiny_target_dir)))
    target_model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    target = TargetEngine(target_model, model_id=str(tiny_target_dir), vocab_fingerprint=fingerprint,
                          limits=SessionLimits(max_block=16))
    draft_model = models.load_model(models.ModelSpec(str(tiny_target_dir)))  # the draft's own copy of the target
    torch.manual_seed(3)
    heads = medusa.new_heads(draft_model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    folder = medusa.save_heads(heads, tmp_path_factory.mktemp("medusa"))
    draft = DraftEngine(draft_model, model_id=str(tiny_target_dir), vocab_fingerprint=fingerprint,
                        limits=SessionLimits(max_block=16),
                        derived={DrafterKind.MEDUSA: medusa.load_heads(folder, draft_model)})
    services = Services(background_loop, target, draft)
    yield services
    services.stop()


@pytest.mark.parametrize("branches", [1, 4])
def test_medusa_greedy_equals_the_targets_own(medusa_services, tiny_target_dir, tiny_reference, branches):
    prompts_ids, expected = tiny_reference
    stats: list = []
    got = run_async(generate_all(medusa_services, str(tiny_target_dir), prompts_ids, 3, DrafterKind.MEDUSA, 24,
                                 branches=branches, stats=stats))
    assert got == expected
    assert sum(s.drafted_tokens for s in stats) > 0 and sum(s.feature_bytes for s in stats) > 0
    if branches > 1:
        assert sum(s.tree_rounds for s in stats) > 0


@pytest.mark.parametrize("mode", [VerificationMode.TOKEN_ONLY])  # COUPLED trees: test_sampling_e2e's drafters
def test_medusa_trees_keep_sampling_lossless(medusa_services, tiny_target_dir, mode):
    sampling = SamplingParams(temperature=4.0, top_k=3)
    prompt = [504, 2365, 6354]
    trees: list[int] = []
    # Three tokens: the first round has no features yet (target-only); the second verifies a tree of the heads'
    # guesses, which decides the second token.
    samples = run_async(sample_many(medusa_services, tiny_target_dir, 800, 3, DrafterKind.MEDUSA, mode, sampling, 3,
                                    prompt=prompt, tree_branches=4, tree_rounds=trees, concurrent=16))
    assert sum(trees) > 0
    assert_distributed_as([s[:2] for s in samples], exact_first_two(tiny_target_dir, sampling, prompt))
