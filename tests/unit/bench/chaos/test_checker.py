"""The chaos checker catches each broken promise, and the fault schedule is reproducible from its seed."""

from __future__ import annotations

import pytest

from specsplit.bench.chaos import checker, schedule
from specsplit.bench.chaos.checker import Record

pytestmark = pytest.mark.unit

REFS = {0: [5, 6, 7, 8]}


def rec(code="OK", tokens=(5, 6, 7, 8), kind="generate", ended=1.0, deadline=60.0) -> Record:
    return Record(1, 0, kind, 0 if kind in ("generate", "cancel") else -1, 0.0, ended, deadline, code,
                  list(tokens))


def test_a_clean_history_passes():
    verdict = checker.check([rec(), rec("UNAVAILABLE", (5, 6)), rec("CANCELLED", (5,), kind="cancel"),
                             rec("INVALID_ARGUMENT", (), kind="malformed")], REFS)
    assert verdict.ok
    assert verdict.tokens_checked == 4 + 2 + 1


@pytest.mark.parametrize("record, field", [
    (rec(tokens=(5, 6, 7)), "mismatches"),  # a token lost
    (rec(tokens=(5, 6, 6, 7, 8)), "mismatches"),  # a token duplicated
    (rec("UNAVAILABLE", (5, 9)), "contradicted"),  # streamed a token the reference contradicts, then failed
    (rec("INTERNAL", (5,)), "undocumented"),
    (rec("OK", (), kind="bad_request"), "wrong_failures"),  # a request built to fail succeeded
    (rec("HANG", (5,)), "hangs"),
    (rec("OK", ended=200.0, deadline=60.0), "hangs"),  # outlived its deadline
])
def test_each_broken_promise_is_caught(record, field):
    verdict = checker.check([record], REFS)
    assert not verdict.ok and getattr(verdict, field), verdict


def test_the_schedule_is_a_function_of_its_seed_and_draws_every_kind():
    a, b = schedule.draw(7, 600, 10), schedule.draw(7, 600, 10)
    assert a == b and a != schedule.draw(8, 600, 10)
    assert {f.kind for f in a} == set(schedule.KINDS)
    assert all(5.0 <= f.at_s <= 595.0 for f in a)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)


def test_partitions_are_drawn_only_across_hosts():
    loopback, across = schedule.draw(7, 600, 10), schedule.draw(7, 600, 10, schedule.HOSTS_KINDS)
    assert "partition" not in {f.kind for f in loopback}
    assert {f.kind for f in across} == set(schedule.HOSTS_KINDS)
    assert all(0.5 <= f.hold_s <= 4.0 for f in across if f.kind == "partition")


@pytest.mark.parametrize("flags,message", [
    (["--kinds", "partition"], "partition needs --hosts"),
    (["--kinds", "target_kill,nap"], "['nap']"),
    (["--replicas", "2"], "more than 1 only with --hosts"),
])
def test_a_chaos_run_refuses_kinds_and_replicas_its_stack_cannot_have(tmp_path, flags, message):
    from specsplit.bench.chaos.__main__ import build_parser, run

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run(build_parser().parse_args(flags), tmp_path)
