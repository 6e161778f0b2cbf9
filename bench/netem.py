"""An emulated network link: a TCP relay that delays, jitters and rate-limits each direction.

An **emulation** on one machine, not a network: a process between a client and a service holds
every chunk it relays for a one-way delay, so the code under test runs unchanged and only sees
another address. Each direction is shaped like Linux ``tc netem delay D J rate R`` over a byte
stream (``_Schedule``); the relay never drops bytes: a chunk "lost" arrives late, as TCP's
retransmission would deliver it. One process per link:

    python -m specsplit.bench.netem --upstream 127.0.0.1:50051 --delay-ms 1 [--jitter-ms 0.2] [--rate-mbit 100]
                          [--loss 0.01 --retransmit-ms 200] [--port 0 --port-file F] [--stats-file F.json]

SIGUSR1 stalls the link, SIGUSR2 resumes it, SIGHUP re-reads ``--control-file``, SIGTERM writes
``--stats-file`` and exits; ``LinkProcess`` drives these from Python, and
``specsplit.bench.netem_check`` measures a relay against what it was asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import statistics
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from specsplit.lmkit.processes import ServiceProcess, start_service

CHUNK_BYTES = 65536  # bytes per read
_SPIN_S = 20e-6  # spun, not slept, before a chunk is due
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python does not export it


@dataclass(frozen=True)
class Shape:
    """One direction of a link: one-way delay and its jitter (seconds), and a rate (bit/s; 0 = unlimited)."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    rate_bps: float = 0.0
    loss: float = 0.0  # probability that a chunk is lost: TCP retransmits it, so it comes ``retransmit_s`` late
    retransmit_s: float = 0.2  # Linux's minimum retransmission timeout

    def __post_init__(self) -> None:
        if min(self.delay_s, self.jitter_s, self.rate_bps, self.retransmit_s) < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"delay, jitter, rate and retransmit must be >= 0 and loss in [0, 1), got {self}")

    @classmethod
    def from_ms(cls, delay_ms: float, jitter_ms: float = 0.0, rate_mbit: float = 0.0, loss: float = 0.0,
                retransmit_ms: float = 200.0) -> "Shape":
        return cls(delay_ms / 1e3, jitter_ms / 1e3, rate_mbit * 1e6, loss, retransmit_ms / 1e3)

    def flags(self) -> list[str]:
        """The relay's command-line flags for this shape."""
        return ["--delay-ms", repr(self.delay_s * 1e3), "--jitter-ms", repr(self.jitter_s * 1e3),
                "--rate-mbit", repr(self.rate_bps / 1e6), "--loss", repr(self.loss),
                "--retransmit-ms", repr(self.retransmit_s * 1e3)]


class _Schedule:
    """When each chunk of one direction leaves. A chunk of b bytes read at time t leaves at

        start = max(t, free);  free = start + 8 b / R        (serialisation at R bit/s)
        due   = max(free + max(0, D + J z) + L, due of the chunk before)    z ~ N(0, 1)

    The max with the chunk before keeps bytes in order (TCP is a byte stream: a
    chunk drawn a shorter delay waits behind the one ahead, head-of-line
    blocking). L is ``retransmit_s`` for a chunk "lost" (probability ``loss``), else 0.
    """

    def __init__(self, shape: Callable[[], Shape], rng: random.Random) -> None:
        self.shape = shape  # read per chunk: the relay may change it while running
        self._rng = rng
        self._free = 0.0
        self._last_due = 0.0

    def due(self, arrived: float, size: int) -> float:
        s = self.shape()
        start = max(arrived, self._free)
        self._free = start + (8 * size / s.rate_bps if s.rate_bps else 0.0)
        delay = max(0.0, s.delay_s + (self._rng.gauss(0.0, s.jitter_s) if s.jitter_s else 0.0))
        if s.loss and self._rng.random() < s.loss:
            delay += s.retransmit_s
        self._last_due = max(self._free + delay, self._last_due)
        return self._last_due


class _Counters:
    """What one direction did: chunks, bytes, and how long each chunk was held (for --stats-file)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.bytes = 0
        self.held_s: deque[float] = deque(maxlen=100_000)
        self.late_s: deque[float] = deque(maxlen=100_000)  # sent this long after its due time (< 0: early)
        self._lock = threading.Lock()

    def record(self, size: int, held: float, late: float) -> None:
        with self._lock:
            self.chunks += 1
            self.bytes += size
            self.held_s.append(held)
            self.late_s.append(late)

    def summary(self) -> dict:
        with self._lock:
            held, late = sorted(self.held_s), sorted(self.late_s)
        def pct(xs, q):
            return round(xs[min(int(q * len(xs)), len(xs) - 1)] * 1e3, 4) if xs else 0.0
        return {
            "chunks": self.chunks, "bytes": self.bytes,
            "held_ms_mean": round(statistics.fmean(held) * 1e3, 4) if held else 0.0,
            "held_ms_p50": pct(held, 0.5), "held_ms_p99": pct(held, 0.99),
            "late_ms_p1": pct(late, 0.01), "late_ms_p50": pct(late, 0.5), "late_ms_p99": pct(late, 0.99),
        }


class _Gate:
    """Open while the link flows; SIGUSR1 closes it (a stall), SIGUSR2 opens it."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def stall(self, *_args) -> None:
        self._open.clear()

    def resume(self, *_args) -> None:
        self._open.set()

    def wait(self) -> None:
        self._open.wait()


class _Direction:
    """Bytes from ``src`` to ``dst``: a reader stamps each chunk with its due time, a writer sends it then."""

    def __init__(self, src: socket.socket, dst: socket.socket, schedule: _Schedule, counters: _Counters,
                 gate: _Gate, on_done) -> None:
        self.src, self.dst = src, dst
        self.schedule, self.counters, self.gate = schedule, counters, gate
        self._queue: deque[tuple[float, float, bytes]] = deque()
        self._ready = threading.Condition()
        self._on_done = on_done
        self._oversleep: deque[float] = deque([50e-6], maxlen=31)  # recent oversleeps of time.sleep
        self._send_s: deque[float] = deque([20e-6], maxlen=31)  # recent sendall times: start that much early

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        self.src.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        while True:
            try:
                data, ancillary, _flags, _addr = self.src.recvmsg(CHUNK_BYTES, socket.CMSG_SPACE(16))
            except OSError:
                data, ancillary = b"", []
            now = _arrival(ancillary)
            due = self.schedule.due(now, len(data)) if data else now
            with self._ready:
                self._queue.append((now, due, data))
                self._ready.notify()
            if not data:
                return

    def _write(self) -> None:
        try:
            while True:
                with self._ready:
                    while not self._queue:
                        self._ready.wait()
                    arrived, due, data = self._queue.popleft()
                self.gate.wait()
                self._sleep_until(due - statistics.median(self._send_s))
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                start = time.perf_counter()
                self.dst.sendall(data)
                sent = time.perf_counter()
                self._send_s.append(sent - start)
                self.counters.record(len(data), sent - arrived, sent - due)
        except OSError:
            pass
        finally:
            self._on_done()

    def _sleep_until(self, due: float) -> None:
        """Sleep until ``due``: wake early by the typical oversleep (a VM's timers run late), spin the rest."""
        planned = due - (statistics.median(self._oversleep) + _SPIN_S)
        wait = planned - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
            self._oversleep.append(max(time.perf_counter() - planned, 0.0))
        while time.perf_counter() < due:
            time.sleep(0)  # lets the reader thread take the GIL


def _arrival(ancillary) -> float:
    """When the kernel received the chunk (SO_TIMESTAMPNS), on the perf_counter clock; now if not stamped.

    The reader thread wakes tens to hundreds of microseconds after the bytes
    arrived; holding from the kernel's stamp keeps that out of the delay.
    """
    now = time.perf_counter()
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            return now - max(time.time_ns() - (sec * 10**9 + nsec), 0) / 1e9
    return now


class Relay:
    """Accepts connections on ``listener`` and relays each to ``upstream`` through two shaped directions."""

    def __init__(self, listener: socket.socket, upstream: tuple[str, int], up: Shape, down: Shape, seed: int) -> None:
        self.listener = listener
        self.upstream = upstream
        self.shapes = {"up": up, "down": down}  # up: client -> service; down: service -> client
        self.counters = {"up": _Counters(), "down": _Counters()}
        self.gate = _Gate()
        self._rng = random.Random(seed)
        self.connections = 0
        self.shape_changes = 0
        self.priority = "normal"

    def set_shapes(self, up: Shape, down: Shape) -> None:
        """Shape every chunk read from now on, on every connection, open or new, by these."""
        self.shapes = {"up": up, "down": down}
        self.shape_changes += 1

    def serve_forever(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._relay(client)

    def _relay(self, client: socket.socket) -> None:
        try:
            service = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        self.connections += 1
        for sock in (client, service):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle: the delay is ours alone
        remaining = [2]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            for sock in (client, service):
                with contextlib.suppress(OSError):
                    sock.close()

        rng = random.Random(self._rng.random())
        for name, src, dst in (("up", client, service), ("down", service, client)):
            schedule = _Schedule(lambda name=name: self.shapes[name], random.Random(rng.random()))
            _Direction(src, dst, schedule, self.counters[name], self.gate, done).start()

    def stats(self) -> dict:
        return {
            "emulated": True,
            "upstream": f"{self.upstream[0]}:{self.upstream[1]}",
            "connections": self.connections,
            "shape_changes": self.shape_changes,
            "priority": self.priority,
            **{f"{name}_shape": asdict(shape) for name, shape in self.shapes.items()},
            **{name: c.summary() for name, c in self.counters.items()},
        }


def precise_timers() -> None:
    """1 ns timer slack for this thread and those it starts (Linux default 50 µs), so sleeps end when asked."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(29, 1)  # PR_SET_TIMERSLACK


def _wake_first() -> str:
    """Ask for a real-time (SCHED_FIFO) priority, else a higher nice, for this thread and those it starts.

    On a busy machine a sleeping relay thread otherwise wakes milliseconds late
    behind CPU-bound services. The relay mostly sleeps, so it takes little from
    them. Returns what it got: "fifo", "nice" or "normal" (not permitted).
    """
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return "fifo"
    with contextlib.suppress(OSError):
        os.nice(-10)
        return "nice"
    return "normal"


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specsplit.bench.netem", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", type=parse_address, required=True, help="the service's HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="where to listen (0: a free port, see --port-file)")
    p.add_argument("--port-file", default="", help="write the bound port here once listening")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="standard deviation of the one-way delay")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="bandwidth per direction, Mbit/s (0: unlimited)")
    p.add_argument("--loss", type=float, default=0.0,
                   help="probability that a chunk is lost; TCP would retransmit it, so it arrives --retransmit-ms late")
    p.add_argument("--retransmit-ms", type=float, default=200.0, help="the delay a lost chunk adds (Linux's min RTO)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter and loss draws")
    p.add_argument("--stats-file", default="", help="on SIGTERM, write what each direction did here (JSON)")
    p.add_argument("--control-file", default="",
                   help="on SIGHUP, take the shapes from this JSON ({'up': {...}, 'down': {...}, 'generation': n}, "
                        "Shape's fields in seconds and bit/s) and write {'generation': n} to FILE.applied")
    p.add_argument("--no-priority", dest="priority", action="store_false",
                   help="do not ask for a real-time priority (see _wake_first)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shape = Shape.from_ms(args.delay_ms, args.jitter_ms, args.rate_mbit, args.loss, args.retransmit_ms)
    except ValueError as exc:
        print(f"specsplit.bench.netem: error: {exc}", file=sys.stderr)
        return 2
    precise_timers()
    priority = _wake_first() if args.priority else "normal"
    listener = socket.create_server((args.host, args.port))
    relay = Relay(listener, args.upstream, shape, shape, args.seed)
    relay.priority = priority
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, relay.gate.stall)
    signal.signal(signal.SIGUSR2, relay.gate.resume)
    if args.control_file:
        signal.signal(signal.SIGHUP, lambda *_: _apply_control(relay, Path(args.control_file)))
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    if args.port_file:
        Path(args.port_file).write_text(str(listener.getsockname()[1]))
    while not stop.wait(0.5):
        pass
    listener.close()
    if args.stats_file:
        Path(args.stats_file).write_text(json.dumps(relay.stats(), indent=2) + "\n")
    return 0


def _apply_control(relay: Relay, path: Path) -> None:
    """SIGHUP: the shapes in ``path`` replace the relay's; FILE.applied acknowledges (or tells what was wrong)."""
    ack: dict = {}
    try:
        control = json.loads(path.read_text())
        ack["generation"] = control.get("generation")
        relay.set_shapes(Shape(**control["up"]), Shape(**control["down"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        ack["error"] = f"{type(exc).__name__}: {exc}"
        print(f"specsplit.bench.netem: control file {path}: {ack['error']}", file=sys.stderr, flush=True)
    _write_atomically(path.with_name(path.name + ".applied"), json.dumps(ack))


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


# -- as a process, from the bench and the tests ------------------------------------------------------------
class LinkProcess:
    """A relay running as its own process in front of ``upstream``; ``address`` is where to connect instead."""

    def __init__(self, service: ServiceProcess, upstream: str, shape: Shape, stats_path: Path,
                 control_path: Path) -> None:
        self.service = service
        self.upstream = upstream
        self.shape = shape  # up (client -> service); ``down`` the other way
        self.down = shape
        self.stats_path = stats_path
        self.control_path = control_path
        self._generation = 0
        self._stats: dict | None = None

    @property
    def address(self) -> str:
        return self.service.address

    def stall(self) -> None:
        self.service.process.send_signal(signal.SIGUSR1)

    def resume(self) -> None:
        self.service.process.send_signal(signal.SIGUSR2)

    def set_shape(self, shape: Shape, down: Shape | None = None, timeout_s: float = 5.0) -> None:
        """Shape the link by ``shape`` (both directions, or ``down`` for service -> client) from now on.

        Returns once the relay has applied it: bytes it reads after that are
        held by the new shape (bytes already held keep their due time, and the
        byte order is kept). ValueError if the relay refused the file,
        TimeoutError if it did not answer within ``timeout_s``.
        """
        down = shape if down is None else down
        self._generation += 1
        applied = self.control_path.with_name(self.control_path.name + ".applied")
        control = {"up": asdict(shape), "down": asdict(down), "generation": self._generation}
        _write_atomically(self.control_path, json.dumps(control))
        self.service.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError, ValueError):
                ack = json.loads(applied.read_text())
                if ack.get("generation") == self._generation:
                    if "error" in ack:
                        raise ValueError(f"the relay refused the shape: {ack['error']}")
                    self.shape, self.down = shape, down
                    return
            if self.service.process.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"relay {self.service.name} did not apply the shape within {timeout_s} s")
            time.sleep(0.002)

    def stop(self) -> dict:
        """Stop the relay (once); returns what it did (the --stats-file contents)."""
        if self._stats is None:
            self.service.stop()
            self._stats = {}
            with contextlib.suppress(OSError, ValueError):
                self._stats = json.loads(self.stats_path.read_text())
        return self._stats


def start_link(upstream: str, shape: Shape, workdir: Path, name: str = "link", seed: int = 0,
               host: str = "127.0.0.1", wrap: Sequence[str] = ()) -> LinkProcess:
    """Start a relay process for ``upstream`` (HOST:PORT) listening on ``host`` (run under ``wrap``, e.g.
    inside a network namespace) and wait until it listens."""
    stats, control = workdir / f"{name}.stats.json", workdir / f"{name}.control.json"
    for stale in (control, control.with_name(control.name + ".applied")):  # an earlier relay's of this name
        stale.unlink(missing_ok=True)
    args = ["--upstream", upstream, "--seed", str(seed), "--stats-file", str(stats), "--control-file", str(control),
            "--host", host, *shape.flags()]
    service = start_service("specsplit.bench.netem", name, args, workdir, timeout_s=30.0, wrap=wrap)
    return LinkProcess(service, upstream, shape, stats, control)


@contextlib.contextmanager
def links(upstreams: dict[str, str], shape: Shape, workdir: Path, seed: int = 0):
    """One relay per named upstream (e.g. {"draft": ..., "target": ...}) for the block; all stopped after.
    A zero shape (no delay, jitter or rate) relays nothing: the upstream is used directly."""
    started: dict[str, LinkProcess] = {}
    try:
        if shape == Shape():
            yield {name: address for name, address in upstreams.items()}, started
            return
        for i, (name, upstream) in enumerate(upstreams.items()):
            started[name] = start_link(upstream, shape, workdir, f"{name}-link", seed + i)
        yield {name: link.address for name, link in started.items()}, started
    finally:
        for link in started.values():
            link.stop()


if __name__ == "__main__":
    sys.exit(main())
