"""Whether the target's next batch waits for the last one's sessions: the engine's forward cost t(x) = a + s x
and the sessions' turnaround (result given to next block come) decide. A turnaround shorter than a (a GPU's
flat forward): the blocks in hand wait, up to a, for the rest, which then share their forward. A turnaround
longer than a (a CPU's forward, nearly in proportion to its tokens): they go at once, and the late sessions get
a forward of their own, even when they would have come within a.

A real engine over the tiny model; its fit is set by feeding it forwards of a chosen cost, as if measured.
"""

from __future__ import annotations

import asyncio

import pytest

from specsplit.lmkit import models
from specsplit.lmkit.costs import LinearCost
from specsplit.lmkit.grpc_server import ComputeThread
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem
from specsplit.target_service.scheduler import VerifyScheduler
from tests.conftest import TINY_PROMPTS

pytestmark = pytest.mark.unit

EARLY, LATE = 3, 3  # sessions whose next block comes at once, and those whose block comes later


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


def batch_sizes(model, gguf_tokenizer, fixed_s: float, late_s: list[float]) -> list[list[int]]:
    """A first step of every session together, then one step per entry of ``late_s``: ``EARLY`` sessions send
    their block at once, ``LATE`` that many seconds later; the engine's fit is a = ``fixed_s`` (s: a thousandth
    of it a token). Each later step's batch sizes, as each session's result reports it, in session order."""
    engine = TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8))
    sessions = []
    for i in range(EARLY + LATE):
        ids = gguf_tokenizer.encode(TINY_PROMPTS[i % len(TINY_PROMPTS)])
        session = engine.open(f"s{i}", ids, SamplingParams(), VerificationMode.GREEDY)
        engine.verify(session, len(session.tokens), [], None)  # past its prefill
        sessions.append(session)
    compute = ComputeThread("test-compute")

    async def verify(scheduler, session, delay_s: float = 0.0):
        await asyncio.sleep(delay_s)
        return await scheduler.verify(VerifyItem(session, len(session.tokens), [7, 8], None))

    async def run():
        scheduler = VerifyScheduler(compute, engine, max_batch=16, max_wait_s=10.0)
        await asyncio.gather(*(verify(scheduler, s) for s in sessions))
        sizes = []
        for delay_s in late_s:
            engine.forward_cost = LinearCost()  # as if measured: forwards of 1 and 20 tokens
            for i in range(40):
                tokens = 1 if i % 2 else 20
                engine.forward_cost.observe(tokens, fixed_s * (1 + tokens / 1000))
            late = [verify(scheduler, s, delay_s) for s in sessions[EARLY:]]
            outcomes = await asyncio.gather(*(verify(scheduler, s) for s in sessions[:EARLY]), *late)
            sizes.append([outcome.batch.size for outcome in outcomes])
        return sizes

    try:
        return asyncio.run(run())
    finally:
        compute.shutdown()


def test_a_turnaround_shorter_than_a_forwards_fixed_cost_is_waited_for(model, gguf_tokenizer):
    assert batch_sizes(model, gguf_tokenizer, 1.0, [0.1, 0.1]) == [[EARLY + LATE] * (EARLY + LATE)] * 2


def test_a_turnaround_longer_than_a_forwards_fixed_cost_is_not(model, gguf_tokenizer):
    # the first late blocks come after a (no wait would catch them); once that turnaround is known, blocks that
    # come within a are not waited for either
    split = [EARLY] * EARLY + [LATE] * LATE
    assert batch_sizes(model, gguf_tokenizer, 0.2, [0.5, 0.05]) == [split, split]
