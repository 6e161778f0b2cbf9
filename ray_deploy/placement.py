"""``specsplit up``: the draft and target services as Ray actors on nodes chosen by resources, then the
orchestrator on Ray wired to them.

Each service runs as the real ``serve-draft``/``serve-target`` process, started
by a small actor that Ray places where its resources are (``num_gpus=N`` for a
TP=N target, a custom ``{"draft": 1}`` resource for the draft's node, ...). The
process binds the node's IP and dies with its actor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lmkit.processes import start_service
from orchestrator import server
from ray_deploy import cluster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """The Ray resources one service's actor asks for; Ray places it on a node that has them all."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"draft": 1}

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0 or any(v <= 0 for v in self.resources.values()):
            raise ValueError(f"resource amounts must be >= 0 (custom ones > 0), got {self}")

    def actor_options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources)}

    def fits(self, node_resources: dict[str, float]) -> bool:
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return all(node_resources.get(name, 0.0) >= amount for name, amount in wanted.items() if amount > 0)


def parse_resources(text: str, flag: str) -> dict[str, float]:
    """``'{"draft": 1}'`` -> ``{"draft": 1.0}``; anything else is a ValueError naming ``flag``."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} must be a JSON object such as '{{\"draft\": 1}}': {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise ValueError(f"{flag} must map resource names to numbers, e.g. '{{\"draft\": 1}}'; got {text}")
    return {str(k): float(v) for k, v in value.items()}


def target_argv(args_text: str, num_gpus: int) -> list[str]:
    """``serve-target`` arguments; a target given N GPUs runs tensor-parallel over them (``--tp N``)."""
    argv = shlex.split(args_text)
    if num_gpus > 1 and "--tp" not in argv:
        argv += ["--tp", str(num_gpus)]
    return argv


def model_in(argv: list[str]) -> str:
    """The ``--model`` value in a service's arguments, '' if none."""
    for i, item in enumerate(argv[:-1]):
        if item == "--model":
            return argv[i + 1]
    return next((item.split("=", 1)[1] for item in argv if item.startswith("--model=")), "")


class ServiceHost:
    """A Ray actor that runs one service process on its node and reports where it serves."""

    def __init__(self, module: str, name: str, argv: list[str], timeout_s: float) -> None:
        import ray

        ip = cluster.node_ip()
        workdir = Path(tempfile.mkdtemp(prefix=f"specsplit-{name}-"))
        self.service = start_service(module, name, [*argv, "--host", ip], workdir, timeout_s, die_with_parent=True)
        self.address = f"{ip}:{self.service.port}"
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self) -> dict:
        return {"address": self.address, "node_id": self.node_id, "pid": self.service.process.pid}

    def stop(self) -> int:
        return self.service.stop()


def place(name: str, module: str, argv: list[str], placement: Placement, timeout_s: float):
    """Start ``module`` under a ServiceHost actor named ``name`` on a node that fits ``placement``."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if not any(placement.fits(resources) for resources in nodes):
        raise ValueError(
            f"no node of the Ray cluster offers what the {name} asks for ({placement.actor_options()}); start one "
            "with e.g. `ray start --address HEAD:6379 --resources '{\"draft\": 1}'` or change the flags"
        )
    return (
        ray.remote(ServiceHost)
        .options(name=name, max_restarts=0, **placement.actor_options())
        .remote(module, name, argv, timeout_s)
    )


def wait_serving(name: str, actor, timeout_s: float) -> dict:
    """The actor's ``info`` once its service serves; a ValueError saying why it did not."""
    import ray

    try:
        return ray.get(actor.info.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ValueError(f"the {name} did not start within {timeout_s:.0f} s") from None
    except ray.exceptions.RayActorError as exc:
        raise ValueError(f"the {name} failed to start: {exc}") from None


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    server.build_parser(parser)  # the orchestrator's flags; --target/--draft are filled in from the actors
    group = parser.add_argument_group("placement of the services (specsplit up)")
    for role, default_cpus in (("target", 1.0), ("draft", 1.0)):
        group.add_argument(f"--{role}-args", default="", help=f"arguments of `specsplit serve-{role}`, one string")
        group.add_argument(f"--{role}-num-cpus", type=float, default=default_cpus, help=f"Ray CPUs for the {role}")
        group.add_argument(f"--{role}-resources", default="{}",
                           help=f"custom Ray resources the {role}'s node must have, JSON, e.g. '{{\"{role}\": 1}}'")
    group.add_argument("--target-num-gpus", type=int, default=0, help="GPUs for the target; N > 1 runs it with --tp N")
    group.add_argument("--draft-num-gpus", type=float, default=0.0, help="GPUs for the draft (a fraction shares one)")
    group.add_argument("--no-draft", action="store_true", help="start no draft service (target-only decoding)")
    group.add_argument("--place-timeout-s", type=float, default=900.0, help="wait this long for each service to serve")
    return parser


def placements(args) -> dict[str, tuple[str, list[str], Placement]]:
    """What to start: role -> (module, argv, placement), from ``specsplit up`` flags."""
    wanted = {
        "target": ("target_service.server", target_argv(args.target_args, args.target_num_gpus),
                   Placement(args.target_num_cpus, args.target_num_gpus,
                             parse_resources(args.target_resources, "--target-resources"))),
    }
    if not args.no_draft:
        wanted["draft"] = ("draft_service.server", shlex.split(args.draft_args),
                           Placement(args.draft_num_cpus, args.draft_num_gpus,
                                     parse_resources(args.draft_resources, "--draft-resources")))
    return wanted


def run(args) -> int:
    from ray_deploy import front

    wanted = placements(args)
    target_model = model_in(wanted["target"][1])
    if target_model and args.tokenizer == server.build_parser().get_default("tokenizer"):
        args.tokenizer = target_model  # the orchestrator tokenizes with the target's own tokenizer
    started = cluster.connect(args.ray_address, args.ray_local_cpus)
    actors = []
    try:
        names = {role: f"{args.ray_app_name}-{role}" for role in wanted}
        for role, (module, argv, placement) in wanted.items():  # all start at once, then we wait for each
            actors.append(place(names[role], module, argv, placement, args.place_timeout_s))
        for role, actor in zip(wanted, actors):
            info = wait_serving(names[role], actor, args.place_timeout_s)
            log.info("%s serving at %s on node %s", role, info["address"], info["node_id"])
            setattr(args, role, info["address"])
        if args.no_draft:
            args.draft = ""
        asyncio.run(front.run_front(args))
    finally:
        _stop(actors)
        if started:
            import ray

            ray.shutdown()
    return 0


def _stop(actors) -> None:
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        ray.kill(actor)
