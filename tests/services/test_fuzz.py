"""Fuzzing both services with >= 10,000 random and mutated messages, raw bytes included.

Every answer must be a well-formed gRPC status, nothing may log a traceback,
and the service must still serve a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specsplit.v1 import specsplit_pb2 as pb

pytestmark = pytest.mark.services

EXAMPLES = 500
MESSAGES_PER_EXAMPLE = 10  # 5,000 messages per service

ints = st.one_of(st.integers(-5, 60000), st.integers(-(2**31), 2**31 - 1))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(-2, 3, width=32))
sampling = st.builds(pb.SamplingParams, temperature=floats, top_k=st.integers(-(2**31), 2**31 - 1),
                     top_p=floats, seed=st.integers(0, 2**64 - 1))
tokens = st.lists(ints, max_size=12)
probs = st.builds(pb.DraftProbs, rows=st.integers(0, 2**32 - 1), vocab_size=st.integers(0, 2**32 - 1),
                  sparse=st.booleans(), values=st.binary(max_size=64), indices=st.binary(max_size=64),
                  row_nnz=st.lists(st.integers(0, 2**32 - 1), max_size=4))
target_messages = st.one_of(
    st.builds(lambda t, s, m, i: pb.TargetRequest(open=pb.TargetOpen(session_id=i, tokens=t, sampling=s, mode=m)),
              tokens, sampling, st.integers(-3, 6), st.text(max_size=8)),
    st.builds(lambda p, t, q: pb.TargetRequest(verify=pb.VerifyRequest(position=p, draft_tokens=t, draft_probs=q)),
              st.integers(0, 2**64 - 1), tokens, probs),
)
draft_messages = st.one_of(
    st.builds(lambda t, s, d, r, lo, hi, i: pb.DraftRequest(open=pb.DraftOpen(
        session_id=i, tokens=t, sampling=s, drafter=d, return_probs=r, ngram_min=lo, ngram_max=hi)),
        tokens, sampling, st.integers(-3, 9), st.booleans(), st.integers(0, 40), st.integers(0, 40), st.text(max_size=8)),
    st.builds(lambda p, t, k: pb.DraftRequest(propose=pb.ProposeRequest(position=p, tokens=t, k=k)),
              st.integers(0, 2**64 - 1), tokens, st.integers(0, 2**32 - 1)),
)


def mutated(messages):
    """Serialized messages, some mutated (bit flips, truncation, junk) and some raw random bytes."""

    @st.composite
    def one(draw):
        how = draw(st.sampled_from(["valid", "flip", "truncate", "append", "raw"]))
        if how == "raw":  # no message drawn only to be thrown away
            return draw(st.binary(max_size=64))
        data = draw(messages).SerializeToString()
        if how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        elif how == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif how == "append":
            data += draw(st.binary(min_size=1, max_size=16))
        return data

    return st.lists(one(), min_size=MESSAGES_PER_EXAMPLE, max_size=MESSAGES_PER_EXAMPLE)


class TracebackCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.records.append(record)


async def send_raw(channel: grpc.aio.Channel, service: str, payloads: list[bytes]) -> list[str]:
    """Half the payloads go through the Session stream, the rest as unary calls; returns the status codes."""
    codes = []
    stream = channel.stream_stream(f"/specsplit.v1.{service}/Session")
    call = stream(iter(payloads[: len(payloads) // 2]))
    try:
        async for _ in call:
            pass
        codes.append("OK")
    except grpc.aio.AioRpcError as exc:
        codes.append(exc.code().name)
    for i, payload in enumerate(payloads[len(payloads) // 2 :]):
        method = ("Info", "Stats", "GetSession")[i % 3]
        try:
            await channel.unary_unary(f"/specsplit.v1.{service}/{method}")(payload, timeout=10)
            codes.append("OK")
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code().name)
    return codes


async def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)  # bound to the loop it is made on


WELL_FORMED = {code.name for code in grpc.StatusCode} - {"UNKNOWN"}  # UNKNOWN = an unhandled exception


@pytest.mark.parametrize("service,messages", [("TargetService", target_messages), ("DraftService", draft_messages)])
def test_fuzzed_messages_get_statuses_and_the_service_keeps_serving(tiny_services, service, messages):
    address = tiny_services.target_address if service == "TargetService" else tiny_services.draft_address
    catcher = TracebackCatcher()
    logging.getLogger().addHandler(catcher)
    seen: set[str] = set()
    # One client loop and one connection for every example: each example is a new stream and new calls on it
    # (the server's state is per stream), without a connection handshake per example.
    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(open_channel(address))

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated(messages))
    def fuzz(payloads):
        codes = loop.run_until_complete(asyncio.wait_for(send_raw(channel, service, payloads), 60))
        assert set(codes) <= WELL_FORMED, codes
        seen.update(codes)

    try:
        fuzz()
    finally:
        logging.getLogger().removeHandler(catcher)
        loop.run_until_complete(channel.close())
        loop.close()
    assert not catcher.records, [r.getMessage() for r in catcher.records[:3]]
    assert "INVALID_ARGUMENT" in seen  # the fuzzer reached validation, not only the parser
    from tests.services.test_bad_input import assert_still_serves

    assert_still_serves(tiny_services)
    assert tiny_services.target_engine.sessions.stats()[0] == 0
