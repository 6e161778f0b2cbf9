"""A proposal whose session closed stops at the next decoder layer, so the draft's compute thread serves the
other sessions (``specsplit.draft_service.abandon``).

The case it fixes: a draft service holding the int8 self-draft and an EAGLE head. The int8 drafter's first
proposal prefills a long prompt for longer than the orchestrator's draft timeout; the orchestrator gives up
and closes the session, but the prefill ran to its end on the one compute thread, and the EAGLE session's
proposals, queued behind it, missed their own timeouts: EAGLE never drafted. Here the int8 prefill is held
by a stall the test controls, so nothing depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from specsplit.draft_service.abandon import decoder_layers
from specsplit.draft_service.engine import DraftEngine
from specsplit.draft_service.ngram import NgramConfig
from specsplit.draft_service.self_draft import QuantizeMode, quantized_view
from specsplit.lmkit import errors
from specsplit.lmkit.features import FeatureBlock
from specsplit.lmkit.grpc_server import ComputeThread
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from tests.unit.draft_service.test_eagle import SEQUENCE, fresh_proposal, head, target_features, tiny  # noqa: F401 - fixtures

pytestmark = pytest.mark.unit

PROMPT = SEQUENCE[:8]


def open_session(engine: DraftEngine, session_id: str, kind: DrafterKind, width: int = 0):
    return engine.open(session_id, PROMPT, SamplingParams(), kind, False, NgramConfig(), feature_width=width)


def test_a_closed_sessions_proposal_stops_and_the_eagle_session_is_served(tiny, head):  # noqa: F811
    quantized = quantized_view(tiny, QuantizeMode.INT8)
    engine = DraftEngine(tiny, limits=SessionLimits(),
                         derived={DrafterKind.QUANTIZED: quantized, DrafterKind.EAGLE: head})
    entered, release = threading.Event(), threading.Event()
    after_close: list[str] = []  # quantized layers that ran a forward once the session was closed

    def stall(module, args):
        if not entered.is_set():
            entered.set()
            release.wait(30)

    layers = decoder_layers([quantized])
    layers[0].register_forward_pre_hook(stall, prepend=True)
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, out, i=i: after_close.append(f"layer {i}") if release.is_set() else None)
    slow = open_session(engine, "int8", DrafterKind.QUANTIZED)
    eagle = open_session(engine, "eagle", DrafterKind.EAGLE, head.feature_width)
    features = target_features(tiny, PROMPT)  # [8, F]

    async def serve():
        compute = ComputeThread("draft-compute")
        try:
            stalled = asyncio.ensure_future(compute.run(engine.propose, slow, len(PROMPT), [], 3))
            await asyncio.to_thread(entered.wait, 30)
            queued = asyncio.ensure_future(compute.run(
                lambda: engine.propose(eagle, len(PROMPT), [], 3, features=FeatureBlock(0, features))))
            engine.close("int8")  # the orchestrator gave up on it: the servicer closes the session
            release.set()
            return await asyncio.gather(stalled, queued, return_exceptions=True)
        finally:
            compute.shutdown()

    stalled, queued = asyncio.run(serve())
    assert isinstance(stalled, errors.NotFound), f"the closed session's proposal ran on: {stalled}"
    assert after_close == []
    assert queued.proposal.tokens == fresh_proposal(head, features, PROMPT, 3)
    # The check is off again once the abandoned proposal stopped: a new session drafts.
    assert len(engine.propose(open_session(engine, "int8-again", DrafterKind.QUANTIZED), len(PROMPT), [], 2)
               .proposal.tokens) == 2
