"""Session bookkeeping shared by both services: bounded, unique ids, counters."""

import pytest

from specsplit.lmkit import errors
from specsplit.lmkit.sessions import SessionLimits, SessionTable, check_open, check_tokens

pytestmark = pytest.mark.unit


def test_table_bounds_and_counts():
    table = SessionTable(SessionLimits(max_sessions=2), "target")
    table.add("a", object())
    table.add("b", object())
    with pytest.raises(errors.ResourceExhausted, match="maximum of 2 sessions"):
        table.add("c", object())
    with pytest.raises(errors.AlreadyExists, match="'a'"):
        table.add("a", object())
    table.count_round()
    assert table.remove("a") is not None and table.remove("a") is None
    assert table.stats() == (1, 2, 1)
    with pytest.raises(errors.NotFound, match="'a'"):
        table.get("a")


@pytest.mark.parametrize("kwargs,flag", [({"max_block": -1}, "--max-block"), ({"max_sessions": 0}, "--max-sessions")])
def test_limits_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SessionLimits(**kwargs)


def test_open_checks():
    with pytest.raises(errors.InvalidArgument, match="session_id"):
        check_open("", [1], 10, "model")
    with pytest.raises(errors.InvalidArgument, match="empty"):
        check_open("s", [], 10, "model")
    with pytest.raises(errors.InvalidArgument, match="context is 10"):
        check_open("s", list(range(10)), 10, "model")
    check_open("s", list(range(9)), 10, "model")
    with pytest.raises(errors.InvalidArgument, match=r"tokens\[1\] = 10"):
        check_tokens([0, 10], 10, "tokens")
    with pytest.raises(errors.InvalidArgument, match=">= 0"):
        check_tokens([-1], None, "tokens")


def test_one_caller_is_capped_while_another_still_opens():
    table = SessionTable(SessionLimits(max_sessions=4, max_sessions_per_caller=2), "target")
    table.add("a1", object(), "alice")
    table.add("a2", object(), "alice")
    with pytest.raises(errors.ResourceExhausted, match=r"caller 'alice' holds its maximum of 2 .*--max-sessions-per"):
        table.add("a3", object(), "alice")
    table.add("b1", object(), "bob")
    table.remove("a1")
    table.add("a3", object(), "alice")  # a closed session frees its caller's share
    assert table.stats()[0] == 3


def test_sessions_reserve_positions_against_the_kv_budget():
    table = SessionTable(SessionLimits(kv_budget_tokens=250), "target")
    table.add("a", object(), reserve=100)
    table.add("b", object(), reserve=100)
    with pytest.raises(errors.ResourceExhausted, match="holds 250 positions and 50 are free; this session reserves 100"):
        table.add("c", object(), reserve=100)
    table.add("c", object(), reserve=50)  # what fits is admitted
    assert table.reserved("a") == 100
    table.remove("a")
    table.add("d", object(), reserve=100)
    assert table.reserved("a") == 0 and table.stats()[0] == 3


def test_draft_sessions_reserve_bytes_at_what_their_drafter_keeps_a_position():
    table = SessionTable(SessionLimits(kv_budget_bytes=1000), "draft")
    table.add("model", object(), reserve=60, position_bytes=10)
    table.add("ngram", object(), reserve=10**6, position_bytes=0)  # a model-free drafter keeps nothing
    with pytest.raises(errors.ResourceExhausted, match=(
            r"KV budget holds 1000 bytes and 400 are free; this session reserves 50 positions .* of 16 bytes each: "
            r"ask for at most 25 positions")):
        table.add("eagle", object(), reserve=50, position_bytes=16)
    table.add("eagle", object(), reserve=25, position_bytes=16)
    assert table.reserved("model") == 60
    table.remove("model")
    table.add("again", object(), reserve=60, position_bytes=10)  # its 600 bytes came back
    assert table.stats()[0] == 3


def test_a_budget_is_in_positions_or_in_bytes():
    with pytest.raises(ValueError, match="positions .* or in bytes"):
        SessionLimits(kv_budget_tokens=10, kv_budget_bytes=10)
    with pytest.raises(ValueError, match="--kv-budget-bytes must be >= 0"):
        SessionLimits(kv_budget_bytes=-1)


def test_the_budget_and_what_is_reserved_against_it_in_its_unit():
    draft = SessionTable(SessionLimits(kv_budget_bytes=1000), "draft")
    draft.add("model", object(), reserve=60, position_bytes=10)
    assert draft.budget() == (600, 1000, "bytes")
    target = SessionTable(SessionLimits(kv_budget_tokens=250), "target")
    target.add("a", object(), reserve=100)
    assert target.budget() == (100, 250, "positions")
    target.remove("a")
    assert target.budget() == (0, 250, "positions")
    assert SessionTable(SessionLimits(), "draft").budget() == (0, 0, "positions")
