"""One session's failure stays its own in a batched verification.

Eight sessions share a forward; one has a bad cache. NaN keys make its logits
NaN: its rows cannot be decided, so it gets INTERNAL with nothing committed and
its cache dropped (its next block, re-prefilled, succeeds), while the other
seven commit exactly what they would have alone. Keys of the wrong shape make
the shared forward itself fail: every block is then verified alone from a
fresh cache, and all eight get their solo results.
"""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.lmkit import errors, models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem, VerifyOutcome
from tests.conftest import TINY_PROMPTS

pytestmark = pytest.mark.unit

SESSIONS = 8
BAD = 3  # in the middle, so that sessions both before and after the failing one are checked


@pytest.fixture(scope="module")
def model(tiny_target_dir, fast_forward):  # one model per forward: the packed one is changed in place
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


@pytest.fixture(scope="module", params=[True, False], ids=["packed-rows", "stock-forward"])
def fast_forward(request) -> bool:
    return request.param


def new_engine(model, fast_forward: bool = True) -> TargetEngine:
    return TargetEngine(
        model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8), fast_forward=fast_forward
    )


DECODINGS = {  # -> each session's sampling, by its index, and the verification mode
    "greedy": (lambda i: SamplingParams(), VerificationMode.GREEDY),
    # One kind of sampling for all: their rows 0 are made in one call (a NaN among them fails that call).
    "coupled": (lambda i: SamplingParams(temperature=0.7, top_p=0.95, seed=i), VerificationMode.COUPLED),
    "token-only": (lambda i: SamplingParams(temperature=1.0 + 0.1 * (i % 2), seed=i), VerificationMode.TOKEN_ONLY),
}


def opened(engine: TargetEngine, gguf_tokenizer, decoding: str = "greedy") -> list:
    """Eight sessions, each past its prefill (one round each, alone)."""
    sampling, mode = DECODINGS[decoding]
    sessions = []
    for i in range(SESSIONS):
        ids = gguf_tokenizer.encode(TINY_PROMPTS[i % len(TINY_PROMPTS)]) + [i + 10]
        session = engine.open(f"s{i}", ids, sampling(i), mode)
        engine.verify(session, len(session.tokens), [], None)
        sessions.append(session)
    return sessions


def blocks(sessions) -> list[list[int]]:
    return [[(t * 7 + j) % 49152 for j in range(1 + i % 4)] for i, t in enumerate(s.tokens[-1] for s in sessions)]


def solo_results(model, gguf_tokenizer, fast_forward: bool, decoding: str) -> list[tuple[int, int]]:
    engine = new_engine(model, fast_forward)
    sessions = opened(engine, gguf_tokenizer, decoding)
    return [
        (lambda v: (v.accepted, v.next_token))(engine.verify(s, len(s.tokens), b, None))
        for s, b in zip(sessions, blocks(sessions))
    ]


def poison_with_nan(session) -> None:
    kv = session.cache.kv
    if kv is not None:  # the packed-rows forward's buffer
        kv.keys = [torch.full_like(keys, math.nan) for keys in kv.keys]
        return
    for layer in session.cache.cache.layers:
        layer.keys = torch.full_like(layer.keys, math.nan)


def poison_with_bad_shape(session) -> None:
    kv = session.cache.kv
    if kv is not None:
        kv.keys[0] = kv.keys[0][..., :-1]  # one fewer head dimension: no forward can use it
        return
    layer = session.cache.cache.layers[0]
    layer.keys = layer.keys[..., :-1]


def poison_nothing(session) -> None:
    """A healthy batch: every session commits its solo result from the shared forward."""


@pytest.mark.parametrize("decoding", sorted(DECODINGS))
@pytest.mark.parametrize(
    "poison", [poison_nothing, poison_with_nan, poison_with_bad_shape], ids=["healthy", "nan-logits", "forward-fails"]
)
def test_a_bad_session_fails_alone_and_the_others_commit_their_solo_results(
    model, gguf_tokenizer, fast_forward, poison, decoding
):
    expected = solo_results(model, gguf_tokenizer, fast_forward, decoding)
    engine = new_engine(model, fast_forward)
    sessions = opened(engine, gguf_tokenizer, decoding)
    committed = [len(s.tokens) for s in sessions]
    poison(sessions[BAD])
    sent = blocks(sessions)
    items = [VerifyItem(s, len(s.tokens), b, None) for s, b in zip(sessions, sent)]
    results = engine.verify_batch(items)
    for i, (result, session) in enumerate(zip(results, sessions)):
        if i == BAD and poison is poison_with_nan:
            assert isinstance(result, errors.Internal), result
            assert len(session.tokens) == committed[i]  # nothing committed
            assert len(session.cache) == 0  # the bad cache was dropped
        else:
            assert isinstance(result, VerifyOutcome), result
            assert (result.accepted, result.next_token) == expected[i]
            assert len(session.tokens) == committed[i] + result.accepted + 1
    if poison is poison_nothing:
        assert all(r.batch.size == SESSIONS for r in results)  # one shared forward
        # the load signal: that forward's tokens, and whether its rows were packed (no padding) or padded
        fed = sum(len(b) + 1 for b in sent)
        assert {r.batch.packed for r in results} == {fast_forward}
        assert {r.batch.tokens for r in results} == {fed} if fast_forward else min(r.batch.tokens for r in results) > fed
    if poison is poison_with_nan:
        assert all(r.batch.size == SESSIONS - 1 for i, r in enumerate(results) if i != BAD)  # one shared forward
        # The culprit's block, sent again, is verified from a fresh prefill and gives its solo result.
        bad = sessions[BAD]
        again = engine.verify(bad, len(bad.tokens), sent[BAD], None)
        assert (again.accepted, again.next_token) == expected[BAD]


def test_an_internal_error_is_the_internal_status():
    import grpc

    from specsplit.lmkit.grpc_server import status_for

    assert status_for(errors.Internal("x")) == grpc.StatusCode.INTERNAL


def test_a_block_whose_preparation_fails_fails_alone_in_the_scheduler(model, gguf_tokenizer, fast_forward):
    """The target servicer decodes draft distributions on the compute thread (``VerifyScheduler.verify``'s
    ``prepare``); a payload that does not decode fails its own block, the batch's other blocks commit."""
    import asyncio
    import threading

    from specsplit.lmkit.grpc_server import ComputeThread
    from specsplit.target_service.scheduler import VerifyScheduler

    expected = solo_results(model, gguf_tokenizer, fast_forward, "greedy")
    engine = new_engine(model, fast_forward)
    sessions = opened(engine, gguf_tokenizer)
    compute = ComputeThread("test-compute")
    threads = []

    def prepare(item: VerifyItem) -> VerifyItem:
        threads.append(threading.current_thread().name)
        if item.session is sessions[BAD]:
            raise errors.InvalidArgument("draft_probs: bad payload")
        return item

    async def verify_all():
        scheduler = VerifyScheduler(compute, engine, max_batch=SESSIONS)
        items = [VerifyItem(s, len(s.tokens), b, None) for s, b in zip(sessions, blocks(sessions))]
        return await asyncio.gather(*(scheduler.verify(item, prepare) for item in items), return_exceptions=True)

    try:
        results = asyncio.run(verify_all())
    finally:
        compute.shutdown()
    assert len(threads) == SESSIONS and all(name.startswith("test-compute") for name in threads)
    for i, result in enumerate(results):
        if i == BAD:
            assert isinstance(result, errors.InvalidArgument), result
        else:
            assert (result.accepted, result.next_token) == expected[i]
            assert result.batch.size == SESSIONS - 1  # one shared forward, without the failed block
