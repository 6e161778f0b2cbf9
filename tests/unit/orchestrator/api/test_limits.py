"""Generation slots per caller, prompt sizes and the HTTP body parser's refusals, without a server."""

from __future__ import annotations

import pytest

from specsplit.lmkit import errors
from specsplit.orchestrator.api.http_guard import parse_json
from specsplit.orchestrator.api.limits import (
    Slots,
    caller_of,
    check_prompt_size,
    longest_token_bytes,
    prompt_byte_limit,
)
from specsplit.orchestrator.api.openai_schema import RequestError

pytestmark = pytest.mark.unit


def test_a_caller_holds_at_most_its_quota_and_gets_it_back():
    slots = Slots(limit=3, per_caller=1)
    with slots.hold("a"):
        with pytest.raises(errors.ResourceExhausted, match="this caller already has 1"):
            with slots.hold("a"):
                pass
        with slots.hold("b"):
            assert slots.active == 2 and slots.held("a") == slots.held("b") == 1
    assert slots.active == 0 and slots.held("a") == 0
    with slots.hold("a"):
        pass


def test_the_server_wide_limit_applies_over_all_callers():
    slots = Slots(limit=1)
    with slots.hold("a"), pytest.raises(errors.ResourceExhausted, match="maximum of 1 concurrent"):
        with slots.hold("b"):
            pass


def test_a_request_of_n_samples_holds_n_slots_or_none():
    slots = Slots(limit=4, per_caller=3)
    with slots.hold("a", 3):
        assert slots.active == 3 and slots.held("a") == 3
        with pytest.raises(errors.ResourceExhausted, match="n = 2 samples count as 2 generations"):
            with slots.hold("b", 2):
                pass
        assert slots.active == 3 and slots.held("b") == 0
        with slots.hold("b"):
            assert slots.active == 4
    assert slots.active == 0
    with pytest.raises(errors.ResourceExhausted, match="--max-concurrent-per-caller"):
        with slots.hold("a", 4):
            pass
    assert slots.active == 0 and slots.held("a") == 0


def test_callers_are_their_credential_else_their_address():
    assert caller_of("Bearer x", "10.0.0.1") == caller_of("Bearer x", "10.0.0.2") != caller_of("Bearer y", "10.0.0.1")
    assert caller_of("", "10.0.0.1") == "address:10.0.0.1"
    assert "x" not in caller_of("Bearer x", "")  # the credential is hashed


class _Vocab:
    def get_vocab(self):
        return {"a": 0, "ĠĠĠĠ": 1, "<0xE2>": 2}


def test_the_derived_prompt_limit_is_the_context_times_the_longest_token():
    assert prompt_byte_limit(0, 100, longest_token_bytes(_Vocab())) == 100 * len("ĠĠĠĠ".encode())
    assert prompt_byte_limit(5000, 100, longest_token_bytes(_Vocab())) == 5000


def test_a_prompt_is_measured_in_utf8_bytes_over_all_turns():
    check_prompt_size("é" * 5, (), 10)
    with pytest.raises(errors.InvalidArgument, match=r"the prompt is 12 bytes \(with its tools and grammar\); at most 10"):
        check_prompt_size("é" * 6, (), 10)
    with pytest.raises(errors.InvalidArgument, match="at least 18 bytes"):
        check_prompt_size("", (("user", "abc"), ("assistant", "ab")), 10)


@pytest.mark.parametrize("body, fragment", [
    (b"[" * 100_000, "nests arrays or objects too deeply"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "a number too long to read"),
    (b'{"model": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"\\udfff": 1}', "lone UTF-16 surrogate"),
    (b'{"model": ', "not valid JSON"),
    (b"\xff", "not valid JSON"),
])
def test_malformed_bodies_are_request_errors(body, fragment):
    with pytest.raises(RequestError, match=fragment):
        parse_json(body)


def test_a_surrogate_pair_is_valid_unicode():
    assert parse_json(b'{"model": "\\ud83d\\ude00"}') == {"model": "\U0001f600"}
