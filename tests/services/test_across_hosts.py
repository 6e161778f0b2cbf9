"""Draft, target and orchestrator on hosts of their own (``specsplit.bench.hosts``: namespaces, needs root).

The client runs on a fourth host; every byte between them crosses veth links and the router host, and
the orchestrator reaches draft and target over mTLS (certificates for their home addresses). Greedy
output is the target's own; a link taken down mid-generation and brought back, or throttled
to a trickle by ``tbf``, loses and duplicates nothing: the output is still exactly the target's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from specsplit.bench import hosts
from specsplit.bench.netem import Shape
from specsplit.lmkit import models
from specsplit.lmkit.processes import ServiceProcess
from tests.conftest import TINY_PROMPTS, reference_greedy
from tests.services.test_security import write_pki

WHY_NOT = hosts.unavailable()
pytestmark = [pytest.mark.services, pytest.mark.skipif(WHY_NOT is not None, reason=f"no hosts here: {WHY_NOT}")]

REPO = Path(__file__).resolve().parents[2]
LONG_PROMPT = "Once upon a time"
LONG_TOKENS = 200
PARTITION_S = 3.0  # well inside the orchestrator's --target-deadline-s (30 s)
TRICKLE_BPS = 64_000  # 8 kB/s each way
RELAY_SHAPE = Shape.from_ms(1.0, jitter_ms=0.3)
STALL_S = 2.0


@dataclass
class Across:
    hosts: hosts.Hosts
    orch: str  # the orchestrator's HOST:PORT
    target: ServiceProcess
    draft: ServiceProcess
    orch_args: list[str]  # its flags but --target/--draft
    work: Path
    server_tls: list[str]  # the services' mTLS flags


@pytest.fixture(scope="module")
def net(tiny_target_dir, tiny_draft_dir, tmp_path_factory):
    """Target, draft and orchestrator each on its own host, the orchestrator reaching the services over mTLS
    (certificates for their home addresses and the router's, where relays listen)."""
    work = tmp_path_factory.mktemp("hosts")
    with hosts.Hosts(["client", "orch", "draft", "target"]) as built:
        pki = write_pki(work, tuple(built.address(h) for h in ("draft", "target", "router")))
        mtls = ["--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], "--tls-ca", pki["ca.pem"]]
        peer = [
            "--peer-tls-ca",
            pki["ca.pem"],
            "--peer-tls-cert",
            pki["client.pem"],
            "--peer-tls-key",
            pki["client.key"],
        ]
        with ThreadPoolExecutor(2) as pool:  # both load at once
            starting = [
                pool.submit(
                    built.start_service,
                    role,
                    f"specsplit.{role}_service.server",
                    role,
                    ["--model", str(model), *mtls],
                    work,
                    300,
                )
                for role, model in (("target", tiny_target_dir), ("draft", tiny_draft_dir))
            ]
            target, draft = (future.result() for future in starting)
        orch_args = ["--tokenizer", str(tiny_target_dir), *peer]
        wiring = ["--target", built.reach("target", target), "--draft", built.reach("draft", draft)]
        orch = built.start_service("orch", "specsplit.orchestrator.api.server", "orch", [*wiring, *orch_args], work, 300)
        yield Across(built, built.reach("orch", orch), target, draft, orch_args, work, mtls)


@pytest.fixture(scope="module")
def relayed(net):
    """(orchestrator HOST:PORT, {"draft": relay, "target": relay}): a second orchestrator on the orch host that
    reaches draft and target through relays on the router host (1 ms each way, 0.3 ms jitter)."""
    built = net.hosts
    links, wiring = {}, []
    for role, service in (("draft", net.draft), ("target", net.target)):
        address, links[role] = built.relay(role, service.port, RELAY_SHAPE, net.work, seed=len(links))
        wiring += [f"--{role}", address]
    orch = built.start_service(
        "orch", "specsplit.orchestrator.api.server", "orch-relayed", [*wiring, *net.orch_args], net.work, 300
    )
    return built.reach("orch", orch), links


@pytest.fixture(scope="module")
def long_reference(tiny_target_dir, gguf_tokenizer):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return reference_greedy(model, gguf_tokenizer.encode(LONG_PROMPT), LONG_TOKENS)


def request(prompt: str, max_new_tokens: int, drafter: str = "DRAFTER_KIND_MODEL") -> dict:
    return {
        "prompt": prompt,
        "chat": False,
        "maxNewTokens": max_new_tokens,
        "returnTokenIds": True,
        "k": 4,
        "drafter": drafter,
    }


def start_client(net, address: str, requests: list[dict], workdir: Path) -> subprocess.Popen:
    """``tests.services.host_client`` on the client host; it prints ``streaming``, then its results."""
    path = workdir / "requests.json"
    path.write_text(json.dumps(requests))
    return net.popen(
        "client",
        [sys.executable, "-m", "tests.services.host_client", address, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def results_of(client: subprocess.Popen, timeout_s: float = 300.0) -> list[dict]:
    out, err = client.communicate(timeout=timeout_s)
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert client.returncode == 0 and lines, err
    return json.loads(lines[-1])


def generate_across(net, address: str, requests: list[dict], workdir: Path, fault=None) -> list[dict]:
    """Run ``requests`` from the client host; ``fault()`` once the first one streams."""
    client = start_client(net, address, requests, workdir)
    try:
        if fault is not None:
            assert client.stdout.readline().strip() == "streaming"
            fault()
        return results_of(client)
    finally:
        if client.poll() is None:
            client.kill()


@pytest.mark.parametrize("drafter", ["DRAFTER_KIND_MODEL", "DRAFTER_KIND_NGRAM"])
def test_greedy_output_across_hosts_is_the_targets_own(net, tiny_reference, tmp_path, drafter):
    built, address = net.hosts, net.orch
    _, expected = tiny_reference
    results = generate_across(built, address, [request(p, 24, drafter) for p in TINY_PROMPTS], tmp_path)
    assert [r["code"] for r in results] == ["OK"] * len(TINY_PROMPTS)
    assert [r["ids"] for r in results] == expected


@pytest.mark.parametrize("host", ["draft", "target"])
def test_a_partition_mid_generation_loses_and_duplicates_nothing(net, long_reference, tmp_path, host):
    built, address = net.hosts, net.orch

    def partition() -> None:
        built.take_down(host)
        try:
            subprocess.run(["sleep", str(PARTITION_S)], check=True)
        finally:
            built.bring_up(host)

    [result] = generate_across(built, address, [request(LONG_PROMPT, LONG_TOKENS)], tmp_path, partition)
    assert result["code"] == "OK", result["text"]
    assert result["ids"] == long_reference


def test_a_link_throttled_to_a_trickle_still_gives_the_targets_output(net, tiny_reference, tmp_path):
    built, address = net.hosts, net.orch
    _, expected = tiny_reference
    built.limit_rate("target", TRICKLE_BPS)
    built.limit_rate("draft", TRICKLE_BPS)
    try:
        results = generate_across(built, address, [request(p, 24) for p in TINY_PROMPTS[:3]], tmp_path)
    finally:
        built.unshape("target")
        built.unshape("draft")
    assert [r["ids"] for r in results] == expected[:3]


PLAINTEXT_INFO = """
import sys, grpc
from specsplit.v1 import specsplit_pb2 as pb, specsplit_pb2_grpc as pb_grpc
try:
    pb_grpc.TargetServiceStub(grpc.insecure_channel(sys.argv[1])).Info(pb.InfoRequest(), timeout=10)
    print("OK")
except grpc.RpcError as exc:
    print(exc.code().name)
"""


def test_the_target_refuses_a_plaintext_caller_from_another_host(net):
    target = net.hosts.reach("target", net.target)
    result = net.hosts.run("client", [sys.executable, "-c", PLAINTEXT_INFO, target], timeout=60, cwd=REPO)
    assert result.stdout.strip() == "UNAVAILABLE", result


def test_greedy_output_through_relays_on_the_router_is_the_targets_own(net, relayed, tiny_reference, tmp_path):
    address, _ = relayed
    _, expected = tiny_reference
    results = generate_across(net.hosts, address, [request(p, 24) for p in TINY_PROMPTS], tmp_path)
    assert [r["ids"] for r in results] == expected


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_relay_stalled_mid_generation_loses_and_duplicates_nothing(net, relayed, long_reference, tmp_path, role):
    address, links = relayed

    def stall() -> None:
        links[role].stall()
        try:
            subprocess.run(["sleep", str(STALL_S)], check=True)
        finally:
            links[role].resume()

    [result] = generate_across(net.hosts, address, [request(LONG_PROMPT, LONG_TOKENS)], tmp_path, stall)
    assert result["code"] == "OK", result["text"]
    assert result["ids"] == long_reference


def test_a_draft_killed_on_its_host_mid_generation_falls_back_to_the_target(
    net, tiny_draft_dir, long_reference, tmp_path
):
    """A draft of its own (and an orchestrator wired to it), so that the module's draft lives on."""
    built = net.hosts
    draft_args = ["--model", str(tiny_draft_dir), *net.server_tls]
    draft = built.start_service("draft", "specsplit.draft_service.server", "draft-killed", draft_args, tmp_path, 300)
    wiring = ["--target", built.reach("target", net.target), "--draft", built.reach("draft", draft)]
    orch = built.start_service(
        "orch", "specsplit.orchestrator.api.server", "orch-killed-draft", [*wiring, *net.orch_args], tmp_path, 300
    )
    [result] = generate_across(
        built, built.reach("orch", orch), [request(LONG_PROMPT, LONG_TOKENS)], tmp_path, draft.process.kill
    )
    assert result["code"] == "OK", result["text"]
    assert result["ids"] == long_reference
    assert result["stats"].get("drafted_tokens", 0) > 0
