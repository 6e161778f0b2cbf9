"""The hosts' plan (``specsplit.bench.host_plan``): addresses, links, routes and the commands that build and shape
them. The hosts themselves are built in tests/services/test_hosts.py."""

from __future__ import annotations

import ipaddress

import pytest

from specsplit.bench import host_plan
from specsplit.bench.host_plan import NETWORK, Route

pytestmark = pytest.mark.unit


def test_a_star_gives_each_host_a_home_address_and_a_link_to_the_router():
    p = host_plan.plan(["draft", "target", "orch"])
    assert p.hosts == ("draft", "target", "orch", "router")
    assert [p.home(h) for h in p.hosts] == ["10.213.0.1", "10.213.0.2", "10.213.0.3", "10.213.0.4"]
    assert [(link.a, link.b, link.a_address, link.b_address) for link in p.links] == [
        ("router", "draft", "10.213.1.1", "10.213.1.2"),
        ("router", "target", "10.213.2.1", "10.213.2.2"),
        ("router", "orch", "10.213.3.1", "10.213.3.2"),
    ]
    assert p.link_of("target").end("target") == ("to-router", "10.213.2.2", "10.213.2.1")
    assert p.link_of("target").end("router") == ("to-target", "10.213.2.1", "10.213.2.2")


def test_no_host_has_a_default_route_and_every_address_is_in_the_private_range():
    for router in ("router", None):
        p = host_plan.plan(["a", "b", "c"], router)
        for host in p.hosts:
            for route in p.routes(host):
                network = ipaddress.ip_network(route.destination)
                assert network.prefixlen > 0 and network.subnet_of(NETWORK), route
                assert ipaddress.ip_address(route.via) in NETWORK and route.source == p.home(host)
        assert NETWORK.is_private


def test_star_routes_go_through_the_router_and_the_router_reaches_each_home():
    p = host_plan.plan(["a", "b"])
    assert p.routes("a") == [Route("10.213.0.0/16", "10.213.1.1", "to-router", "10.213.0.1")]
    assert p.routes("router") == [
        Route("10.213.0.1/32", "10.213.1.2", "to-a", "10.213.0.3"),
        Route("10.213.0.2/32", "10.213.2.2", "to-b", "10.213.0.3"),
    ]


def test_a_mesh_links_every_pair_and_routes_each_home_over_its_own_link():
    p = host_plan.plan(["a", "b", "c"], router=None)
    assert p.router is None and [(x.a, x.b) for x in p.links] == [("a", "b"), ("a", "c"), ("b", "c")]
    assert p.routes("b") == [
        Route("10.213.0.1/32", "10.213.1.1", "to-a", "10.213.0.2"),
        Route("10.213.0.3/32", "10.213.3.2", "to-c", "10.213.0.2"),
    ]
    with pytest.raises(ValueError, match="name both ends"):
        p.link_of("a")
    with pytest.raises(ValueError, match="no link joins 'a' and 'a'"):
        p.link("a", "a")


@pytest.mark.parametrize(
    "hosts, message",
    [
        ([], "at least one host"),
        (["a", "a"], "must differ"),
        (["a-very-long-name"], "1 to 12 letters"),
        (["a b"], "1 to 12 letters"),
        (["a", "router"], "must differ"),
    ],
)
def test_bad_host_names_are_refused_saying_what_a_name_may_be(hosts, message):
    with pytest.raises(ValueError, match=message):
        host_plan.plan(hosts)


def test_namespaces_name_their_owner_so_leftovers_can_be_found():
    ns = host_plan.namespace(4242, "my-host", 3)
    assert ns == "sshost-4242-3-my-host" and host_plan.owner_of(ns) == 4242
    for other in ("sshost-x-1-target", "other-1-1-a", "sshost-12", "sshost-12-1", "sshost-12-a-b"):
        assert host_plan.owner_of(other) is None, other


def test_build_commands_make_namespaces_links_addresses_forwarding_and_routes_in_order():
    p = host_plan.plan(["a"])
    ns = {"a": "N-a", "router": "N-r"}
    commands = [" ".join(argv) for argv in host_plan.build_commands(p, ns)]
    assert commands == [
        "ip netns add N-a",
        "ip netns add N-r",
        "ip -n N-a link set lo up",
        "ip -n N-a addr add 10.213.0.1/32 dev lo",
        "ip -n N-r link set lo up",
        "ip -n N-r addr add 10.213.0.2/32 dev lo",
        "ip link add to-a netns N-r type veth peer name to-router netns N-a",
        "ip -n N-r addr add 10.213.1.1/24 dev to-a",
        "ip -n N-r link set to-a up",
        "ip -n N-a addr add 10.213.1.2/24 dev to-router",
        "ip -n N-a link set to-router up",
        "ip netns exec N-r sysctl -q -w net.ipv4.ip_forward=1",
        "ip -n N-a route replace 10.213.0.0/16 via 10.213.1.1 dev to-router src 10.213.0.1",
        "ip -n N-r route replace 10.213.0.1/32 via 10.213.1.2 dev to-a src 10.213.0.2",
    ]


def test_shaping_commands():
    assert " ".join(host_plan.tbf_command("N", "to-router", 64_000)) == (
        "tc -n N qdisc replace dev to-router root tbf rate 64000bit burst 1600 latency 400ms"
    )
    assert host_plan.tbf_command("N", "d", 80e6)[12] == "10000"  # 1 ms at the rate once that passes one frame
    assert [" ".join(c) for c in host_plan.htb_commands("N", "d", 1e6)] == [
        "tc -n N qdisc replace dev d root handle 1: htb default 1",
        "tc -n N class replace dev d parent 1: classid 1:1 htb rate 1000000bit ceil 1000000bit",
    ]
    assert (
        " ".join(host_plan.netem_command("N", "d", 1, 0.2)) == "tc -n N qdisc replace dev d root netem delay 1ms 0.2ms"
    )
    assert " ".join(host_plan.link_state_command("N", "d", up=False)) == "ip -n N link set d down"
    assert host_plan.in_host("N", ["specsplit", "serve"]) == ["ip", "netns", "exec", "N", "specsplit", "serve"]
    for bad in (
        lambda: host_plan.tbf_command("N", "d", 0),
        lambda: host_plan.htb_commands("N", "d", -1),
        lambda: host_plan.netem_command("N", "d", -1),
    ):
        with pytest.raises(ValueError, match=">"):
            bad()
