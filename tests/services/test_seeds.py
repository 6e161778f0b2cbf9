"""Seeds through the whole system: what a seed promises, kept under faults, K, overlap and batching.

Every draw is keyed by (seed, stream, absolute position, index) (``specsplit.lmkit.draws``),
so a lost target session re-opened from the committed tokens decides each
position with the same draws it would have used had nothing happened: the
output of a seed does not depend on how often the target loses its sessions.

In COUPLED mode the output is a function of the seed alone: the same tokens
whatever k (0, 1, 4, 8, adaptive), drafter, overlap, concurrency (batched
verification) or target reopen; a draft running the target's own weights is
accepted every time, which shows draft and target use the same noise.
"""

from __future__ import annotations

import asyncio

import pytest

from specsplit.lmkit import errors
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.links import LinkPolicy
from specsplit.target_service.engine import TargetEngine
from tests.conftest import Services, make_engines, run_async

pytestmark = pytest.mark.services

PROMPT = [504, 2365, 6354]  # a few SmolLM2 token ids
NEW = 16


class OneRoundTarget(TargetEngine):
    """Loses every session after its first verification: the next block finds it gone (NOT_FOUND)."""

    def verify_batch(self, items):
        lost = [item.session.rounds > 0 for item in items]
        done = iter(super().verify_batch([item for item, gone in zip(items, lost) if not gone]))
        return [errors.NotFound("session lost (test: one round per session)") if gone else next(done) for gone in lost]


@pytest.fixture(scope="module")
def forgetful_target(background_loop, tiny_services):
    """A second target server over the same model whose sessions last one round each."""
    plain = tiny_services.target_engine
    engine = OneRoundTarget(plain.model, model_id=plain.model_id, vocab_fingerprint=plain.vocab_fingerprint,
                            limits=plain.limits)
    services = Services(background_loop, engine, tiny_services.draft_engine)
    yield services
    services.stop()


async def collect(orch: Orchestrator, request: GenerationRequest) -> tuple[list[int], object]:
    ids, stats = [], None
    async for event in orch.generate(request, PROMPT):
        ids.extend(event.token_ids)
        stats = event.stats or stats
    return ids, stats


async def generate_on_each(
    services_list, tokenizer_dir, requests, concurrent: bool = False
) -> list[list[tuple[list[int], object]]]:
    """Every request through an orchestrator on each of ``services_list``: results[service][request]."""
    results = []
    for services in services_list:
        # A draft block that misses its deadline changes the blocks, and so the tokens of a seed outside
        # COUPLED mode (docs/protocol.md#seeds): a deadline no loaded machine reaches keeps the blocks fixed.
        policy = LinkPolicy(target_retry_s=0.01, draft_deadline_s=5.0)
        config = OrchestratorConfig(services.target_address, services.draft_address, str(tokenizer_dir),
                                    link_policy=policy)
        orch = await Orchestrator.connect(config)
        try:
            if concurrent:
                results.append(list(await asyncio.gather(*(collect(orch, request) for request in requests))))
            else:
                results.append([await collect(orch, request) for request in requests])
        finally:
            await orch.close()
    return results


@pytest.mark.parametrize(
    "k, drafter, draft_probs",
    [(0, DrafterKind.NGRAM, False), (4, DrafterKind.MODEL, False), (4, DrafterKind.MODEL, True)],
    ids=["target-only", "token-only", "draft-probs"],
)
def test_a_target_losing_every_session_gives_the_same_tokens_for_a_seed(
    tiny_services, forgetful_target, tiny_target_dir, k, drafter, draft_probs
):
    requests = [
        GenerationRequest("", False, NEW, SamplingParams(temperature=1.0, top_k=50, seed=seed), (), k, drafter,
                          draft_probs)
        for seed in (1, 2, 3)
    ]
    steady, lost = run_async(generate_on_each([tiny_services, forgetful_target], tiny_target_dir, requests))
    assert all(stats.target_reopens >= 2 for _, stats in lost)  # the sessions really were lost
    assert [ids for ids, _ in lost] == [ids for ids, _ in steady]


def coupled(seed: int, k: int, drafter=DrafterKind.MODEL, *, adaptive=False, overlap=False,
            branches: int = 1) -> GenerationRequest:
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
    return GenerationRequest("", False, NEW, sampling, (), k, drafter, False, adaptive, (), overlap,
                             sampling_mode=VerificationMode.COUPLED, tree_branches=branches)


SETTINGS = [  # (k, drafter, adaptive, overlap): every way a seed's run may be scheduled
    (1, DrafterKind.MODEL, False, False),
    (4, DrafterKind.MODEL, False, True),
    (8, DrafterKind.MODEL, False, False),
    (8, DrafterKind.MODEL, True, True),
    (4, DrafterKind.NGRAM, False, True),
    (8, DrafterKind.NGRAM, True, False),
]
SEEDS = (5, 6)


@pytest.fixture(scope="module")
def target_only_tokens(tiny_services, tiny_target_dir):
    """Coupled sampling at k = 0, per seed: what every other schedule must reproduce."""
    (results,) = run_async(generate_on_each([tiny_services], tiny_target_dir, [coupled(s, 0) for s in SEEDS]))
    tokens = [ids for ids, _ in results]
    assert len(set(map(tuple, tokens))) == len(SEEDS)  # the seed matters
    return dict(zip(SEEDS, tokens))


def test_coupled_tokens_depend_on_the_seed_alone(tiny_services, tiny_target_dir, target_only_tokens):
    requests = [coupled(seed, k, d, adaptive=a, overlap=o) for seed in SEEDS for k, d, a, o in SETTINGS]
    (results,) = run_async(generate_on_each([tiny_services], tiny_target_dir, requests))
    for request, (ids, stats) in zip(requests, results):
        assert stats.mode == VerificationMode.COUPLED.value
        assert ids == target_only_tokens[request.sampling.seed], request


@pytest.mark.parametrize("drafter", [DrafterKind.MODEL, DrafterKind.NGRAM])
def test_coupled_token_trees_give_the_seeds_own_tokens(tiny_services, tiny_target_dir, target_only_tokens, drafter):
    """Trees in COUPLED mode: each depth follows the child carrying the target's coupled token, so every tree
    the drafter offers leaves the seed's tokens as they are at k = 0."""
    requests = [coupled(seed, 6, drafter, branches=4, overlap=overlap) for seed in SEEDS for overlap in (False, True)]
    (results,) = run_async(generate_on_each([tiny_services], tiny_target_dir, requests))
    for request, (ids, _stats) in zip(requests, results):
        assert ids == target_only_tokens[request.sampling.seed], request
    if drafter is DrafterKind.MODEL:  # the model's second choices make a tree every round
        assert sum(stats.tree_rounds for _, stats in results) > 0


def test_coupled_tokens_survive_a_target_that_loses_every_session(forgetful_target, tiny_target_dir, target_only_tokens):
    requests = [coupled(seed, 4) for seed in SEEDS] + [coupled(seed, 0) for seed in SEEDS]
    (results,) = run_async(generate_on_each([forgetful_target], tiny_target_dir, requests))
    for request, (ids, stats) in zip(requests, results):
        assert stats.target_reopens >= 2
        assert ids == target_only_tokens[request.sampling.seed], request


@pytest.mark.parametrize("drafter", [DrafterKind.NGRAM, DrafterKind.MODEL])
def test_coupled_tokens_are_the_same_in_eight_concurrent_sessions(tiny_services, tiny_target_dir, drafter):
    """Eight sessions at once give each seed's tokens. With the model drafter the draft service, one compute thread
    for every session, may be the slower side: its blocks then reach the target one at a time, and whether any
    two share a forward depends on the machine; the n-gram drafter's blocks come at once, so they do."""
    seeds = range(20, 28)
    alone = run_async(generate_on_each([tiny_services], tiny_target_dir, [coupled(s, 4, drafter) for s in seeds]))[0]
    together = run_async(generate_on_each(
        [tiny_services], tiny_target_dir, [coupled(s, 4, drafter, overlap=True) for s in seeds], concurrent=True))[0]
    assert [ids for ids, _ in together] == [ids for ids, _ in alone]
    if drafter is DrafterKind.NGRAM:
        assert max(stats.mean_batch_size for _, stats in together) > 1  # they did share forwards


@pytest.fixture(scope="module")
def self_draft(background_loop, tiny_target_dir):
    target, draft = make_engines(str(tiny_target_dir), str(tiny_target_dir))
    services = Services(background_loop, target, draft)
    yield services
    services.stop()


def test_a_draft_with_the_targets_weights_is_always_accepted_in_coupled_mode(self_draft, tiny_target_dir):
    (results,) = run_async(generate_on_each([self_draft], tiny_target_dir, [coupled(s, 4) for s in SEEDS]))
    for _, stats in results:
        assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens
