"""A Sessions message over the service's bound leaves as several, in order, each within it."""

from __future__ import annotations

import pytest

from specsplit.orchestrator.decode.mux import Mux
from specsplit.v1 import specsplit_pb2 as pb

pytestmark = pytest.mark.unit


def _calls(n: int, tokens: int) -> list:
    return [pb.TargetCall(session_id=f"s{i}", open=pb.TargetOpen(tokens=list(range(tokens)))) for i in range(n)]


def test_calls_over_the_bound_are_split_in_order_within_it():
    mux = Mux(lambda: None, pb.TargetCall, pb.TargetCalls, "target")
    calls = _calls(10, 300)
    whole = pb.TargetCalls(calls=calls).ByteSize()
    assert [len(m.calls) for m in mux._messages(calls)] == [10]  # no bound: one message
    mux.max_bytes = whole // 3
    messages = mux._messages(calls)
    assert len(messages) >= 3 and all(m.ByteSize() <= mux.max_bytes for m in messages)
    assert [c.session_id for m in messages for c in m.calls] == [c.session_id for c in calls]
    mux.max_bytes = whole
    assert len(mux._messages(calls)) == 1  # within the bound: one message, as before
