"""The plan of hosts built inside one machine, and the ``ip``/``tc`` commands that build and shape them: pure.

A host is a network namespace. Each host has one *home* address (a /32 on its
loopback), the address its services bind and others reach it at, whatever link
carries the traffic. Hosts are joined by veth links, each a /24 of its own:

- with a router host (a star), every host has one link, to the router, and one
  route: the plan's range via the router (which forwards); the router has a /32
  route to each host's home address over that host's link;
- without one (a mesh), every pair of hosts has a link, and each host a /32
  route to every other host's home address over their link.

Every address is in ``NETWORK``, a private (RFC 1918) range that exists only
inside the namespaces: no host has a default route, so nothing in a host can
reach anything but the plan's other hosts. Inside a host a link's end is
named ``to-PEER`` (namespaces keep their interface names apart).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

NETWORK = ipaddress.ip_network("10.213.0.0/16")  # home addresses 10.213.0.N, link L's subnet 10.213.L.0/24
NAMESPACE_PREFIX = "sshost-"  # namespaces are sshost-<owner pid>-<serial>-<host>: leftovers found by prefix
MAX_HOSTS = 250
_IFNAME_MAX = 15  # Linux's IFNAMSIZ less the NUL


@dataclass(frozen=True)
class Link:
    """A veth pair between hosts ``a`` and ``b``, with an address at each end (in the link's /24)."""

    a: str
    b: str
    a_address: str
    b_address: str

    def end(self, host: str) -> tuple[str, str, str]:
        """(this end's interface name inside ``host``, its address, the peer's address)."""
        if host == self.a:
            return f"to-{self.b}", self.a_address, self.b_address
        if host == self.b:
            return f"to-{self.a}", self.b_address, self.a_address
        raise ValueError(f"host {host!r} is not an end of the link {self.a}-{self.b}")


@dataclass(frozen=True)
class Route:
    destination: str  # CIDR
    via: str  # the next hop's link address
    device: str  # the interface inside the host
    source: str  # the host's home address, so replies come back to it


@dataclass(frozen=True)
class Plan:
    hosts: tuple[str, ...]  # every host, the router (if any) included
    router: str | None
    links: tuple[Link, ...]

    def home(self, host: str) -> str:
        """The host's own address: where its services listen and the others reach it."""
        return str(NETWORK[self.hosts.index(host) + 1])

    def link(self, a: str, b: str) -> Link:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise ValueError(f"no link joins {a!r} and {b!r}; links: {[f'{x.a}-{x.b}' for x in self.links]}")

    def link_of(self, host: str) -> Link:
        """A host's link to the router (a star's only kind of link)."""
        if self.router is None:
            raise ValueError("a plan without a router has a link per pair of hosts: name both ends")
        return self.link(host, self.router)

    def routes(self, host: str) -> list[Route]:
        """The routes ``host`` needs; none is a default route."""
        if host == self.router:
            return [
                self._route_to(link, host, f"{self.home(peer)}/32")
                for link in self.links
                for peer in (link.a, link.b)
                if peer != host and host in (link.a, link.b)
            ]
        if self.router is not None:
            return [self._route_to(self.link_of(host), host, str(NETWORK))]
        return [
            self._route_to(link, host, f"{self.home(link.b if link.a == host else link.a)}/32")
            for link in self.links
            if host in (link.a, link.b)
        ]

    def _route_to(self, link: Link, host: str, destination: str) -> Route:
        device, _, peer = link.end(host)
        return Route(destination, peer, device, self.home(host))


def plan(hosts: list[str], router: str | None = "router") -> Plan:
    """The plan for ``hosts`` (names of at most 12 characters), around ``router`` (None: a mesh)."""
    if not hosts:
        raise ValueError("a plan needs at least one host")
    names = [*hosts, router] if router is not None else list(hosts)
    _check_names(names)
    if router is not None:
        pairs = [(router, host) for host in hosts]
    else:
        pairs = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :]]
    # the first /24 holds the home addresses; links start at 10.213.1.0/24
    links = tuple(
        Link(a, b, str(subnet[1]), str(subnet[2]))
        for (a, b), subnet in zip(pairs, list(NETWORK.subnets(new_prefix=24))[1:])
    )
    return Plan(tuple(names), router, links)


def _check_names(names: list[str]) -> None:
    if len(names) > MAX_HOSTS:
        raise ValueError(f"at most {MAX_HOSTS} hosts, got {len(names)}")
    if len(set(names)) != len(names):
        raise ValueError(f"host names must differ, got {names}")
    for name in names:
        if not name or len(f"to-{name}") > _IFNAME_MAX or not all(c.isalnum() or c == "-" for c in name):
            raise ValueError(f"a host name is 1 to {_IFNAME_MAX - 3} letters, digits or '-', got {name!r}")


def namespace(owner_pid: int, host: str, serial: int = 0) -> str:
    """The namespace of ``host`` in the ``serial``-th set of hosts that process ``owner_pid`` built."""
    return f"{NAMESPACE_PREFIX}{owner_pid}-{serial}-{host}"


def owner_of(namespace_name: str) -> int | None:
    """The pid in a harness namespace's name; None for a namespace the harness did not make."""
    if not namespace_name.startswith(NAMESPACE_PREFIX):
        return None
    pid, serial, host = (namespace_name[len(NAMESPACE_PREFIX) :].split("-", 2) + ["", ""])[:3]
    return int(pid) if pid.isdigit() and serial.isdigit() and host else None


# -- commands ---------------------------------------------------------------------------------------------
def in_host(ns: str, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def build_commands(p: Plan, ns: dict[str, str]) -> list[list[str]]:
    """Every command that builds plan ``p`` (``ns``: host -> namespace), in order."""
    commands = [["ip", "netns", "add", ns[host]] for host in p.hosts]
    for host in p.hosts:
        commands += [
            ["ip", "-n", ns[host], "link", "set", "lo", "up"],
            ["ip", "-n", ns[host], "addr", "add", f"{p.home(host)}/32", "dev", "lo"],
        ]
    for link in p.links:
        a_dev, a_addr, _ = link.end(link.a)
        b_dev, b_addr, _ = link.end(link.b)
        commands.append(
            [
                "ip",
                "link",
                "add",
                a_dev,
                "netns",
                ns[link.a],
                "type",
                "veth",
                "peer",
                "name",
                b_dev,
                "netns",
                ns[link.b],
            ]
        )
        for host, dev, addr in ((link.a, a_dev, a_addr), (link.b, b_dev, b_addr)):
            commands += [
                ["ip", "-n", ns[host], "addr", "add", f"{addr}/24", "dev", dev],
                ["ip", "-n", ns[host], "link", "set", dev, "up"],
            ]
    if p.router is not None:
        commands.append(in_host(ns[p.router], ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]))
    for host in p.hosts:
        commands += [route_command(ns[host], route) for route in p.routes(host)]
    return commands


def route_command(ns: str, route: Route) -> list[str]:
    """Add (or restore: a link taken down loses its routes) one route."""
    return [
        "ip",
        "-n",
        ns,
        "route",
        "replace",
        route.destination,
        "via",
        route.via,
        "dev",
        route.device,
        "src",
        route.source,
    ]


def link_state_command(ns: str, device: str, up: bool) -> list[str]:
    return ["ip", "-n", ns, "link", "set", device, "up" if up else "down"]


def tbf_command(ns: str, device: str, rate_bps: float, latency_ms: float = 400.0) -> list[str]:
    """A token bucket on ``device``'s egress: at most ``rate_bps``, a burst of one MTU-sized frame or
    1 ms at the rate, whichever is larger; packets wait up to ``latency_ms`` in its queue."""
    if rate_bps <= 0:
        raise ValueError(f"a rate must be > 0 bit/s, got {rate_bps:g}")
    burst = max(1600, int(rate_bps / 8 / 1000))
    return _root_qdisc(ns, device, "tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", f"{latency_ms:g}ms")


def htb_commands(ns: str, device: str, rate_bps: float) -> list[list[str]]:
    """The same limit through htb: one class that every packet falls into."""
    if rate_bps <= 0:
        raise ValueError(f"a rate must be > 0 bit/s, got {rate_bps:g}")
    rate = f"{int(rate_bps)}bit"
    return [
        _root_qdisc(ns, device, "handle", "1:", "htb", "default", "1"),
        [
            "tc",
            "-n",
            ns,
            "class",
            "replace",
            "dev",
            device,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
        ],
    ]


def netem_command(ns: str, device: str, delay_ms: float, jitter_ms: float = 0.0) -> list[str]:
    """A one-way delay (and its jitter) on ``device``'s egress; needs a kernel with the netem qdisc."""
    if delay_ms < 0 or jitter_ms < 0:
        raise ValueError(f"delay and jitter must be >= 0 ms, got {delay_ms:g} and {jitter_ms:g}")
    return _root_qdisc(ns, device, "netem", "delay", f"{delay_ms:g}ms", f"{jitter_ms:g}ms")


def _root_qdisc(ns: str, device: str, *qdisc: str) -> list[str]:
    """``tc`` setting ``device``'s root qdisc in ``ns`` to ``qdisc`` (its kind and parameters)."""
    return ["tc", "-n", ns, "qdisc", "replace", "dev", device, "root", *qdisc]


def unshape_command(ns: str, device: str) -> list[str]:
    return ["tc", "-n", ns, "qdisc", "del", "dev", device, "root"]
