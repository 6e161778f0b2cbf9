"""``specsplit up``: the draft and target services as Ray actors on nodes chosen by resources, then the
orchestrator on Ray wired to them.

Each service runs as the real ``serve-draft``/``serve-target`` process, started
by a small actor that Ray places where its resources are (``num_gpus=N`` for a
TP=N target, a custom ``{"draft": 1}`` resource for the draft's node, ...). The
process binds the node's IP and dies with its actor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.lmkit import event_loop
from specsplit.lmkit.processes import start_service
from specsplit.orchestrator.api import server
from specsplit.ray_deploy import cluster, options, resources
from specsplit.ray_deploy.resources import Ask

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0  # a service drains its calls (its own --grace-s) and exits


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

    def ask(self, role: str) -> Ask:
        """What the ``role``'s actor asks of the cluster, and the flags that set it."""
        amounts = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return Ask(role, amounts, f"--{role}-num-cpus, --{role}-num-gpus, --{role}-resources")


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


def place(name: str, module: str, argv: list[str], placement: Placement, timeout_s: float, bundle: dict):
    """Start ``module`` under a ServiceHost actor named ``name`` in its reserved ``bundle`` (actor options)."""
    import ray

    return (
        ray.remote(ServiceHost)
        .options(name=name, max_restarts=0, **placement.actor_options(), **bundle)
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
    options.add_ray_flags(parser)
    group = parser.add_argument_group("placement of the services (specsplit up)")
    for role in ("target", "draft"):
        group.add_argument(f"--{role}-args", default="", help=f"arguments of `specsplit serve-{role}`, one string")
        group.add_argument(f"--{role}-num-cpus", type=float, default=None,
                           help=f"Ray CPUs for the {role} (default 1; on a local cluster started here, a share that fits)")
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
        "target": ("specsplit.target_service.server", target_argv(args.target_args, args.target_num_gpus),
                   Placement(args.target_num_cpus, args.target_num_gpus,
                             parse_resources(args.target_resources, "--target-resources"))),
    }
    if not args.no_draft:
        wanted["draft"] = ("specsplit.draft_service.server", shlex.split(args.draft_args),
                           Placement(args.draft_num_cpus, args.draft_num_gpus,
                                     parse_resources(args.draft_resources, "--draft-resources")))
    return wanted


def size_to_cluster(args, cap: resources.Capacity, local: bool) -> list[Ask]:
    """Fill in the CPU flags left at their default (``resources.size_cpus``) and refuse what can never run;
    returns the service actors' asks (the replicas' ask is checked with them)."""
    cpus = resources.size_cpus(
        {"target": (args.target_num_cpus, 1), "draft": (args.draft_num_cpus, 0 if args.no_draft else 1),
         "replica": (args.ray_num_cpus, args.ray_num_replicas)},
        cap.total().get("CPU", 0.0) if local else None,
    )
    if local:
        log.info("local cluster of %g CPUs: Ray CPUs target %g, draft %g, each of %d orchestrator replicas %g",
                 cap.total().get("CPU", 0.0), cpus["target"], 0 if args.no_draft else cpus["draft"],
                 args.ray_num_replicas, cpus["replica"])
    args.target_num_cpus, args.draft_num_cpus, args.ray_num_cpus = cpus["target"], cpus["draft"], cpus["replica"]
    services = [placement.ask(role) for role, (_, _, placement) in placements(args).items()]
    resources.require([*services, resources.replica_ask(args.ray_num_cpus, args.ray_num_replicas)], cap, local, "up")
    return services


def run(args) -> int:
    from specsplit.ray_deploy import front

    target_model = model_in(target_argv(args.target_args, args.target_num_gpus))
    if target_model and args.tokenizer == server.build_parser().get_default("tokenizer"):
        args.tokenizer = target_model  # the orchestrator tokenizes with the target's own tokenizer
    _check_flags(args)  # before a cluster is joined
    started = cluster.connect(args.ray_address, args.ray_local_cpus)
    actors, serving, group = [], [], None
    try:
        cap = resources.capacity()
        asks = size_to_cluster(args, cap, started)
        group = resources.reserve(asks, args.ray_schedule_timeout_s, cap, started)
        wanted = placements(args)
        names = {role: f"{args.ray_app_name}-{role}" for role in wanted}
        for role, (module, argv, placement) in wanted.items():  # all start at once, then we wait for each
            bundle = resources.in_bundle(group, asks, role)
            actors.append(place(names[role], module, argv, placement, args.place_timeout_s, bundle))
        for role, actor in zip(wanted, actors):
            info = wait_serving(names[role], actor, args.place_timeout_s)
            serving.append(actor)
            log.info("%s serving at %s on node %s", role, info["address"], info["node_id"])
            setattr(args, role, info["address"])
        if args.no_draft:
            args.draft = ""
        event_loop.run(front.run_front(args, local=started))
    except KeyboardInterrupt:
        if not cluster.stop_requested():
            raise
    finally:
        cluster.stopping()
        _stop(actors, serving, group)
        cluster.disconnect(started)
    return 0


def _check_flags(args) -> None:
    for role in ("target", "draft"):
        parse_resources(getattr(args, f"{role}_resources"), f"--{role}-resources")
    for flag in ("--target-num-cpus", "--draft-num-cpus", "--ray-num-cpus"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value:g}")


def _stop(actors, serving, group) -> None:
    """Stop every service that serves (each drains, then exits), then kill every actor (a service still
    loading dies with its actor) and free the resources they held."""
    import ray
    from ray.util.placement_group import remove_placement_group

    started = time.monotonic()
    stops = [actor.stop.remote() for actor in serving]
    with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
        ray.get(stops, timeout=STOP_TIMEOUT_S)
    for actor in actors:
        ray.kill(actor)
    if group is not None:
        remove_placement_group(group)
    if actors:
        log.info("services stopped in %.1f s", time.monotonic() - started)
