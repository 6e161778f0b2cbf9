"""Joining a Ray cluster (``--ray-address``, ``RAY_ADDRESS``) or starting a local one on loopback, and leaving it.

Ray is imported lazily, so plain ``specsplit serve`` never pays for it.

Signals: ``ray.init`` installs a SIGTERM handler that calls ``sys.exit`` wherever
the main thread happens to be, and a native one that prints "*** SIGTERM
received ***" lines; a SIGTERM during start-up then left actors, services and
the local cluster behind. ``connect`` replaces both with one that raises
``Stopped`` (a KeyboardInterrupt, so no ``except Exception`` swallows it), and
the commands stop in order from wherever they are, then exit 0.

A SIGTERM sent to the command's process group (``timeout``, systemd, a
supervisor's stop-as-group, ``kill -- -PGID``) would also reach every process of
a local cluster started here, which Ray starts in the command's own group: the
GCS died first, deleting the Serve application then waited its whole bound for
a controller that was gone, and Ray printed "Failed to connect to GCS" and
exited 1. So a local cluster's processes each lead a process group of their own
(``_own_process_groups``); they still die with the command (Ray's kernel
fate-sharing), and the command stops them in order.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

NAMESPACE = "specsplit"
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # only small messages (text, token ids) cross Ray here
SCHEDULE_TIMEOUT_S = 60.0


class Stopped(KeyboardInterrupt):
    """SIGTERM: stop in order (Ray may re-raise it as a plain KeyboardInterrupt: see ``stop_requested``)."""


_sigterm = threading.Event()


def stop_requested() -> bool:
    """True once SIGTERM arrived: a KeyboardInterrupt then is that normal stop, not Ctrl-C."""
    return _sigterm.is_set()


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray-address", default="",
        help="Ray cluster to join (e.g. 10.0.0.5:6379 or auto); default RAY_ADDRESS, else start a local cluster",
    )
    parser.add_argument("--ray-local-cpus", type=float, default=None,
                        help="CPUs a local cluster started here offers to Ray (default: all)")
    parser.add_argument("--ray-schedule-timeout-s", type=float, default=SCHEDULE_TIMEOUT_S,
                        help="fail when an actor or replica finds no free resources for this long")


def connect(address: str = "", local_cpus: float | None = None) -> bool:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local one; True when we started it.

    A local cluster binds 127.0.0.1 only and runs no dashboard. Call from the main thread: it
    installs the SIGTERM handler (see the module docstring).
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        _raise_on_sigterm()
        return False
    _loopback_only()
    with _own_process_groups():
        ray.init(  # "local": a new cluster, even where `ray start` left one (ray.init() would join that)
            address="local", num_cpus=local_cpus, include_dashboard=False, namespace=NAMESPACE,
            _node_ip_address="127.0.0.1",
            object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False,
        )
    _raise_on_sigterm()
    return True


def stopping() -> None:
    """From here on the command is stopping: a second SIGTERM does not cut the (bounded) teardown short."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def disconnect(started: bool) -> None:
    """Leave the cluster; a local one started here is shut down with every process it ran."""
    import ray

    stopping()
    began = time.monotonic()
    ray.shutdown()
    if started:
        log.info("local Ray cluster shut down in %.1f s", time.monotonic() - began)


def _loopback_only() -> None:
    """Make a local cluster bind 127.0.0.1. Ray 2.60 reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is
    imported, and otherwise turns ``_node_ip_address="127.0.0.1"`` into the host's external address."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # for the processes the cluster starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # for this one, which imported Ray already


@contextlib.contextmanager
def _own_process_groups():
    """While it lasts, each process Ray starts (GCS, raylet, its agents) leads a process group of its own,
    so a signal to the command's group reaches the command alone (see the module docstring). Ray 2.60
    starts them all through ``services.ConsolePopen``; the raylet's workers join the raylet's group."""
    from ray._private import services

    original = services.ConsolePopen

    class OwnGroupPopen(original):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


def _raise_on_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stopped)


def _stopped(signum, frame) -> None:
    _sigterm.set()
    log.info("SIGTERM received: stopping")
    raise Stopped()


def node_ip() -> str:
    """The address this node registered with the cluster (127.0.0.1 on a local one), where others reach it."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
