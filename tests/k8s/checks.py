"""The invariants of k8s/ as functions over rendered manifests (lists of dicts).

Each ``check_*`` raises AssertionError naming the object and what to fix;
tests/k8s/test_manifests.py runs them on every overlay and, as negative
controls, on deliberately broken copies.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod")
SERVICE_NAMES = {  # grpc.health.v1 service each specsplit subcommand reports
    "serve-draft": "specsplit.v1.DraftService",
    "serve-target": "specsplit.v1.TargetService",
    "serve": "specsplit.v1.Generator",
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
RANK_SUPERVISOR_MARGIN_S = 15  # target_service.ranks kills stragglers after --grace-s + 15 s
SERVE_REPLICA_DRAIN_S = 20  # Ray Serve's default graceful_shutdown_timeout_s (build_app keeps it)
ORCHESTRATOR = "orchestrator"


def tool(name: str) -> str:
    """An executable from the manifest tool venv (SPECSPLIT_K8S_TOOLS overrides its bin folder)."""
    path = Path(os.environ.get("SPECSPLIT_K8S_TOOLS", REPO / ".venv-k8s" / "bin")) / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make k8s-tools` (make test does) to install k8s/requirements-tools.txt")
    return str(path)


@dataclass(frozen=True)
class PodSpec:
    """One pod template: a workload's, or a RayService head/worker group's."""

    owner: str  # e.g. "StatefulSet/specsplit-target" or "RayService/x/workerGroup[0]"
    labels: dict
    spec: dict

    @property
    def component(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")


def pod_specs(docs: list[dict]) -> list[PodSpec]:
    out = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Pod":
            out.append(PodSpec(f"Pod/{name}", doc["metadata"].get("labels", {}), doc["spec"]))
        elif kind in WORKLOADS:
            template = doc["spec"]["template"]
            out.append(PodSpec(f"{kind}/{name}", template["metadata"].get("labels", {}), template["spec"]))
        elif kind == "RayService":
            for owner, template in ray_templates(doc):
                out.append(PodSpec(owner, template.get("metadata", {}).get("labels", {}), template["spec"]))
    return out


def ray_templates(ray_service: dict) -> list[tuple[str, dict]]:
    name = ray_service["metadata"]["name"]
    cluster = ray_service["spec"]["rayClusterConfig"]
    groups = [(f"RayService/{name}/head", cluster["headGroupSpec"]["template"])]
    for i, group in enumerate(cluster.get("workerGroupSpecs", [])):
        groups.append((f"RayService/{name}/workerGroup[{i}]", group["template"]))
    return groups


def ray_templates_as_pods(docs: list[dict]) -> list[dict]:
    """RayService pod templates as Pods, so schema validators and checkov see what KubeRay will run."""
    pods = []
    for doc in docs:
        if doc["kind"] != "RayService":
            continue
        for owner, template in ray_templates(doc):
            metadata = dict(template.get("metadata", {}))
            metadata["name"] = owner.split("/", 1)[1].replace("/", "-").replace("[", "-").replace("]", "").lower()
            metadata["namespace"] = doc["metadata"].get("namespace", "default")
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
    return pods


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


# ---- flags ---------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env values."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref, f"container {container['name']}: only configMapRef envFrom is expected, got {source}"
        env.update(find(docs, "ConfigMap", ref["name"]).get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
    return env


def resolved_args(container: dict, docs: list[dict]) -> list[str]:
    """args with every $(NAME) expanded as the kubelet does; an unknown name is an error, not a literal."""
    env = container_env(container, docs)

    def expand(arg: str) -> str:
        def one(match):
            assert match.group(1) in env, (
                f"container {container['name']}: {match.group(0)} is not in its environment; "
                f"add {match.group(1)} to the overlay's flags.env"
            )
            return env[match.group(1)]

        return _VAR.sub(one, arg)

    return [expand(a) for a in container.get("args", [])]


def flag(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of --name in args (``--name=v`` or ``--name v``)."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return default


def specsplit_containers(docs: list[dict]):
    """(pod, container, resolved args) for every container running a `specsplit serve*` command."""
    for pod in pod_specs(docs):
        for container in pod.spec["containers"]:
            args = resolved_args(container, docs)
            if args and args[0] in SERVICE_NAMES:
                yield pod, container, args


def ray_serve_config(docs: list[dict]) -> dict:
    """The RayService's Serve config (serveConfigV2, parsed)."""
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def ray_app_args(docs: list[dict]) -> dict:
    """The orchestrator's settings in a RayService: its one application's args."""
    (app,) = ray_serve_config(docs)["applications"]
    return app["args"]


# ---- containers ----------------------------------------------------------------------------------


def check_containers_hardened(docs: list[dict]) -> None:
    """Probes, limits and a restricted securityContext on every container of every pod."""
    pods = pod_specs(docs)
    assert pods, "no pod templates rendered"
    for pod in pods:
        spec = pod.spec
        assert spec.get("automountServiceAccountToken") is False, f"{pod.owner}: set automountServiceAccountToken: false"
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, f"{pod.owner}: pod securityContext needs runAsNonRoot: true"
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{pod.owner}: pod seccomp RuntimeDefault"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{pod.owner} container {container['name']}"
            for probe in PROBES:
                assert probe in container, f"{where}: missing {probe}"
            limits = container.get("resources", {}).get("limits", {})
            requests = container.get("resources", {}).get("requests", {})
            for resource in ("cpu", "memory", "ephemeral-storage"):
                assert resource in limits and resource in requests, f"{where}: set requests and limits for {resource}"
            sc = container.get("securityContext", {})
            assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot: true"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem: true"
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation: false"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities.drop: [ALL]"
            assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp RuntimeDefault"
            # A read-only root needs writable emptyDirs wherever the image writes (HOME=/tmp, caches in /cache).
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            for path in ("/tmp", "/cache"):
                assert path in mounts and "emptyDir" in volumes.get(mounts[path], {}), f"{where}: mount an emptyDir at {path}"


def check_probes_use_health(docs: list[dict]) -> None:
    """specsplit services are probed natively over grpc.health.v1; Ray pods over Ray's own HTTP health."""
    for pod, container, args in specsplit_containers(docs):
        ports = {p["containerPort"] for p in container["ports"]}
        for probe in PROBES:
            grpc = container[probe].get("grpc")
            assert grpc, f"{pod.owner}: {probe} must be a native gRPC probe (grpc.health.v1)"
            assert grpc["port"] in ports, f"{pod.owner}: {probe} probes port {grpc['port']}, which the container does not expose"
            assert grpc.get("service", SERVICE_NAMES[args[0]]) == SERVICE_NAMES[args[0]], f"{pod.owner}: {probe} service"
        startup = container["startupProbe"]
        assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 300, (
            f"{pod.owner}: the startup probe must allow a long model load (>= 5 minutes)"
        )
    for pod in pod_specs(docs):
        if pod.owner.startswith("RayService/"):
            for container in pod.spec["containers"]:
                for probe in PROBES:
                    assert "httpGet" in container[probe], f"{pod.owner}: {probe} should use Ray's HTTP health endpoints"


def check_grace_covers_drain(docs: list[dict]) -> None:
    """terminationGracePeriodSeconds >= preStop sleep + --grace-s (+ the rank supervisor's margin for TP)."""
    for pod in pod_specs(docs):
        period = pod.spec.get("terminationGracePeriodSeconds", 30)
        for container in pod.spec["containers"]:
            args = resolved_args(container, docs)
            if args and args[0] in SERVICE_NAMES:
                grace = float(flag(args, "--grace-s", "10"))
                if args[0] == "serve-target" and int(flag(args, "--tp", "1")) > 1:
                    grace += RANK_SUPERVISOR_MARGIN_S
            elif pod.owner.startswith("RayService/"):
                grace = SERVE_REPLICA_DRAIN_S
            else:
                raise AssertionError(f"{pod.owner}: unknown container {container['name']}")
            sleep = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds")
            assert sleep, f"{pod.owner}: add a preStop sleep so endpoints drop the pod before SIGTERM"
            assert period >= sleep + grace, (
                f"{pod.owner}: terminationGracePeriodSeconds {period} < preStop {sleep} s + drain {grace:g} s"
            )
            live = container["livenessProbe"]
            assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) > grace, (
                f"{pod.owner}: liveness would fail during the {grace:g} s drain (NOT_SERVING); raise its failureThreshold"
            )


def check_gpus_match_tp(docs: list[dict]) -> None:
    """The target's nvidia.com/gpu equals --tp on CUDA and is absent on CPU; a CUDA draft gets one GPU."""
    seen = set()
    for pod, container, args in specsplit_containers(docs):
        resources = container["resources"]
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        device = flag(args, "--device", "cpu")
        seen.add(args[0])
        if args[0] == "serve-target":
            tp = int(flag(args, "--tp", "1"))
            expected = tp if device.startswith("cuda") else None
        elif args[0] == "serve-draft":
            expected = 1 if device.startswith("cuda") else None
        else:
            expected = None  # the orchestrator holds no model
        assert (None if gpus is None else int(gpus)) == expected, (
            f"{pod.owner}: nvidia.com/gpu limit {gpus} but {args[0]} runs --device {device}"
            + (f" --tp {flag(args, '--tp', '1')}" if args[0] == "serve-target" else "")
        )
        if gpus is not None:
            assert resources["requests"].get("nvidia.com/gpu") == gpus, f"{pod.owner}: GPU request must equal its limit"
            assert pod.spec.get("affinity", {}).get("nodeAffinity"), f"{pod.owner}: GPU pods need node affinity on GPU labels"
        else:
            assert "nodeAffinity" not in pod.spec.get("affinity", {}), f"{pod.owner}: CPU pods need no GPU node affinity"
    assert {"serve-draft", "serve-target"} <= seen, "draft and target must both be rendered"


# ---- services and load balancing ----------------------------------------------------------------


def check_headless_round_robin(docs: list[dict]) -> None:
    """The orchestrator dials draft and target as dns:///<headless service>:<port>."""
    addresses = []
    for _, _, args in specsplit_containers(docs):
        if args[0] == "serve":
            addresses += [flag(args, "--target"), flag(args, "--draft")]
    if any(d["kind"] == "RayService" for d in docs):
        app = ray_app_args(docs)
        addresses += [app["target"], app["draft"]]
    assert addresses, "no orchestrator rendered"
    for address in addresses:
        match = re.fullmatch(r"dns:///([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", address)
        assert match, f"{address}: use dns:///NAME:PORT so the client's round_robin sees every pod"
        service = find(docs, "Service", match.group(1))
        assert service["spec"].get("clusterIP") == "None", f"Service/{match.group(1)}: make it headless (clusterIP: None)"
        assert int(match.group(2)) in {p["port"] for p in service["spec"]["ports"]}, f"{address}: port not on the Service"


# ---- network policies -----------------------------------------------------------------------------


def selector_matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _covers(rule_ports: list[dict], port: int, named: dict[str, int]) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if "port" not in p:
            return True
        number = named.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if number is not None and number <= port <= p.get("endPort", number):
            return True
    return False


def _admits_only_orchestrator(peer: dict, orchestrators: list[PodSpec], others: list[PodSpec]) -> bool:
    selector = peer.get("podSelector")
    if selector is None or "namespaceSelector" in peer or "ipBlock" in peer:
        return False
    # Pinned to the orchestrator label, so no pod without it (now or later) is admitted.
    if selector.get("matchLabels", {}).get("app.kubernetes.io/component") != ORCHESTRATOR:
        return False
    return all(selector_matches(selector, o.labels) for o in orchestrators) and not any(
        selector_matches(selector, o.labels) for o in others
    )


def check_network_policies(docs: list[dict]) -> None:
    """Draft and target ports admit orchestrator pods and nothing else (metrics aside)."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = pod_specs(docs)
    orchestrators = [p for p in pods if p.component == ORCHESTRATOR]
    assert orchestrators, "no orchestrator pods rendered"
    for pod in pods:
        if pod.component not in ("draft", "target"):
            continue
        selecting = [
            p for p in policies
            if selector_matches(p["spec"]["podSelector"], pod.labels) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        ]
        assert selecting, f"{pod.owner}: no NetworkPolicy isolates it; every source could connect"
        named = {p["name"]: p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", []) if "name" in p}
        others = [p for p in pods if p.component != ORCHESTRATOR]
        for name, port in named.items():
            admitted_orchestrator = False
            for policy in selecting:
                for rule in policy["spec"].get("ingress", []):
                    if not _covers(rule.get("ports", []), port, named):
                        continue
                    peers = rule.get("from", [])
                    if name == "metrics":
                        continue  # scraped from the monitoring namespace
                    assert peers and all(_admits_only_orchestrator(peer, orchestrators, others) for peer in peers), (
                        f"NetworkPolicy/{policy['metadata']['name']} admits more than the orchestrator to "
                        f"{pod.owner} port {name} ({port}): {peers or 'every source'}"
                    )
                    admitted_orchestrator = True
            if name == "grpc":
                assert admitted_orchestrator, f"{pod.owner}: no NetworkPolicy admits the orchestrator to port {port}"


# ---- authentication ------------------------------------------------------------------------------


def _secret_mounts(pod: PodSpec, container: dict) -> list[str]:
    """The paths at which ``container`` mounts a Secret volume of its pod."""
    secrets = {v["name"] for v in pod.spec.get("volumes", []) if "secret" in v}
    return [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in secrets]


def _in_secret(path: str | None, mounts: list[str]) -> bool:
    return bool(path) and any(path.startswith(mount.rstrip("/") + "/") for mount in mounts)


def check_services_authenticate(docs: list[dict]) -> None:
    """Nothing is served unauthenticated but health: draft and target require a token (from a Secret) and, with
    mTLS, an allowed client name; the orchestrator sends its token and guards its public API with one."""
    seen = set()
    for pod, container, args in specsplit_containers(docs):
        command, mounts = args[0], _secret_mounts(pod, container)
        seen.add(command)
        required = ["--auth-token-file"] + (["--peer-token-file"] if command == "serve" else [])
        for name in required:
            assert _in_secret(flag(args, name), mounts), (
                f"{pod.owner}: {command} {name} is {flag(args, name)!r}, not a file of a mounted Secret; "
                "every port but health must require a token"
            )
        if command != "serve" and flag(args, "--tls-ca"):
            assert flag(args, "--tls-allowed-sans"), (
                f"{pod.owner}: mTLS without --tls-allowed-sans admits any certificate of the CA"
            )
    if any(d["kind"] == "RayService" for d in docs):
        app, http = ray_app_args(docs), ray_serve_config(docs)["http_options"]
        # the public token crosses the pod network: Serve's HTTP proxy serves HTTPS with a key from a Secret
        files = {key: app.get(key) for key in ("auth_token_file", "peer_token_file")}
        files |= {f"http_options {key}": http.get(key) for key in ("ssl_certfile", "ssl_keyfile")}
        for key, path in files.items():
            for pod in pod_specs(docs):
                if pod.owner.startswith("RayService/"):
                    (container,) = pod.spec["containers"]
                    assert _in_secret(path, _secret_mounts(pod, container)), (
                        f"{pod.owner}: the Serve app's {key} {path!r} is not a file of a mounted Secret"
                    )
        seen.add("serve")
    assert {"serve-draft", "serve-target", "serve"} <= seen, f"expected draft, target and orchestrator, saw {seen}"


# ---- monitoring ------------------------------------------------------------------------------------


def check_pod_monitor(docs: list[dict]) -> None:
    """The PodMonitor selects every specsplit pod with a metrics port, and only ports those pods name."""
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    selector = monitor["spec"]["selector"]
    pods = [pod for pod in pod_specs(docs) if selector_matches(selector, pod.labels)]
    named = {p["name"] for pod in pods for c in pod.spec["containers"] for p in c.get("ports", []) if "name" in p}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in named, f"PodMonitor/{monitor['metadata']['name']}: no selected pod names a port " \
                                          f"{endpoint['port']!r}"
    scraped = {endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]}
    for pod in pod_specs(docs):
        ports = {p["name"] for c in pod.spec["containers"] for p in c.get("ports", []) if "name" in p}
        if "metrics" in ports:
            assert selector_matches(selector, pod.labels) and "metrics" in scraped, f"{pod.owner}: its metrics go unscraped"


def exported_metric_names() -> set[str]:
    """Every series name specsplit exports: orchestrator metrics (with a counter's _total, a histogram's
    _bucket/_sum/_count) and the services' collector metrics."""
    from specsplit.orchestrator.api import metrics

    names = {"specsplit_ready", "specsplit_compute_queue", "specsplit_active_sessions", "specsplit_sessions_opened_total",
             "specsplit_rounds_total"}  # lmkit.metrics.ServiceCollector
    for metric in vars(metrics).values():
        if isinstance(metric, metrics.Metric):
            suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[metric.kind]
            names.update(metric.name + suffix for suffix in suffixes)
    return names
