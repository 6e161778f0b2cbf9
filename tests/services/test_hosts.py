"""The hosts harness (``specsplit.bench.hosts``) on this kernel: real namespaces, veth links and qdiscs (needs root).

Hosts reach each other at their home addresses and nothing else; a link taken down carries nothing
until it is brought up; a rate limit and the relay on the router host carry every byte; and the
namespaces of a harness whose process was killed are found and deleted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from specsplit.bench import hosts
from specsplit.bench.netem import Shape
from tests.conftest import wait_until

WHY_NOT = hosts.unavailable()
pytestmark = [pytest.mark.services, pytest.mark.skipif(WHY_NOT is not None, reason=f"no hosts here: {WHY_NOT}")]

ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
"""
SEND = """
import socket, sys
host, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(b"x" * size)
        got = 0
        while got < size:
            got += len(conn.recv(65536))
    print(got)
except OSError as exc:
    print(type(exc).__name__)
"""
PORT = 7000


@pytest.fixture
def net():
    with hosts.Hosts(["a", "b"]) as built:
        echo = built.popen(
            "b", [sys.executable, "-c", ECHO, built.address("b"), str(PORT)], stdout=subprocess.PIPE, text=True
        )
        assert echo.stdout.readline().strip() == "listening"
        yield built


def send(net, host: str, address: str, port: int, size: int = 1000, timeout_s: float = 10.0) -> str:
    """What a client on ``host`` got back from the echo server: the byte count, or the error's name."""
    return net.run(
        host, [sys.executable, "-c", SEND, address, str(port), str(size), str(timeout_s)], timeout=timeout_s + 30
    ).stdout.strip()


def test_hosts_reach_each_other_through_the_router_and_nothing_else(net):
    assert send(net, "a", net.address("b"), PORT) == "1000"
    for host in ("a", "b", "router"):
        routes = net.run(host, ["ip", "route", "show"]).stdout
        assert "default" not in routes, routes
        outside = net.run(host, ["ip", "route", "get", "192.0.2.1"])  # this machine's own network: no packet sent
        assert outside.returncode != 0 and "unreachable" in outside.stderr.lower(), outside
    assert net.run("a", ["ip", "-o", "addr", "show", "dev", "lo"]).stdout.count("10.213.0.1/32") == 1


def test_a_link_taken_down_carries_nothing_until_it_is_brought_up(net):
    net.take_down("b")
    assert send(net, "a", net.address("b"), PORT, timeout_s=1.0) in ("TimeoutError", "OSError")
    net.bring_up("b")
    assert send(net, "a", net.address("b"), PORT) == "1000"


def test_a_rate_limit_carries_every_byte(net):
    net.limit_rate("b", 2_000_000)
    assert "tbf" in net.run("b", ["tc", "qdisc", "show", "dev", "to-router"]).stdout
    assert send(net, "a", net.address("b"), PORT, size=100_000) == "100000"
    net.limit_rate("b", 2_000_000, qdisc="htb")
    assert "htb" in net.run("router", ["tc", "qdisc", "show", "dev", "to-b"]).stdout
    assert send(net, "a", net.address("b"), PORT, size=100_000) == "100000"
    net.unshape("b")
    assert "tbf" not in net.run("b", ["tc", "qdisc", "show", "dev", "to-router"]).stdout


def test_the_relay_on_the_router_carries_the_link_and_reports_it(net, tmp_path):
    relay, _ = net.relay("b", PORT, Shape.from_ms(2, 0.5), tmp_path)
    assert relay.startswith(net.address("router") + ":")
    assert send(net, "a", *relay.rsplit(":", 1), size=5000) == "5000"
    net.close()  # stops the relay, which writes what it did
    stats = json.loads((tmp_path / "b-relay.stats.json").read_text())
    assert stats["upstream"] == f"{net.address('b')}:{PORT}" and stats["connections"] == 1, stats
    assert stats["up"]["bytes"] == stats["down"]["bytes"] == 5000, stats


def test_delay_uses_netem_where_the_kernel_has_it_else_says_to_use_the_relay(net):
    if "netem" in hosts.kernel_qdiscs():
        net.delay("b", 1.0, 0.1)
        assert "netem" in net.run("b", ["tc", "qdisc", "show"]).stdout
    else:
        with pytest.raises(hosts.HostError, match="no netem qdisc.*relay"):
            net.delay("b", 1.0)
    assert {"tbf", "htb"} <= hosts.kernel_qdiscs()


OWNER = """
import sys, time
from specsplit.bench import hosts
net = hosts.Hosts(["x"]).__enter__()
net.popen("x", ["sleep", "600"])
print(",".join(net.namespaces.values()), flush=True)
time.sleep(600)
"""


def test_the_hosts_of_a_killed_harness_are_cleaned_up_by_the_next():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    left = owner.stdout.readline().strip().split(",")

    def inside() -> list[int]:
        return [int(pid) for pid in
                subprocess.run(["ip", "netns", "pids", left[0]], capture_output=True, text=True).stdout.split()]

    assert wait_until(inside, 10.0)  # `ip netns exec` may not have entered the host yet when the owner prints
    sleeper = inside()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert set(left) <= set(hosts.harness_namespaces()) and sleeper
    with hosts.Hosts(["y"]):
        assert not set(left) & set(hosts.harness_namespaces())
    assert not set(hosts.harness_namespaces()) & set(left)
    assert wait_until(lambda: not any(_running(pid) for pid in sleeper), 5.0)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_unavailable_says_why_without_root():
    result = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            "from specsplit.bench import hosts; print(hosts.unavailable())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "hosts need root" in result.stdout, result
