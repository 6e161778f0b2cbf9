"""A pool behind a name: `--target dns:///target-pool:PORT` on hosts of their own (``specsplit.bench.hosts``,
needs root), the name resolved by the orchestrator host's own hosts file (``Hosts.set_names``).

Two target replicas behind the name: sequential sessions alternate between them, each output the target's
own greedy text. Then the name is changed while the orchestrator serves (a third replica added, the first
removed): within a few re-resolutions new sessions go to the second and third replicas, none to the first.
A replica whose host is cut off mid-generation (its link down: no reset ever comes) is found gone by the
orchestrator's keepalive pings, and the session moves to the other replica with nothing lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specsplit.bench import hosts
from specsplit.lmkit import models
from specsplit.orchestrator.decode.peers import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S
from specsplit.target_service.ranks import free_port
from tests.conftest import TINY_PROMPTS, reference_greedy

WHY_NOT = hosts.unavailable()
pytestmark = [pytest.mark.services, pytest.mark.skipif(WHY_NOT is not None, reason=f"no hosts here: {WHY_NOT}")]

REPO = Path(__file__).resolve().parents[2]
RESOLVE_EVERY_S = 0.3
OPENED = """
import asyncio, json, sys
from specsplit.bench.pools import opened
from specsplit.orchestrator.decode import peers

print(json.dumps(asyncio.run(opened(sys.argv[2:], getattr(peers, sys.argv[1])))))
"""


def generate(net, orch: str, prompts: list[str], work: Path) -> list[dict]:
    requests = [{"prompt": p, "chat": False, "maxNewTokens": 24, "returnTokenIds": True, "k": 0} for p in prompts]
    return run_requests(net, orch, requests, work)


def run_requests(net, orch: str, requests: list[dict], work: Path, concurrency: int = 1) -> list[dict]:
    """``requests`` (GenerateRequest fields) from the orch host, ``concurrency`` at a time; results in order."""
    path = work / "requests.json"
    path.write_text(json.dumps(requests))
    result = net.run("orch", [sys.executable, "-m", "tests.services.host_client", orch, str(path), str(concurrency)],
                     cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def opened(net, addresses: list[str], client: str = "target_client") -> list[int]:
    """``Stats.sessions_opened`` of each target (or, with ``client="draft_client"``, draft) at ``addresses``."""
    result = net.run("orch", [sys.executable, "-c", OPENED, client, *addresses], cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_dns_pool_spreads_sessions_and_follows_replicas_added_and_removed(tiny_target_dir, tiny_reference,
                                                                           tmp_path):
    _, expected = tiny_reference
    port = free_port()
    with hosts.Hosts(["orch", "t1", "t2", "t3"]) as net:
        replicas = {host: f"{net.address(host)}:{port}" for host in ("t1", "t2", "t3")}
        for host in ("t1", "t2"):
            net.start_service(host, "specsplit.target_service.server", f"target-{host}",
                              ["--model", str(tiny_target_dir)], tmp_path, 300, port=port)
        net.set_names("orch", {"target-pool": [net.address("t1"), net.address("t2")]})
        orch = net.start_service("orch", "specsplit.orchestrator.api.server", "orch",
                                 ["--target", f"dns:///target-pool:{port}", "--draft", "", "--tokenizer",
                                  str(tiny_target_dir), "--resolve-every-s", str(RESOLVE_EVERY_S)], tmp_path, 300)
        front = net.reach("orch", orch)

        results = generate(net, front, TINY_PROMPTS[:4], tmp_path)
        assert [r["ids"] for r in results] == expected[:4]
        assert opened(net, [replicas["t1"], replicas["t2"]]) == [2, 2]  # one after the other, alternating

        net.start_service("t3", "specsplit.target_service.server", "target-t3", ["--model", str(tiny_target_dir)],
                          tmp_path, 300, port=port)
        net.set_names("orch", {"target-pool": [net.address("t2"), net.address("t3")]})  # t3 in, t1 out
        deadline = time.monotonic() + 30
        while "joined the pool" not in orch.log_path.read_text():
            assert time.monotonic() < deadline, orch.log_tail()
            time.sleep(0.1)
        results = generate(net, front, TINY_PROMPTS[:4], tmp_path)
        assert [r["ids"] for r in results] == expected[:4]
        assert opened(net, list(replicas.values())) == [2, 3, 3]  # none more on t1; t3 catches up with t2
        log = orch.log_path.read_text()
        assert f"target replica at {replicas['t1']} left dns:///target-pool:{port}" in log, log


LONG_TOKENS = 400


def test_a_replica_whose_host_is_cut_off_mid_generation_hands_its_session_to_the_other(tiny_target_dir,
                                                                                     gguf_tokenizer, tmp_path):
    """The session opens on the first replica (both idle: the first listed); its host's link goes down once the
    client streams. The verify in flight would wait out its own 120 s timeout; the keepalive ping finds the
    peer gone within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S and the session is re-opened on the second replica."""
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    expected = reference_greedy(model, gguf_tokenizer.encode(TINY_PROMPTS[2]), LONG_TOKENS)
    port = free_port()
    with hosts.Hosts(["orch", "t1", "t2"]) as net:
        for host in ("t1", "t2"):
            net.start_service(host, "specsplit.target_service.server", f"target-{host}",
                              ["--model", str(tiny_target_dir)], tmp_path, 300, port=port)
        pool = ",".join(f"{net.address(host)}:{port}" for host in ("t1", "t2"))
        orch = net.start_service("orch", "specsplit.orchestrator.api.server", "orch",
                                 ["--target", pool, "--draft", "", "--tokenizer", str(tiny_target_dir)], tmp_path, 300)
        path = tmp_path / "long.json"
        path.write_text(json.dumps([{"prompt": TINY_PROMPTS[2], "chat": False, "maxNewTokens": LONG_TOKENS,
                                     "returnTokenIds": True, "k": 0}]))
        client = net.popen("orch", [sys.executable, "-m", "tests.services.host_client", net.reach("orch", orch),
                                    str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert client.stdout.readline().strip() == "streaming"
            net.take_down("t1")
            # well under the 120 s a verify may wait on its own: the keepalive found the host gone
            out, err = client.communicate(timeout=4 * (KEEPALIVE_S + KEEPALIVE_TIMEOUT_S))
        finally:
            if client.poll() is None:
                client.kill()
        assert client.returncode == 0, err
        [result] = json.loads(out.strip().splitlines()[-1])
        assert result["code"] == "OK" and result["ids"] == expected, result
        assert int(result["stats"].get("target_reopens", 0)) >= 1, result["stats"]
        log = orch.log_path.read_text()
        assert "re-opening the session" in log, log
