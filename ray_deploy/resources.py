"""What a command asks of the Ray cluster, checked against what the cluster has and has free.

Ray queues an actor that asks for more than is free and waits for it forever; to a user that is a
hang. So ``up``, ``serve --ray`` and ``batch`` list what they ask for (``Ask``), size the defaults to
a local cluster they start (``size_cpus``), refuse at once what the cluster can never hold
(``never_fits``), and wait a bounded time for what it holds but has not free (``reserve``). Every
refusal names the request, the cluster's total and free resources, and the flags that change them.

Ray is imported only by ``capacity`` and ``reserve``; the rest is plain arithmetic on dicts of
resource amounts (``{"CPU": 1.0, "GPU": 2.0, "draft": 1.0}``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Resources every node advertises that nobody here asks for; left out of messages.
_HIDDEN_PREFIXES = ("node:", "memory", "object_store_memory", "accelerator_type:", "bundle_group")
_EPS = 1e-9
RESERVE_POLL_S = 1.0  # how often a wait for resources looks whether it was cancelled


@dataclass(frozen=True)
class Ask:
    """``count`` Ray actors of one kind, each asking for ``amounts`` (resource name -> amount)."""

    what: str  # "target", "orchestrator replica", ...
    amounts: dict[str, float]
    flags: str  # the flags that set it, for the message
    count: int = 1

    def bundle(self) -> dict[str, float]:
        """One actor's non-zero amounts: what Ray has to find on one node."""
        return {name: amount for name, amount in self.amounts.items() if amount > 0}

    def total(self) -> dict[str, float]:
        return {name: amount * self.count for name, amount in self.bundle().items()}


@dataclass(frozen=True)
class Capacity:
    """The cluster's resources: each alive node's totals, and what is free now (the whole cluster)."""

    nodes: tuple[dict[str, float], ...]
    free: dict[str, float]

    def total(self) -> dict[str, float]:
        return _sum(self.nodes)


def replica_ask(num_cpus: float, num_replicas: int) -> Ask:
    """What the orchestrator replicas of ``serve --ray`` and ``up`` ask for."""
    return Ask("orchestrator replica", {"CPU": num_cpus}, "--ray-num-cpus, --ray-num-replicas", num_replicas)


def capacity() -> Capacity:
    """What the connected cluster has (``ray.nodes``) and has free (``ray.available_resources``)."""
    import ray

    nodes = tuple(dict(node["Resources"]) for node in ray.nodes() if node["Alive"])
    return Capacity(nodes, dict(ray.available_resources()))


def size_cpus(wanted: dict[str, tuple[float | None, int]], local_cpus: float | None) -> dict[str, float]:
    """CPUs per actor for each kind in ``wanted`` (kind -> (CPUs asked, None for the default; count)).

    The default is 1 CPU on a cluster given by address (``local_cpus`` None). On a local cluster of
    ``local_cpus`` started by the command, the defaults share what the explicit requests leave, at
    most 1 each, so that everything fits: 2 CPUs for a target, a draft and one replica give each
    0.66. Rounded down to 0.01 (Ray's CPU unit is 0.0001).
    """
    explicit = sum(cpus * count for cpus, count in wanted.values() if cpus is not None)
    defaulted = sum(count for cpus, count in wanted.values() if cpus is None)
    share = 1.0
    if local_cpus is not None and defaulted:
        share = min(1.0, math.floor(max(0.0, local_cpus - explicit) / defaulted * 100) / 100)
    return {kind: share if cpus is None else cpus for kind, (cpus, _) in wanted.items()}


def never_fits(asks: list[Ask], cap: Capacity) -> str:
    """Why ``asks`` can never all be scheduled on ``cap``'s nodes, '' when they might (nothing else running).

    Two checks that are certain: an actor that asks for more than any one node has, and asks that
    together want more of a resource than all nodes have. What passes may still wait for resources
    that others hold, or that are split across nodes: ``reserve`` bounds that wait.
    """
    for ask in asks:
        if ask.count and not any(_covers(node, ask.bundle()) for node in cap.nodes):
            return f"the {ask.what} asks for {_fmt(ask.bundle())}, more than any node of the cluster has"
    wanted, total = _sum([ask.total() for ask in asks]), cap.total()
    short = {name: amount for name, amount in wanted.items() if amount > total.get(name, 0.0) + _EPS}
    if short:
        return f"together they ask for {_fmt(short)}; the whole cluster has {_fmt(_pick(total, short))}"
    return ""


def require(asks: list[Ask], cap: Capacity, local: bool, command: str) -> None:
    """Refuse (ValueError) what ``cap`` can never hold; log what it holds but has not free now."""
    reason = never_fits(asks, cap)
    if reason:
        raise ValueError(refusal(f"the Ray cluster cannot run what `specsplit {command}` asks for: {reason}",
                                 asks, cap, local))
    wanted = _sum([ask.total() for ask in asks])
    if not _covers(cap.free, wanted):
        log.warning("%s", refusal("not all of this is free now; waiting for it up to --ray-schedule-timeout-s",
                                  asks, cap, local))


def refusal(headline: str, asks: list[Ask], cap: Capacity, local: bool) -> str:
    """The message of a refusal: what was asked (and by which flags), what the cluster has and has free."""
    shown = sorted({name for ask in asks for name in ask.bundle()} | {"CPU"})
    width = max(len(_label(ask)) for ask in asks) if asks else 0
    lines = [headline]
    lines += [f"  {_label(ask):<{width}}  {_fmt(_with_cpu(ask.bundle()))}  ({ask.flags})" for ask in asks]
    lines.append(f"  {'in all':<{width}}  {_fmt(_with_cpu(_sum([ask.total() for ask in asks])))}")
    lines.append(f"the Ray cluster has {_fmt(_pick(cap.total(), shown))} in all over {len(cap.nodes)} node(s) "
                 f"(largest: {_fmt(_pick(_largest(cap.nodes), shown))}), {_fmt(_pick(cap.free, shown))} free now")
    fix = "lower the flags above (fractions of a CPU or GPU are fine)"
    fix += ", or give the local cluster more with --ray-local-cpus" if local else ", or add nodes that have them"
    lines.append(fix)
    return "\n".join(lines)


def reserve(asks: list[Ask], timeout_s: float, cap: Capacity, local: bool, cancelled=None, strategy: str = "PACK"):
    """A placement group with one bundle per actor of ``asks``, once Ray has placed it; None if none asks
    anything, or when ``cancelled`` (a threading.Event) is set while it waits.

    Bundles are packed where they fit (strategy PACK, soft), or spread over the nodes (SPREAD, soft: a lost
    node then takes as few of them as it can). Ray reserves them all or none; after
    ``timeout_s`` the group is removed and a ValueError says what could not be found free.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [ask.bundle() for ask in asks for _ in range(ask.count) if ask.bundle()]
    if not bundles:
        return None
    group = placement_group(bundles, strategy=strategy)
    ready, deadline = group.ready(), time.monotonic() + timeout_s
    while not ray.wait([ready], timeout=min(RESERVE_POLL_S, max(0.0, deadline - time.monotonic())))[0]:
        if (cancelled is not None and cancelled.is_set()) or time.monotonic() >= deadline:
            break
    else:
        return group
    remove_placement_group(group)
    if cancelled is not None and cancelled.is_set():
        return None
    raise ValueError(refusal(
        f"Ray could not schedule these within {timeout_s:.0f} s (--ray-schedule-timeout-s): "
        "what they ask for is not free",
        asks, capacity() if ray.is_initialized() else cap, local,
    ))


def in_bundle(group, asks: list[Ask], what: str, nth: int = 0) -> dict:
    """Actor options that run the ``nth`` actor of the ask named ``what`` in its bundle of ``reserve``'s group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    index = 0
    for ask in asks:
        if ask.what == what:
            if group is None or not ask.bundle():
                return {}  # it asks for nothing: Ray runs it anywhere at once
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, index + nth)}
        index += ask.count if ask.bundle() else 0
    raise KeyError(what)


def _covers(have: dict[str, float], want: dict[str, float]) -> bool:
    return all(have.get(name, 0.0) + _EPS >= amount for name, amount in want.items())


def _sum(dicts) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for name, amount in d.items():
            out[name] = out.get(name, 0.0) + amount
    return out


def _largest(nodes) -> dict[str, float]:
    return max(nodes, key=lambda node: (node.get("GPU", 0.0), node.get("CPU", 0.0)), default={})


def _pick(resources: dict[str, float], names) -> dict[str, float]:
    return {name: resources.get(name, 0.0) for name in names}


def _with_cpu(resources: dict[str, float]) -> dict[str, float]:
    return {"CPU": 0.0, **resources}


def _label(ask: Ask) -> str:
    return ask.what if ask.count == 1 else f"{ask.count} x {ask.what}"


def _fmt(resources: dict[str, float]) -> str:
    """``{"CPU": 0.5, "GPU": 2.0}`` -> ``"CPU 0.5, GPU 2"``; Ray's own bookkeeping names left out."""
    shown = {n: a for n, a in resources.items() if not n.startswith(_HIDDEN_PREFIXES)}
    return ", ".join(f"{name} {amount:g}" for name, amount in sorted(shown.items(), key=lambda kv: _order(kv[0])))


def _order(name: str) -> tuple[int, str]:
    return ({"CPU": 0, "GPU": 1}.get(name, 2), name)
