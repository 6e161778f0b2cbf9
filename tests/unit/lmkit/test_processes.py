"""Ports for services restarted in place: outside the range the kernel hands to bind(0) and outgoing connections."""

import socket
from pathlib import Path

import pytest

from specsplit.lmkit.processes import restartable_port

pytestmark = pytest.mark.unit


def test_a_restartable_port_is_free_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {restartable_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports)
    assert len(ports) > 1  # drawn, so two runs side by side rarely pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_no_bind_to_port_zero_hands_out_a_restartable_port():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        assert all(s.getsockname()[1] >= low for s in held)
    finally:
        for s in held:
            s.close()
