"""Greedy output through draft_service + target_service + orchestrator equals the target's own generate().

Token for token, for 8 prompts and K in {1, 4, 8}, with both drafters; on a
tiny random target (fast) and on the real SmolLM2 target with the default
(n-gram) drafter.
"""

from __future__ import annotations

import pytest

from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from tests.conftest import TINY_PROMPTS, Services, make_engines, reference_greedy, run_async

pytestmark = pytest.mark.services


async def generate_ids(
    orch: Orchestrator, prompt_ids, k, drafter, max_new_tokens, adaptive=False, branches=1, tree_rounds=None,
    overlap=False, stats=None,
) -> list[int]:
    request = GenerationRequest(
        "", False, max_new_tokens, SamplingParams(), (), k, drafter, False, adaptive, overlap=overlap,
        tree_branches=branches,
    )
    ids: list[int] = []
    async for event in orch.generate(request, prompt_ids):
        ids.extend(event.token_ids)
        if event.stats is not None and tree_rounds is not None:
            tree_rounds.append((event.stats.tree_rounds, event.stats.branch_accepted))
        if event.stats is not None and stats is not None:
            stats.append(event.stats)
    return ids


async def generate_all(
    services: Services, tokenizer_ref, prompts_ids, k, drafter, max_new_tokens, adaptive=False, branches=1,
    tree_rounds=None, overlap=False, stats=None,
) -> list[list[int]]:
    """Each prompt's new tokens, one generation after another on one orchestrator (``stats``: each one's
    GenerationStats appended)."""
    config = OrchestratorConfig(services.target_address, services.draft_address, tokenizer=tokenizer_ref)
    orch = await Orchestrator.connect(config)
    try:
        return [
            await generate_ids(orch, ids, k, drafter, max_new_tokens, adaptive, branches, tree_rounds, overlap, stats)
            for ids in prompts_ids
        ]
    finally:
        await orch.close()


@pytest.mark.parametrize("drafter", [DrafterKind.MODEL, DrafterKind.NGRAM])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_tiny_greedy_equals_generate(tiny_services, tiny_target_dir, tiny_reference, k, drafter):
    prompts_ids, expected = tiny_reference
    got = run_async(generate_all(tiny_services, str(tiny_target_dir), prompts_ids, k, drafter, 24))
    for prompt, want, have in zip(TINY_PROMPTS, expected, got):
        assert have == want, f"k={k} {drafter.name} diverged on {prompt!r}"
    assert tiny_services.target_engine.sessions.stats()[0] == 0  # every session ended with its stream


@pytest.mark.parametrize("drafter", [DrafterKind.MODEL, DrafterKind.NGRAM])
def test_tiny_greedy_with_adaptive_k_equals_generate(tiny_services, tiny_target_dir, tiny_reference, drafter):
    prompts_ids, expected = tiny_reference
    got = run_async(generate_all(tiny_services, str(tiny_target_dir), prompts_ids, 8, drafter, 24, adaptive=True))
    assert got == expected


@pytest.mark.parametrize("adaptive, overlap", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("drafter", [DrafterKind.MODEL, DrafterKind.NGRAM])
def test_tiny_greedy_with_token_trees_equals_generate(
    tiny_services, tiny_target_dir, tiny_reference, drafter, adaptive, overlap
):
    """Rounds verify token trees (older n-gram matches; the model's second choices) and output stays the target's;
    with overlap, trees are drafted ahead too (several guesses of the bonus token) and used below the right one."""
    prompts_ids, expected = tiny_reference
    trees: list[tuple[int, int]] = []
    got = run_async(
        generate_all(tiny_services, str(tiny_target_dir), prompts_ids, 6, drafter, 24, adaptive, 4, trees, overlap)
    )
    assert got == expected
    if not adaptive and drafter is DrafterKind.MODEL:  # a fixed K sends every tree the drafter offers
        # The model's second choices make a tree every round; n-gram trees need earlier matches that
        # continued differently, which these outputs may not hold (test_sampling_e2e builds a prompt for them).
        assert sum(rounds for rounds, _ in trees) > 0


@pytest.mark.parametrize("branches", [1, 4])
def test_tiny_greedy_with_recycled_successors_equals_generate(tiny_services, tiny_target_dir, tiny_reference, branches):
    """The target returns its best successors of every verified position, the orchestrator forwards them, the draft
    drafts chains and trees from them: output stays the target's, and recycled drafts are accepted."""
    prompts_ids, expected = tiny_reference
    stats: list = []
    got = run_async(generate_all(tiny_services, str(tiny_target_dir), prompts_ids, 4, DrafterKind.RECYCLING, 24,
                                 branches=branches, stats=stats))
    assert got == expected
    assert sum(s.accepted_tokens for s in stats) > 0
    if branches > 1:
        assert sum(s.tree_rounds for s in stats) > 0


def test_tiny_drafts_are_accepted_and_rejected(tiny_services, tiny_target_dir, tiny_reference):
    """The equality runs above must hit both paths: some draft tokens accepted, some rejected."""
    prompts_ids, _ = tiny_reference

    async def go():
        config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
        orch = await Orchestrator.connect(config)
        totals = [0, 0]
        try:
            for ids in prompts_ids:
                request = GenerationRequest("", False, 24, SamplingParams(), (), 4, DrafterKind.NGRAM, False)
                async for event in orch.generate(request, ids):
                    if event.stats is not None:
                        totals[0] += event.stats.drafted_tokens
                        totals[1] += event.stats.accepted_tokens
        finally:
            await orch.close()
        return totals

    drafted, accepted = run_async(go())
    assert drafted > 0 and 0 < accepted < drafted


@pytest.fixture(scope="module")
def smollm2_services(background_loop):
    target, draft = make_engines("smollm2-135m", None)
    services = Services(background_loop, target, draft)
    yield services
    services.stop()


@pytest.fixture(scope="module")
def smollm2_reference():
    """The demo prompts (chat template) and the stock model's own greedy continuations: transformers' own
    forward, not the target's fast one (oneDNN linears, KV buffers, packed rows)."""
    from specsplit.lmkit import models

    tokenizer = models.load_tokenizer("smollm2-135m")
    prompts_ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)["input_ids"])
        for p in DEMO_PROMPTS
    ]
    model = models.load_model(models.ModelSpec("smollm2-135m"))
    return prompts_ids, [reference_greedy(model, ids, 32) for ids in prompts_ids]


@pytest.mark.slow
@pytest.mark.parametrize("k, branches", [(4, 1), (8, 4)])
def test_smollm2_greedy_equals_generate_with_default_drafter(smollm2_services, smollm2_reference, k, branches):
    """The real default target with the default (n-gram) drafter, 8 demo prompts, chat template; a chain of 4
    and token trees of up to 8 tokens in 4 branches (k 0, 1, 4 and 8 run on the tiny models above)."""
    services = smollm2_services
    prompts_ids, expected = smollm2_reference
    trees: list[tuple[int, int]] = []
    got = run_async(
        generate_all(services, "smollm2-135m", prompts_ids, k, DrafterKind.NGRAM, 32, branches=branches, tree_rounds=trees)
    )
    for prompt, want, have in zip(DEMO_PROMPTS, expected, got):
        assert have == want, f"k={k} branches={branches} diverged on {prompt.name}"
    assert services.target_engine.sessions.stats()[0] == 0
    if branches > 1:
        assert sum(rounds for rounds, _ in trees) > 0


@pytest.mark.slow
@pytest.mark.parametrize("branches", [4])  # chains of recycled successors: the tiny models' test above
def test_smollm2_greedy_equals_generate_with_recycled_successors(smollm2_services, smollm2_reference, branches):
    """The default target's own successors recycled into trees (the draft holds no model): the 8 demo prompts'
    output is the stock model's, and recycled drafts are accepted."""
    prompts_ids, expected = smollm2_reference
    stats: list = []
    got = run_async(generate_all(smollm2_services, "smollm2-135m", prompts_ids, 4, DrafterKind.RECYCLING, 32,
                                 branches=branches, stats=stats))
    for prompt, want, have in zip(DEMO_PROMPTS, expected, got):
        assert have == want, f"branches={branches} diverged on {prompt.name}"
    assert sum(s.accepted_tokens for s in stats) > 0
    if branches > 1:
        assert sum(s.tree_rounds for s in stats) > 0
