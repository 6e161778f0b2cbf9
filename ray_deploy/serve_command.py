"""``specsplit serve``: the orchestrator's public server, here, or with ``--ray`` as a Ray Serve application.

The flags are the orchestrator's (``specsplit.orchestrator.api.server``) and the
``--ray*`` ones (``options``); without ``--ray`` this is the plain server and
Ray is never imported. With it, ``front`` joins or starts a cluster, deploys
the orchestrator's replicas and serves our gRPC front over them.
"""

from __future__ import annotations

import argparse

from specsplit.lmkit import event_loop
from specsplit.orchestrator.api import server
from specsplit.ray_deploy import options


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = server.build_parser(parser)
    options.add_ray_flags(parser)
    return parser


def run(args) -> int:
    if not args.ray:
        return server.run(args)
    from specsplit.ray_deploy import front  # imports Ray

    event_loop.run(front.serve(args))
    return 0
