"""Placement of sessions over a pool's replicas (``orchestrator.peers.Pool``): no service, no gRPC call."""

from __future__ import annotations

import time

import grpc
import pytest

from specsplit.orchestrator.decode.peers import PeerError, Pool, Resolving, ServiceClient, dns_name, replica_addresses
from specsplit.v1 import specsplit_pb2 as pb
from tests.conftest import run_async

pytestmark = pytest.mark.unit


class Transport:
    """What a session's calls ride on (``OwnStream``'s interface), answering or failing as told."""

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.fail = fail
        self.closed = self.aborted = False

    async def call(self, kind, message):
        if self.fail is not None:
            raise PeerError("target", self.fail, "down")
        return message

    async def close(self, timeout_s=5.0):
        self.closed = True

    def abort(self):
        self.aborted = True


def pool(n: int) -> Pool:
    return Pool([ServiceClient(f"10.0.0.{i}:1", None, None, kind="target") for i in range(n)])


def test_sessions_go_to_the_replica_with_fewest_and_stay_counted_until_they_end():
    replicas = pool(3)
    placed = [replicas.place(f"s{i}", lambda r: Transport()) for i in range(7)]
    assert [r.sessions for r in replicas.replicas] == [3, 2, 2]
    placed[0].abort()
    run_async(placed[1].close())
    assert [r.sessions for r in replicas.replicas] == [2, 1, 2]  # s0 was on the first, s1 on the second
    assert replicas.place("s7", lambda r: Transport()).replica is replicas.replicas[1]
    placed[0].abort()  # a second abort or close counts nothing twice
    assert [r.sessions for r in replicas.replicas] == [2, 2, 2]


def test_a_replica_whose_call_failed_gets_no_new_session_while_another_can_take_it():
    replicas = pool(2)
    first = replicas.place("a", lambda r: Transport(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(PeerError):
        run_async(first.call("verify", pb.VerifyRequest()))
    first.abort()
    down = first.replica
    again = [replicas.place(f"b{i}", lambda r: Transport()).replica for i in range(3)]
    assert all(replica is not down for replica in again)  # re-opened on the live one, even with more sessions
    down.failed_at = time.monotonic() - 60  # long ago: it takes sessions again
    assert replicas.place("c", lambda r: Transport()).replica is down


def test_a_refusal_that_another_replica_would_repeat_does_not_mark_the_replica():
    replicas = pool(2)
    placed = replicas.place("a", lambda r: Transport(grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(PeerError):
        run_async(placed.call("verify", pb.VerifyRequest()))
    assert placed.replica.failed_at < 0


def test_when_every_replica_failed_lately_the_least_loaded_still_takes_the_session():
    replicas = pool(2)
    for replica in replicas.replicas:
        replica.failed_at = time.monotonic()
    replicas.replicas[0].sessions = 5
    assert replicas.place("a", lambda r: Transport()).replica is replicas.replicas[1]


def test_a_fork_goes_to_its_sources_replica_unless_that_one_failed():
    replicas = pool(3)
    source = replicas.place("src", lambda r: Transport())
    for i in range(4):
        replicas.place(f"x{i}", lambda r: Transport())
    assert replicas.place("fork", lambda r: Transport(), prefer="src").replica is source.replica
    source.replica.failed_at = time.monotonic()
    assert replicas.place("fork2", lambda r: Transport(), prefer="src").replica is not source.replica


def test_replica_addresses_split_on_commas_but_keep_grpcs_own_address_lists():
    assert replica_addresses("a:1,b:2, c:3") == ["a:1", "b:2", "c:3"]
    assert replica_addresses("dns:///target:50052") == ["dns:///target:50052"]
    assert replica_addresses("ipv4:10.0.0.1:1,10.0.0.2:1") == ["ipv4:10.0.0.1:1,10.0.0.2:1"]
    with pytest.raises(ValueError, match="empty address"):
        replica_addresses("a:1,,b:2")


def test_a_dns_address_names_a_pool_and_needs_a_port():
    assert dns_name("dns:///target:50052") == ("target", 50052)
    assert dns_name("dns://10.0.0.53/target.ns.svc:50052") == ("target.ns.svc", 50052)
    assert dns_name("10.0.0.1:50052") is None
    with pytest.raises(ValueError, match="needs a port"):
        dns_name("dns:///target")


def test_an_address_the_name_no_longer_resolves_to_takes_no_new_session_until_it_is_back():
    made = []

    def make(address, options):
        made.append(dict(options))
        return ServiceClient(address, None, None, kind="target")

    pool = Resolving("localhost", 7, make, 10.0)  # the real resolver: 127.0.0.1 (and ::1 where it is listed)
    first = pool.replicas[0]  # addresses sorted: 127.0.0.1 first
    assert first.address == "127.0.0.1:7" and made[0]["grpc.default_authority"] == "localhost:7"
    first.info = pb.ModelInfo(model_id="m")
    pool.update([], 1.0)
    assert first.gone and pool.live == []
    pool.update(["127.0.0.1"], 1.0)
    assert not first.gone and pool.live == [first] and len(pool.replicas) == len(made)  # none made twice


def test_a_replicas_report_counts_other_orchestrators_sessions_and_its_kv_breaks_ties():
    replicas = pool(3)
    for replica in replicas.replicas:
        replica.info = pb.ModelInfo()  # live
    first, second, third = replicas.replicas
    first.reported = pb.StatsResponse(active_sessions=4, kv_reserved=10, kv_budget=100)  # others' sessions
    second.reported = pb.StatsResponse(active_sessions=1, kv_reserved=90, kv_budget=100)
    third.reported = pb.StatsResponse(active_sessions=1, kv_reserved=20, kv_budget=100)
    assert replicas.place("a", lambda r: Transport()).replica is third  # as few sessions, less KV taken
    assert third.load == (2, 0.2)  # the report, with the session placed since
    assert replicas.place("b", lambda r: Transport()).replica is second  # 1 session against third's 2
    third.sessions_at_report, third.reported = 1, pb.StatsResponse(active_sessions=2, kv_reserved=40, kv_budget=100)
    assert third.load == (2, 0.4)  # the new report holds "a": not counted twice
    assert first.load == (4, 0.1)
    first.reported = None  # unreachable: its own sessions only
    assert first.load == (0, 0.0)
