"""Sampling through the whole system: seeded runs reproduce, and the output distribution is the target's.

The pure verifier has its own exact and statistical tests
(tests/unit/target_service/test_rejection.py, tests/stats/test_rejection.py); these check the wired system: the draft's q and the target's p processed by
the same function, q on the wire in fp16, per-session generators, rollback.
"""

from __future__ import annotations

import asyncio
import collections

import pytest
import torch
from scipy import stats

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams, logits_to_probs
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from tests.conftest import run_async

pytestmark = pytest.mark.services

PROMPT = [504, 2365, 6354]  # a few SmolLM2 token ids


async def sample_many(
    services, target_dir, runs, k, drafter, mode, sampling, max_new_tokens, seed0=0, prompt=PROMPT,
    tree_branches=1, tree_rounds=None, concurrent=1,
):
    """Outputs of seeds seed0, seed0 + 1, ..., in order; ``concurrent`` sessions at a time (their blocks share
    the target's forwards)."""
    # A draft block is never late here (a late one makes that round k = 0: in TOKEN_ONLY and DRAFT_PROBS modes
    # the tokens depend on how blocks fall, so a loaded machine would change a seed's output).
    config = OrchestratorConfig(services.target_address, services.draft_address, tokenizer=str(target_dir),
                                link_policy=LinkPolicy(draft_deadline_s=LinkPolicy().draft_timeout_s))
    orch = await Orchestrator.connect(config)

    async def one(seed):
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed)
        request = GenerationRequest(
            "", False, max_new_tokens, params, (), k, drafter, mode is VerificationMode.DRAFT_PROBS,
            sampling_mode=mode, tree_branches=tree_branches,
        )
        ids: list[int] = []
        async for event in orch.generate(request, prompt):
            ids.extend(event.token_ids)
            if event.stats is not None and tree_rounds is not None:
                tree_rounds.append(event.stats.tree_rounds)
        return tuple(ids)

    outputs = []
    try:
        for start in range(seed0, seed0 + runs, concurrent):
            outputs += await asyncio.gather(*(one(seed) for seed in range(start, min(start + concurrent, seed0 + runs))))
    finally:
        await orch.close()
    return outputs


MODES = [  # each sampling verification mode named explicitly (a request that names none gets the server's default)
    pytest.param(DrafterKind.MODEL, VerificationMode.DRAFT_PROBS, id="draft-probs"),
    pytest.param(DrafterKind.MODEL, VerificationMode.TOKEN_ONLY, id="token-only-model"),
    pytest.param(DrafterKind.NGRAM, VerificationMode.COUPLED, id="coupled-ngram"),
]


@pytest.mark.parametrize("drafter,mode", MODES)
def test_seeded_sampling_is_reproducible(tiny_services, tiny_target_dir, drafter, mode):
    sampling = SamplingParams(temperature=1.5, top_k=50, top_p=0.95)
    first = run_async(sample_many(tiny_services, tiny_target_dir, 4, 4, drafter, mode, sampling, 20))
    again = run_async(sample_many(tiny_services, tiny_target_dir, 4, 4, drafter, mode, sampling, 20))
    other = run_async(sample_many(tiny_services, tiny_target_dir, 4, 4, drafter, mode, sampling, 20, seed0=100))
    assert first == again
    assert first != other


def exact_first_two(model_dir, sampling: SamplingParams, prompt=PROMPT) -> dict[tuple[int, int], float]:
    """The target's own joint distribution of the first two sampled tokens."""
    from specsplit.lmkit import models

    model = models.load_model(models.ModelSpec(str(model_dir)))
    with torch.inference_mode():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
        joint = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = logits_to_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1:], sampling)[0]
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("drafter,mode", MODES[:2])
def test_system_output_distribution_is_the_targets(tiny_services, tiny_target_dir, drafter, mode):
    sampling = SamplingParams(temperature=4.0, top_k=3)
    exact = exact_first_two(tiny_target_dir, sampling)
    runs = 1500
    samples = run_async(sample_many(tiny_services, tiny_target_dir, runs, 2, drafter, mode, sampling, 2, concurrent=16))
    assert_distributed_as(samples, exact)


@pytest.mark.parametrize("mode", [VerificationMode.TOKEN_ONLY, VerificationMode.COUPLED])
def test_token_trees_keep_system_sampling_lossless(tiny_services, tiny_target_dir, mode):
    """n-gram trees (the suffix 5 6 occurred twice before, with different continuations), sampled: TOKEN_ONLY
    tries the children against the residual, COUPLED follows the child carrying the target's coupled token."""
    prompt = [5, 6, 7, 9, 5, 6, 8, 9, 5, 6]
    sampling = SamplingParams(temperature=4.0, top_k=3)
    exact = exact_first_two(tiny_target_dir, sampling, prompt)
    trees: list[int] = []
    runs = 800  # ~89 expected per cell on average over the 9 (t1, t2) pairs
    samples = run_async(
        sample_many(tiny_services, tiny_target_dir, runs, 2, DrafterKind.NGRAM, mode, sampling, 2,
                    prompt=prompt, tree_branches=4, tree_rounds=trees, concurrent=16)
    )
    assert sum(trees) >= runs  # every first round verified a tree
    assert_distributed_as(samples, exact)


@pytest.mark.parametrize("mode", [VerificationMode.TOKEN_ONLY, VerificationMode.COUPLED])
def test_recycled_trees_keep_system_sampling_lossless(tiny_services, tiny_target_dir, mode):
    """Token recycling's trees, sampled: each round's successors come from the target's earlier verifications (this
    session's and the caller's other sessions'), so later runs draft trees from the first ones' reports."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    sampling = SamplingParams(temperature=4.0, top_k=3)
    trees: list[int] = []
    samples = run_async(
        sample_many(tiny_services, tiny_target_dir, 800, 3, DrafterKind.RECYCLING, mode, sampling, 3,
                    prompt=prompt, tree_branches=4, tree_rounds=trees, concurrent=16)
    )
    assert sum(trees) > 0
    assert_distributed_as([s[:2] for s in samples], exact_first_two(tiny_target_dir, sampling, prompt))


def assert_distributed_as(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> None:
    """χ² of sampled token pairs against the target's exact joint; nothing outside its support."""
    counts = collections.Counter(samples)
    assert set(counts) <= set(exact), "sampled a pair outside the target's support"
    cells = sorted(exact)
    observed = [counts.get(c, 0) for c in cells]
    expected = [exact[c] for c in cells]
    scale = sum(observed) / sum(expected)
    result = stats.chisquare(observed, [e * scale for e in expected])
    assert result.pvalue > 1e-3, (result, dict(counts), exact)
