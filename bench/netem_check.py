"""The emulated link verified against itself: what a relay adds, measured, against what it was asked.

A TCP echo server on 127.0.0.1 answers ping-pongs sent through a relay
(``specsplit.bench.netem``, its own process) and sent direct; the added round trip is
the difference of the two medians, and should be 2 x the one-way delay within
10 %. With a rate, a bulk transfer measures the bandwidth too.

    python -m specsplit.bench.netem_check --delay-ms 1 [--jitter-ms 0.1] [--rate-mbit 50] [--json F]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from specsplit.bench.netem import CHUNK_BYTES, Shape, parse_address, precise_timers, start_link


class _Echo:
    """A TCP echo server on 127.0.0.1 (a thread per connection), the far end of a self-check."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(CHUNK_BYTES):
                conn.sendall(data)

    def close(self) -> None:
        self.listener.close()


def ping_pong_s(address: str, count: int, size: int = 64) -> list[float]:
    """Round-trip times of ``count`` ping-pongs of ``size`` bytes to an echo server at ``address``."""
    host, port = parse_address(address)
    out = []
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = b"x" * size
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(payload)
            got = 0
            while got < size:
                got += len(sock.recv(CHUNK_BYTES))
            out.append(time.perf_counter() - start)
    return out


def transfer_s(address: str, size: int) -> float:
    """Seconds to send ``size`` bytes one way through ``address`` (an echo server) and hear them all back."""
    host, port = parse_address(address)
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        threading.Thread(target=sock.sendall, args=(b"x" * size,), daemon=True).start()
        got = 0
        while got < size:
            got += len(sock.recv(CHUNK_BYTES))
        return time.perf_counter() - start


def self_check(shape: Shape, workdir: Path, pings: int = 200, transfer_bytes: int = 0) -> dict:
    """Measure a relay with ``shape`` against what it was asked for.

    Added RTT = median ping-pong RTT through the relay minus the median of the
    same ping-pong direct (both to an echo server on 127.0.0.1); asked = 2 x delay.
    With ``transfer_bytes`` and a rate, also the rate achieved one way (the echo
    back goes through the limit too, so the transfer takes about size / rate).
    """
    precise_timers()
    echo = _Echo()
    try:
        ping_pong_s(echo.address, 20)  # warm-up
        direct = ping_pong_s(echo.address, pings)
        link = start_link(echo.address, shape, workdir, "self-check")
        try:
            ping_pong_s(link.address, 5)
            relayed = ping_pong_s(link.address, pings)
            seconds = transfer_s(link.address, transfer_bytes) if transfer_bytes else 0.0
        finally:
            relay_stats = link.stop()
    finally:
        echo.close()
    asked = 2 * shape.delay_s
    added = statistics.median(relayed) - statistics.median(direct)
    report = {
        "emulated": True,
        "asked_rtt_ms": round(asked * 1e3, 4),
        "measured_added_rtt_ms": round(added * 1e3, 4),
        "error": round(added / asked - 1, 4) if asked else None,
        "asked_rtt_jitter_ms": round(2**0.5 * shape.jitter_s * 1e3, 4),  # two independent one-way draws
        "measured_rtt_jitter_ms": round(statistics.stdev(relayed) * 1e3, 4),
        "direct_rtt_ms": round(statistics.fmean(direct) * 1e3, 4),
        "pings": pings,
        "relay": relay_stats,
    }
    if transfer_bytes and shape.rate_bps:
        # Each byte crosses the limit twice (there and back), pipelined: the transfer takes ~size / rate.
        report["asked_rate_mbit"] = round(shape.rate_bps / 1e6, 3)
        report["measured_rate_mbit"] = round(8 * transfer_bytes / max(seconds - asked, 1e-9) / 1e6, 3)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specsplit.bench.netem_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay, each direction")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--rate-mbit", type=float, default=0.0)
    p.add_argument("--pings", type=int, default=200)
    p.add_argument("--transfer-bytes", type=int, default=2_000_000, help="bulk transfer size when --rate-mbit is set")
    p.add_argument("--json", default="", help="also write the report here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="netem-") as tmp:
        report = self_check(Shape.from_ms(args.delay_ms, args.jitter_ms, args.rate_mbit), Path(tmp), args.pings,
                            args.transfer_bytes if args.rate_mbit else 0)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
