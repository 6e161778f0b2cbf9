"""Chunked prefill: a prompt longer than ``prefill_chunk`` is computed a chunk a step beside the other sessions'
verification rows, so their rounds go on while it prefills; its output is still the target's own greedy text.

The engine tests step ``verify_batch`` by hand (the scheduler's part: a block answered PREFILLING goes in the
next step again); the end-to-end test runs the real scheduler under gRPC with long and short prompts at once.
"""

from __future__ import annotations

import pytest

from specsplit.lmkit import models
from specsplit.lmkit.costs import LinearCost
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import PREFILLING, TargetEngine, VerifyItem, VerifyOutcome
from tests.conftest import TINY_PROMPTS, Services, reference_greedy, run_async

pytestmark = pytest.mark.services

CHUNK = 40  # at least a block (max_block 32 + 1)
LONG = [(7 * i + 3) % 4000 + 10 for i in range(150)]  # 150 prompt tokens: chunks of 40, 40, 40, then the rest
SHORT = [11, 300, 4000, 27, 9]


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


def engine_of(model, prefill_chunk: int | str, fingerprint: str = "") -> TargetEngine:
    return TargetEngine(model, model_id="tiny", vocab_fingerprint=fingerprint, limits=SessionLimits(max_block=32),
                        prefill_chunk=prefill_chunk)


def item(engine: TargetEngine, session_id: str, draft: list[int] = ()) -> VerifyItem:
    session = engine.sessions.get(session_id)
    return VerifyItem(session, len(session.tokens), list(draft), None)


def test_a_long_prompt_prefills_a_chunk_a_step_while_another_session_decodes(model):
    engine = engine_of(model, CHUNK)
    engine.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
    engine.open("short", SHORT, SamplingParams(), VerificationMode.GREEDY)
    long_out, short_out, waits = [], [], 0
    while len(long_out) < 12:
        results = engine.verify_batch([item(engine, "long"), item(engine, "short")])
        assert isinstance(results[1], VerifyOutcome)  # the short session commits every step
        short_out.append(results[1].next_token)
        if results[0] is PREFILLING:
            waits += 1
            assert not long_out  # only before its prompt is in
            continue
        long_out.append(results[0].next_token)
    assert waits == 3 and engine.prefill_chunks == 3  # 149 context positions to compute: 40 + 40 + 40, then 29
    assert long_out == reference_greedy(model, LONG, 12)
    assert short_out == reference_greedy(model, SHORT, len(short_out))


def test_blocks_after_a_chunked_prefill_verify_as_after_a_whole_one(model):
    """A block drafted for a long prompt (the reference's own continuation, so all of it is accepted) waits for
    the prompt's chunks and is then verified with its last chunk; a session without chunks answers the same."""
    expected = reference_greedy(model, LONG, 6)
    outcomes = {}
    for chunk in (0, CHUNK):
        engine = engine_of(model, chunk)
        engine.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
        steps = 1
        while (result := engine.verify_batch([item(engine, "long", expected[:4])])[0]) is PREFILLING:
            steps += 1
        outcomes[chunk] = (result.accepted, result.next_token, steps)
    assert outcomes[0] == (4, expected[4], 1)
    assert outcomes[CHUNK] == (4, expected[4], 4)


def test_short_prompts_and_a_budget_of_zero_are_not_chunked(model):
    engine = engine_of(model, CHUNK)
    assert engine.prefill_chunk == CHUNK and engine_of(model, 5).prefill_chunk == 33  # at least a block
    engine.open("short", LONG[:CHUNK], SamplingParams(), VerificationMode.GREEDY)
    assert isinstance(engine.verify_batch([item(engine, "short")])[0], VerifyOutcome)
    whole = engine_of(model, 0)
    whole.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
    assert isinstance(whole.verify_batch([item(whole, "long")])[0], VerifyOutcome) and whole.prefill_chunks == 0
    with pytest.raises(ValueError, match="--prefill-chunk must be auto or an int >= 0"):
        engine_of(model, -1)


def test_long_and_short_prompts_at_once_through_the_services_give_the_targets_output(
    model, tiny_target_dir, tiny_draft_dir, background_loop, gguf_tokenizer
):
    """Real gRPC, the real scheduler: two long prompts (chunked, one after the other within a step's budget) and
    the short prompts, all at once, speculating with the model drafter; every output is the target's own."""
    from specsplit.draft_service.engine import DraftEngine
    from tests.services.test_speed_e2e import request, run_with

    fingerprint = models.vocab_fingerprint(gguf_tokenizer)
    target = engine_of(models.load_model(models.ModelSpec(str(tiny_target_dir))), CHUNK, fingerprint)
    draft = DraftEngine(models.load_model(models.ModelSpec(str(tiny_draft_dir))), model_id=str(tiny_draft_dir),
                        vocab_fingerprint=fingerprint, limits=SessionLimits(max_block=32))
    services = Services(background_loop, target, draft)
    prompts = [LONG, LONG[::-1], *(gguf_tokenizer.encode(p) for p in TINY_PROMPTS)]

    jobs = [(request(4, DrafterKind.MODEL, max_new=24), ids) for ids in prompts]
    try:
        outputs = run_async(run_with(services, str(tiny_target_dir), jobs, concurrent=True))
    finally:
        services.stop()
    assert [ids for ids, _ in outputs] == [reference_greedy(model, ids, 24) for ids in prompts]
    assert target.prefill_chunks >= 6  # both long prompts went in chunks


def measured(engine: TargetEngine, base_s: float, per_token_s: float) -> TargetEngine:
    """The engine's forwards' cost fit as if it had measured t(x) = base + per_token x over many forwards (so the
    few this test runs move it little)."""
    engine.forward_cost = LinearCost(decay=1.0)
    for tokens in range(1, 201):
        engine.forward_cost.observe(tokens, base_s + per_token_s * tokens)
    return engine


def test_auto_chunks_cost_about_a_step_beside_decoding_rows_and_a_lone_prompt_runs_whole(model):
    # a / s = 20 tokens: with the short session's row beside it, chunks of 20 + 1 tokens (what the step costs without
    # them, at the fit's price: these tiny forwards cost far less than the fit says, so no chunk is priced higher)
    engine = measured(engine_of(model, "auto"), 0.020, 0.001)
    engine.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
    engine.open("short", SHORT, SamplingParams(), VerificationMode.GREEDY)
    long_out, waits = [], 0
    while len(long_out) < 6:
        results = engine.verify_batch([item(engine, "long"), item(engine, "short")])
        assert isinstance(results[1], VerifyOutcome)  # the short session commits every step
        if results[0] is PREFILLING:
            waits += 1
            continue
        long_out.append(results[0].next_token)
    assert waits == 6 and engine.prefill_chunks == 6  # 150 prompt tokens: 21 x 6, then 24 (up to a block) with it
    assert long_out == reference_greedy(model, LONG, 6)

    alone = measured(engine_of(model, "auto"), 0.020, 0.001)  # nobody's rows to keep going: one forward
    alone.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
    assert isinstance(alone.verify_batch([item(alone, "long")])[0], VerifyOutcome) and alone.prefill_chunks == 0

    unmeasured = engine_of(model, "auto")  # until the fit is measured: the fixed default, 512 (LONG is shorter)
    unmeasured.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
    unmeasured.open("short", SHORT, SamplingParams(), VerificationMode.GREEDY)
    first = unmeasured.verify_batch([item(unmeasured, "long"), item(unmeasured, "short")])
    assert all(isinstance(r, VerifyOutcome) for r in first) and unmeasured.prefill_chunk == 512


def test_auto_prices_a_chunks_token_by_the_chunks_own_steps(model):
    engine = measured(engine_of(model, "auto"), 0.100, 0.001)  # a step of 1 other token: 0.101 s
    assert engine._chunk_budget(1) == pytest.approx(101, abs=1)  # priced as a verify row's token
    # A forward of 10 other tokens and 50 of a chunk took 0.2 s: 0.09 s beyond the 0.11 s of the others, 1.8 ms
    # a chunk's token; the chunks now get what a step costs at that price, and follow later prices by halves.
    engine._price_chunks(60, 50, 0.2)
    assert engine.chunk_token_s == pytest.approx(0.0018) and engine._chunk_budget(1) == pytest.approx(0.101 / 0.0018, abs=1)
    engine._price_chunks(60, 50, 0.11)  # as cheap as the fit: the price halves towards it
    assert engine.chunk_token_s == pytest.approx(0.0009) and engine._chunk_budget(1) == pytest.approx(101, abs=1)  # never below s


def test_auto_chunks_a_prompt_that_steps_alone_while_another_session_is_open(model):
    """A session between its steps (its block not here yet) still decodes: the prompt does not run whole."""
    engine = measured(engine_of(model, "auto"), 0.020, 0.001)
    engine.open("long", LONG, SamplingParams(), VerificationMode.GREEDY)
    engine.open("short", SHORT, SamplingParams(), VerificationMode.GREEDY)
    assert engine.verify_batch([item(engine, "long")])[0] is PREFILLING and engine.prefill_chunks == 1
    assert engine._chunk_budget(0) == pytest.approx(20, abs=1)  # a step's fixed cost (a / s) when nobody's rows are in it
    engine.close("short")
    assert engine._chunk_budget(0) is None  # nobody else: whole
