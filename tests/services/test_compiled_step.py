"""serve-target --compile inductor: the decoder step compiled at start-up gives the target's own greedy output.

The tiny target is compiled once for the module (a few seconds; the compile cache makes a second start
cheaper). Chains of both drafters, token trees and several sessions batched into one forward all equal
the target's own greedy continuations, as the eager step's do (test_greedy_e2e); sampled chains and coupled
trees are distributed as the target (χ²). Bad --compile values are
refused at start-up with a message that names the choices.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from tests.conftest import Services, make_engines, run_async
from tests.services.test_greedy_e2e import generate_all, generate_ids
from tests.services.test_sampling_e2e import assert_distributed_as, exact_first_two, sample_many

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def compiled_services(background_loop, tiny_target_dir, tiny_draft_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    target, draft = make_engines(str(tiny_target_dir), str(tiny_draft_dir), compile_mode="inductor")
    services = Services(background_loop, target, draft)
    yield services
    services.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_step_was_compiled_at_start(compiled_services):
    assert compiled_services.target_engine.forward_kind.startswith("the decoder step, compiled by inductor in")


@pytest.mark.parametrize("drafter,k", [(DrafterKind.NGRAM, 0), (DrafterKind.NGRAM, 4), (DrafterKind.MODEL, 4)])
def test_compiled_greedy_equals_generate(compiled_services, tiny_target_dir, tiny_reference, drafter, k):
    prompts_ids, expected = tiny_reference
    assert run_async(generate_all(compiled_services, str(tiny_target_dir), prompts_ids, k, drafter, 24)) == expected


def test_compiled_token_trees_equal_generate(compiled_services, tiny_target_dir, tiny_reference):
    prompts_ids, expected = tiny_reference
    trees: list[tuple[int, int]] = []
    got = run_async(generate_all(compiled_services, str(tiny_target_dir), prompts_ids, 6, DrafterKind.MODEL, 24,
                                 False, 4, trees))
    assert got == expected and sum(rounds for rounds, _ in trees) > 0


def test_compiled_batched_sessions_equal_generate(compiled_services, tiny_target_dir, tiny_reference):
    """Every prompt at once: the target packs the sessions' blocks into shared forwards."""
    prompts_ids, expected = tiny_reference
    engine = compiled_services.target_engine
    passes_before = engine.forward_passes

    async def go():
        config = OrchestratorConfig(compiled_services.target_address, compiled_services.draft_address,
                                    tokenizer=str(tiny_target_dir))
        orch = await Orchestrator.connect(config)
        stats: list = []
        try:
            got = await asyncio.gather(*(generate_ids(orch, ids, 4, DrafterKind.NGRAM, 24, stats=stats)
                                         for ids in prompts_ids))
        finally:
            await orch.close()
        return got, stats

    got, stats = run_async(go())
    assert got == expected
    rounds = sum(s.rounds for s in stats)
    assert engine.forward_passes - passes_before < rounds  # some forwards carried several sessions


@pytest.mark.parametrize("drafter,mode,prompt,branches", [
    pytest.param(DrafterKind.MODEL, VerificationMode.DRAFT_PROBS, [504, 2365, 6354], 1, id="draft-probs-chains"),
    # n-gram trees (the suffix 5 6 occurred twice, with different continuations) in the default sampling mode
    pytest.param(DrafterKind.NGRAM, VerificationMode.COUPLED, [5, 6, 7, 9, 5, 6, 8, 9, 5, 6], 4, id="coupled-trees"),
])
def test_compiled_sampling_is_distributed_as_the_target(compiled_services, tiny_target_dir, drafter, mode, prompt,
                                                        branches):
    """χ² of the first two sampled tokens against the target's exact joint, sessions batched in the compiled
    step's forwards (the pure verifiers' negative controls are in tests/stats)."""
    sampling = SamplingParams(temperature=4.0, top_k=3)
    trees: list[int] = []
    samples = run_async(sample_many(compiled_services, tiny_target_dir, 800, 2, drafter, mode, sampling, 2,
                                    prompt=prompt, tree_branches=branches, tree_rounds=trees, concurrent=16))
    assert (sum(trees) >= 800) == (branches > 1)  # every first round verified a tree, where trees were asked for
    assert_distributed_as(samples, exact_first_two(tiny_target_dir, sampling, prompt))


@pytest.mark.parametrize("flags,says", [
    (["--compile", "tensorrt"], "invalid choice: 'tensorrt' (choose from 'off', 'auto', 'inductor', 'cuda-graphs')"),
    (["--compile", "cuda-graphs"], "--compile cuda-graphs captures CUDA graphs: it needs --device cuda, not cpu"),
    (["--compile", "inductor", "--stock-forward"], "--compile inductor compiles the fast forward"),
])
def test_a_bad_compile_flag_is_refused_at_start(flags, says):
    run = subprocess.run([sys.executable, "-m", "specsplit.target_service.server", "--port", "0", *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def _greedy_run(engine, prompt: list[int], steps: int, allowed=None) -> tuple[list[int], list[int]]:
    """k = 0 steps of a session and of a second one forked from its prompt, interleaved: each one's new tokens."""
    import torch

    from specsplit.lmkit.kinds import VerificationMode
    from specsplit.lmkit.sampling import SamplingParams

    mask = None if allowed is None else torch.zeros(1, engine.vocab_size, dtype=torch.bool)
    if mask is not None:
        mask[0, allowed] = True
    first = engine.open("compiled-a", prompt, SamplingParams(), VerificationMode.GREEDY)
    shared_before = engine.shared_tokens
    second = engine.open("compiled-b", prompt, SamplingParams(), VerificationMode.GREEDY, fork_from="compiled-a")
    assert engine.shared_tokens > shared_before  # the fork copied the prompt's keys/values
    try:
        for _ in range(steps):
            for session in (first, second):
                engine.verify(session, len(session.tokens), [], None, None, mask)
        return first.tokens[len(prompt):], second.tokens[len(prompt):]
    finally:
        engine.close("compiled-a")
        engine.close("compiled-b")


def test_compiled_forks_and_masks_commit_the_eager_steps_tokens(compiled_services, tiny_services, tiny_reference):
    """A forked session (n samples of one prompt) and a grammar-style mask: the compiled step commits what the
    eager step commits; unmasked, both forks are the target's own greedy continuation."""
    prompts_ids, expected = tiny_reference
    compiled, eager = compiled_services.target_engine, tiny_services.target_engine
    assert eager.forward_kind == "the decoder step, eager"
    a, b = _greedy_run(compiled, prompts_ids[0], 12)
    assert a == b == expected[0][:12]
    allowed = list(range(0, compiled.vocab_size, 3))  # every third id: the model's own choices are mostly banned
    masked = _greedy_run(compiled, prompts_ids[1], 10, allowed)
    assert masked == _greedy_run(eager, prompts_ids[1], 10, allowed)
    assert all(t % 3 == 0 for t in masked[0]) and masked[0] != expected[1][:10]


def test_a_target_the_step_does_not_run_on_says_why_compile_did_nothing(tiny_target_dir):
    from specsplit.lmkit import models
    from specsplit.lmkit.sessions import SessionLimits
    from specsplit.target_service.engine import TargetEngine

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    engine = TargetEngine(model, model_id="t", vocab_fingerprint="", limits=SessionLimits(), fast_forward=False,
                          compile_mode="inductor")
    assert engine.forward_kind == ("transformers' stock forward (--compile inductor applies to the fast forward, "
                                   "which is off)")
