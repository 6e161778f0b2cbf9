"""The real target (SmolLM2) on the paths a served target takes that the tiny models cannot stand in for alone:
a long prompt prefilled in chunks far smaller than it, beside other sessions, through the real scheduler; and the
CUDA-graph step's code (``--compile cuda-graphs``, uncaptured on the CPU) verifying blocks with rejections. Each
output is the stock model's own greedy continuation (transformers' forward).
"""

from __future__ import annotations

import pytest

from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.lmkit import graph_step, models
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine
from tests.conftest import Services, make_engines, reference_greedy, run_async

pytestmark = [pytest.mark.services, pytest.mark.slow]

NEW = 24
CHUNK, MAX_BLOCK = 16, 8


@pytest.fixture(scope="module")
def smollm2():
    return models.load_model(models.ModelSpec("smollm2-135m"))


@pytest.fixture(scope="module")
def prompts(smollm2):
    """A long prompt (every demo prompt in one user turn) and two short ones, with the model's own continuations."""
    tokenizer = models.load_tokenizer("smollm2-135m")

    def chat(text: str) -> list[int]:
        turn = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(turn, add_generation_prompt=True)["input_ids"])

    ids = [chat("\n\n".join(p.text for p in DEMO_PROMPTS)), chat(DEMO_PROMPTS[0].text), chat(DEMO_PROMPTS[1].text)]
    assert len(ids[0]) > 8 * CHUNK  # many chunks
    expected = [reference_greedy(smollm2, p, NEW) for p in ids]
    assert min(map(len, expected)) >= 12  # an answer may end (EOS) before NEW tokens, not this soon
    return ids, expected


def test_a_long_prompt_prefilled_in_small_chunks_beside_others_gives_the_targets_output(background_loop, prompts):
    from tests.services.test_speed_e2e import request, run_with

    target, draft = make_engines("smollm2-135m", None, max_block=MAX_BLOCK, prefill_chunk=CHUNK)
    services = Services(background_loop, target, draft)
    prompt_ids, expected = prompts
    jobs = [(request(4, DrafterKind.NGRAM, max_new=NEW), ids) for ids in prompt_ids]
    try:
        outputs = run_async(run_with(services, "smollm2-135m", jobs, concurrent=True))
    finally:
        services.stop()
    assert [ids for ids, _ in outputs] == expected
    assert target.prefill_chunks >= len(prompt_ids[0]) // CHUNK - 1  # the long prompt went in chunks


def test_the_cuda_graph_steps_code_verifies_blocks_as_the_target_decodes(smollm2, prompts):
    """Three sessions in slots of the static step (two at a time in a batch bucket), each fed blocks whose second
    token is wrong every other step: one token accepted, the rest rolled back; every output the model's own."""
    from specsplit.target_service.engine import VerifyItem

    prompt_ids, expected = prompts
    capacity = max(map(len, prompt_ids)) + NEW + 2 * (MAX_BLOCK + 1)
    step = graph_step.GraphStep(smollm2, slots=3, capacity=capacity, max_width=MAX_BLOCK + 1, max_batch=2)
    slots = graph_step.Slots(3)
    engine = TargetEngine(smollm2, model_id="smollm2-135m", vocab_fingerprint="",
                          limits=SessionLimits(max_block=MAX_BLOCK), compile_mode="cuda-graphs",
                          new_cache=lambda: graph_step.GraphSessionCache(smollm2, step, slots),
                          max_context=capacity - MAX_BLOCK - 1)
    sessions = [engine.open(f"s{i}", p, SamplingParams(), VerificationMode.GREEDY) for i, p in enumerate(prompt_ids)]
    accepted = rejected = 0
    for round_ in range(16):
        items = []
        for i, session in enumerate(sessions):
            out = session.tokens[len(prompt_ids[i]) :]
            if len(out) > len(expected[i]) - 4:  # a block and its bonus would pass the known continuation
                continue
            truth = expected[i][len(out) : len(out) + 3]
            wrong = [truth[0], (truth[1] + 1) % 49152, truth[2]]
            items.append(VerifyItem(session, len(session.tokens), wrong if round_ % 2 else truth, None))
        for item, outcome in zip(items, engine.verify_batch(items)):
            accepted += outcome.accepted
            rejected += outcome.accepted < len(item.draft_tokens)
    for i, session in enumerate(sessions):
        out = session.tokens[len(prompt_ids[i]) :]
        assert out == expected[i][: len(out)] and len(out) > len(expected[i]) - 4
    assert accepted > 0 and rejected > 0
