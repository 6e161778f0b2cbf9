"""Hosts inside one machine for tests and benches: network namespaces joined by veth links (needs root).

    with Hosts(["draft", "target", "orch"]) as net:        # and a router host between them
        target = net.start_service("target", "specsplit.target_service.server", "target", [...], workdir)
        net.address("target")                             # 10.213.0.2: the target's home address
        net.popen("orch", ["specsplit", "serve", ...])   # any command, inside a host
        net.limit_rate("target", 64_000)                 # tbf on both ends of the target's link
        address, relay = net.relay("target", target.port, Shape.from_ms(1), workdir)  # delay via the router
        net.take_down("draft"); net.bring_up("draft")    # a partition, and its end
        with net.inside("orch"): ...                      # this thread's sockets and children in a host

The plan (addresses, routes, the commands) is ``specsplit.bench.host_plan``: a
private range that exists only inside the namespaces, no default route. Delay
and jitter come from the kernel's ``netem`` where it has one (``delay``), else
from the relay (``specsplit.bench.netem``) run on the router host (``relay``);
``kernel_qdiscs()`` says which qdiscs this kernel has.

Clean-up is always done: leaving the block kills every process in the hosts and
deletes the namespaces (their links go with them); a harness whose process was
killed leaves namespaces named after its pid, and the next ``Hosts`` (or
``python -m specsplit.bench.hosts --clean``) deletes those of owners that are gone.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from specsplit.bench import host_plan
from specsplit.bench.host_plan import Plan
from specsplit.bench.netem import LinkProcess, Shape, start_link
from specsplit.lmkit.processes import ServiceProcess, start_service

PROBED_QDISCS = ("netem", "tbf", "htb", "pfifo", "fq", "fq_codel", "sfq", "prio", "clsact")
_PROBE_ARGS = {"netem": ["delay", "1ms"], "tbf": ["rate", "1mbit", "burst", "1600", "latency", "10ms"]}


_SERIALS = itertools.count(1)  # 0 names the probes' scratch namespaces
CLONE_NEWNET = 0x40000000
STOP_GRACE_S = 5.0  # services still up when the block ends get this long, all together, to stop on SIGTERM


class HostError(RuntimeError):
    """A command that builds, shapes or cleans the hosts failed; says which and what it printed."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise HostError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why hosts cannot be built here (not root, no ``ip``/``tc``, namespaces refused); None when they can."""
    if sys.platform != "linux":
        return "hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "hosts need root (ip netns add, veth links, tc): run as root, as CI does"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"hosts need iproute2's {' and '.join(missing)} (apt-get install iproute2)"
    return _namespaces_refused()


@functools.cache
def _namespaces_refused() -> str | None:
    probe = host_plan.namespace(os.getpid(), "probe")
    made = _run(["ip", "netns", "add", probe], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    return None if made.returncode == 0 else f"`ip netns add` is refused here: {made.stderr.strip()}"


@functools.cache
def kernel_qdiscs() -> frozenset[str]:
    """The qdiscs of ``PROBED_QDISCS`` this kernel installs (each tried on a scratch namespace's loopback)."""
    probe = host_plan.namespace(os.getpid(), "qdisc")
    _run(["ip", "netns", "add", probe])
    found = set()
    try:
        for kind in PROBED_QDISCS:
            where = ["clsact"] if kind == "clsact" else ["root", kind, *_PROBE_ARGS.get(kind, [])]
            if _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", *where], check=False).returncode == 0:
                found.add(kind)
                _run(["tc", "-n", probe, "qdisc", "del", "dev", "lo", where[0]], check=False)
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return frozenset(found)


def harness_namespaces() -> list[str]:
    """Every namespace the harness made, whoever made it."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip() and host_plan.owner_of(line.split()[0]) is not None]


def clean_leftovers(everyone: bool = False) -> list[str]:
    """Delete the harness namespaces whose owner process is gone (``everyone``: all of them), killing what
    still runs in them; returns the namespaces deleted."""
    deleted = []
    for ns in harness_namespaces():
        owner = host_plan.owner_of(ns)
        if everyone or (owner is not None and not _alive(owner)):
            _delete_namespace(ns)
            deleted.append(ns)
    return deleted


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_everything_in(ns: str) -> None:
    """SIGKILL every process running in namespace ``ns``."""
    for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_namespace(ns: str) -> None:
    kill_everything_in(ns)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)  # its hosts file (``Hosts.set_names``)


class Hosts:
    """Named hosts built from a ``host_plan.Plan``, for the length of a ``with`` block (see the module docstring)."""

    def __init__(self, hosts: list[str], router: str | None = "router") -> None:
        self.plan: Plan = host_plan.plan(hosts, router)
        serial = next(_SERIALS)
        self.namespaces = {host: host_plan.namespace(os.getpid(), host, serial) for host in self.plan.hosts}
        self._services: list[ServiceProcess] = []
        self._relays: list[LinkProcess] = []

    def __enter__(self) -> "Hosts":
        reason = unavailable()
        if reason:
            raise HostError(reason)
        clean_leftovers()
        try:
            for argv in host_plan.build_commands(self.plan, self.namespaces):
                _run(argv)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every relay and service started here, kill what else runs in the hosts, delete them.

        The services get SIGTERM all at once, the last started first, and ``STOP_GRACE_S`` together: one by one,
        a target would wait out its grace for the sessions of an orchestrator not yet told to stop."""
        for relay in self._relays:
            with contextlib.suppress(Exception):
                relay.stop()
        running = [service.process for service in reversed(self._services) if service.process.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for ns in self.namespaces.values():
            _delete_namespace(ns)

    # -- addresses and commands -------------------------------------------------------------------------
    def address(self, host: str) -> str:
        """The host's home address (IPv4, no port)."""
        return self.plan.home(host)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host`` (``ip netns exec``)."""
        return host_plan.in_host(self.namespaces[host], argv)

    def run(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, argv), **kwargs)

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def start_service(
        self, host: str, module: str, name: str, args: list[str], workdir: Path, timeout_s: float = 600.0,
        port: int = 0,
    ) -> ServiceProcess:
        """``python -m module`` serving on the host's home address (on ``port``, 0: a free one); stopped when
        the block ends. Others reach it at ``reach(host, service)``."""
        service = start_service(
            module, name, [*args, "--host", self.address(host)], workdir, timeout_s, port=port,
            wrap=self.command(host, []),
        )
        self._services.append(service)
        return service

    def set_names(self, host: str, names: dict[str, list[str]]) -> None:
        """What each name resolves to inside ``host``: its own hosts file, which ``ip netns exec`` mounts over
        /etc/hosts for every command it starts there (``/etc/netns/NS/hosts``). Write it before starting a
        process that needs it; a rewrite is in place, so processes already running see the new addresses."""
        folder = Path("/etc/netns") / self.namespaces[host]
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", *(f"{address} {name}" for name, found in names.items() for address in found)]
        with open(folder / "hosts", "r+" if (folder / "hosts").exists() else "w") as f:
            f.seek(0)
            f.write("\n".join(lines) + "\n")
            f.truncate()

    @contextlib.contextmanager
    def inside(self, host: str):
        """The calling thread in ``host``'s network for the block: the sockets it opens (a gRPC channel's too)
        and the threads and processes it starts meanwhile are ``host``'s. gRPC's own threads keep the network
        they started in, so enter before the process makes its first gRPC channel or server; a process that
        already has one (a test worker) runs the code in a subprocess instead."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.namespaces[host]}", os.O_RDONLY)
        try:
            _set_network(there, f"host {host}")
            try:
                yield
            finally:
                _set_network(home, "the caller")
        finally:
            os.close(home)
            os.close(there)

    def reach(self, host: str, service: ServiceProcess) -> str:
        """HOST:PORT where the other hosts reach ``service`` running on ``host``."""
        return f"{self.address(host)}:{service.port}"

    # -- links ----------------------------------------------------------------------------------------
    def _ends(self, host: str, peer: str | None) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of the link between ``host`` and ``peer`` (default: the router)."""
        link = self.plan.link(host, peer) if peer is not None else self.plan.link_of(host)
        return [(self.namespaces[end], link.end(end)[0]) for end in (link.a, link.b)]

    def take_down(self, host: str, peer: str | None = None) -> None:
        """Cut the link (both ends down): nothing crosses it until ``bring_up``."""
        for ns, device in self._ends(host, peer):
            _run(host_plan.link_state_command(ns, device, up=False))

    def bring_up(self, host: str, peer: str | None = None) -> None:
        """Mend the link, and restore the routes that taking it down removed."""
        link = self.plan.link(host, peer) if peer is not None else self.plan.link_of(host)
        for ns, device in self._ends(host, peer):
            _run(host_plan.link_state_command(ns, device, up=True))
        for end in (link.a, link.b):
            for route in self.plan.routes(end):
                _run(host_plan.route_command(self.namespaces[end], route))

    def limit_rate(self, host: str, rate_bps: float, peer: str | None = None, qdisc: str = "tbf") -> None:
        """At most ``rate_bps`` each way on the link (``qdisc`` tbf or htb, on both ends' egress)."""
        for ns, device in self._ends(host, peer):
            if qdisc == "tbf":
                _run(host_plan.tbf_command(ns, device, rate_bps))
            elif qdisc == "htb":
                for argv in host_plan.htb_commands(ns, device, rate_bps):
                    _run(argv)
            else:
                raise ValueError(f"qdisc must be tbf or htb, got {qdisc!r}")

    def delay(self, host: str, delay_ms: float, jitter_ms: float = 0.0, peer: str | None = None) -> None:
        """A one-way delay each way on the link through the kernel's netem (see ``kernel_qdiscs``)."""
        if "netem" not in kernel_qdiscs():
            raise HostError("this kernel has no netem qdisc: delay a service through `relay` on the router host")
        for ns, device in self._ends(host, peer):
            _run(host_plan.netem_command(ns, device, delay_ms, jitter_ms))

    def unshape(self, host: str, peer: str | None = None) -> None:
        for ns, device in self._ends(host, peer):
            _run(host_plan.unshape_command(ns, device), check=False)

    def relay(
        self, host: str, port: int, shape: Shape, workdir: Path, name: str = "", seed: int = 0
    ) -> tuple[str, LinkProcess]:
        """The relay (``specsplit.bench.netem``) on the router host in front of ``host``'s PORT, shaped by
        ``shape``: (HOST:PORT on the router where the others connect instead, the relay: ``stall``, ``resume``,
        ``set_shape``, ``stop``). Stopped with the block."""
        if self.plan.router is None:
            raise ValueError("a relay runs on the router host: build the hosts with a router")
        upstream = f"{self.address(host)}:{port}"
        link = start_link(
            upstream,
            shape,
            workdir,
            name or f"{host}-relay",
            seed,
            host=self.address(self.plan.router),
            wrap=self.command(self.plan.router, []),
        )
        self._relays.append(link)
        return f"{self.address(self.plan.router)}:{link.service.port}", link


def _set_network(fd: int, whose: str) -> None:
    """``setns(2)``: the calling thread into the network namespace open at ``fd`` (``whose``: for the error)."""
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise HostError(f"could not enter the network of {whose}: {os.strerror(ctypes.get_errno())}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specsplit.bench.hosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", action="store_true", help="delete the hosts of harnesses that are gone")
    parser.add_argument("--clean-all", action="store_true", help="delete every harness's hosts, running or not")
    parser.add_argument("--probe", action="store_true", help="print the qdiscs this kernel has")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"specsplit.bench.hosts: {reason}", file=sys.stderr)
        return 2
    if args.clean or args.clean_all:
        for ns in clean_leftovers(everyone=args.clean_all):
            print(f"deleted {ns}")
    if args.probe:
        print(" ".join(sorted(kernel_qdiscs())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
