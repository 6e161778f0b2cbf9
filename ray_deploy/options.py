"""Options of the orchestrator on Ray: the ``--ray*`` flags of ``specsplit serve`` and ``build_app``'s Ray keys.

No Ray import here: ``specsplit serve`` without ``--ray`` never loads Ray.
"""

from __future__ import annotations

import argparse
from typing import Any

from specsplit.orchestrator.api import server
from specsplit.ray_deploy import cluster

# Ray-side keys of ``build_app``'s args (``--ray-<key>`` on the command line);
# every other key is a ``specsplit serve`` flag.
RAY_DEFAULTS: dict[str, Any] = {
    "num_replicas": 1,
    "max_ongoing_requests": 8,  # generations one replica runs at once
    "max_queued_requests": 16,  # requests waiting for a replica (per caller); beyond: RESOURCE_EXHAUSTED
    "num_cpus": 1.0,  # Ray CPUs reserved per replica
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
}
_HELP = {
    "num_replicas": "orchestrator replicas",
    "max_ongoing_requests": "generations one replica runs at once",
    "max_queued_requests": "requests waiting for a replica; beyond it RESOURCE_EXHAUSTED",
    "num_cpus": "Ray CPUs reserved per replica (default 1; on a local cluster started here, a share that fits)",
    "health_check_period_s": "seconds between health checks of each replica",
    "health_check_timeout_s": "a replica whose health check takes longer fails it",
}
# Ray keys whose flag defaults to None: sized to the cluster once joined (``resources.size_cpus``).
SIZED_TO_CLUSTER = frozenset({"num_cpus"})
# ``specsplit serve`` flags that configure the public front, not the orchestrator replicas.
FRONT_ONLY = frozenset({
    "host", "port", "port_file", "reflection", "metrics_port", "grace_s", "log_level", "http_port",
    "tls_cert", "tls_key", "tls_ca", "auth_token_file", "handler", "command", "help",
})


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", action="store_true",
                        help="run the orchestrator as a Ray Serve application behind this server")
    cluster.add_cluster_flags(parser)
    parser.add_argument("--ray-app-name", default="specsplit", help="Serve application name")
    for key, default in RAY_DEFAULTS.items():
        parser.add_argument(f"--ray-{key.replace('_', '-')}", type=type(default),
                            default=None if key in SIZED_TO_CLUSTER else default, help=_HELP[key])


def changed_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, exclude=FRONT_ONLY) -> dict[str, Any]:
    """Flags that differ from their defaults, keyed by flag name with underscores (not dest), so
    ``flags_to_argv`` turns them back into the same command line; ``--ray*`` flags are left out."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        dest = action.dest
        if dest in exclude or dest.startswith("ray") or not action.option_strings or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value != action.default:
            key = action.option_strings[-1].lstrip("-").replace("-", "_")
            out[key] = True if action.nargs == 0 else value  # a switch is on when it differs from its default
    return out


def app_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``build_app`` args from parsed ``specsplit serve --ray`` flags: the orchestrator flags that were
    set (so flags added later flow through) plus every Ray key."""
    out = changed_flags(args, parser)
    out.update({key: getattr(args, f"ray_{key}") for key in RAY_DEFAULTS})
    for key in SIZED_TO_CLUSTER:
        if out[key] is None:
            out[key] = RAY_DEFAULTS[key]
    return out


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """``{"max_new_tokens": 32, "fixed_k": True}`` -> ``["--max-new-tokens", "32", "--fixed-k"]``."""
    argv: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    """Parse the orchestrator's ``specsplit serve`` flags; a bad one is a ValueError naming it (not a SystemExit)."""
    parser = server.build_parser()
    try:
        ns, unknown = parser.parse_known_args(argv)
    except SystemExit:
        raise ValueError(f"invalid orchestrator flags {argv}; see `specsplit serve --help`") from None
    if unknown:
        raise ValueError(f"unknown orchestrator flags {unknown}; see `specsplit serve --help`")
    return ns
