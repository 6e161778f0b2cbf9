"""Joining a Ray cluster (``--ray-address``, ``RAY_ADDRESS``) or starting a local one on loopback.

Ray is imported lazily, so plain ``specsplit serve`` never pays for it.
"""

from __future__ import annotations

import argparse
import os

NAMESPACE = "specsplit"
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # only small messages (text, token ids) cross Ray here


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray-address", default="",
        help="Ray cluster to join (e.g. 10.0.0.5:6379 or auto); default RAY_ADDRESS, else start a local cluster",
    )
    parser.add_argument("--ray-local-cpus", type=float, default=None,
                        help="CPUs a local cluster started here offers to Ray (default: all)")


def connect(address: str = "", local_cpus: float | None = None) -> bool:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local one; True when we started it.

    A local cluster binds 127.0.0.1 only and runs no dashboard.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray 2.60: else it binds the external address
    ray.init(
        num_cpus=local_cpus, include_dashboard=False, namespace=NAMESPACE, _node_ip_address="127.0.0.1",
        object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False,
    )
    return True


def node_ip() -> str:
    """The address this node registered with the cluster (127.0.0.1 on a local one), where others reach it."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
