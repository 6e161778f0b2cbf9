"""`specsplit up`: draft and target placed as Ray actors by resources, the orchestrator wired to them.

Stopping it (SIGTERM, in the fixture's teardown) must take the actors and their service processes along.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from specsplit.bench import hosts
from specsplit.ray_deploy.placement import Placement, model_in, parse_resources, target_argv
from specsplit.v1 import specsplit_pb2 as pb
from tests.conftest import run_async
from tests.ray.conftest import start_cli
from tests.ray.test_serve import generate

pytestmark = pytest.mark.ray

APP = "up-test"
# Where hosts can be built, tests/ray/test_across_hosts.py runs `up` on nodes that are hosts of their own and
# checks there what the tests that take the `up` fixture check here.
across_hosts = pytest.mark.skipif(hosts.unavailable() is None,
                                  reason="hosts can be built here: `up` is placed on nodes across them")


@pytest.fixture(scope="module")
def up(ray_cluster, tiny_target_dir, tiny_draft_dir, tmp_path_factory):
    """`specsplit up`: target on the node with `target_node`, draft on the node with `draft_node`."""
    started = start_cli(
        ["up", "--ray-address", ray_cluster.address, "--ray-app-name", APP, "--ray-num-cpus", "0",
         "--target-args", f"--model {tiny_target_dir}", "--target-resources", '{"target_node": 1}',
         "--draft-args", f"--model {tiny_draft_dir}", "--draft-resources", '{"draft_node": 1}',
         "--target-num-cpus", "0", "--draft-num-cpus", "0", "--grace-s", "2"],
        tmp_path_factory.mktemp("ray-up"),
    )
    yield started
    # SIGTERM: up exits 0 and takes its actors and their service processes with it.
    import ray

    pids = [service_info(role)["pid"] for role in ("target", "draft")]
    assert started.stop() == 0, started.log_tail()
    for role, pid in zip(("target", "draft"), pids):
        with pytest.raises(ValueError):
            ray.get_actor(f"{APP}-{role}", namespace="specsplit")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def service_info(role: str) -> dict:
    import ray

    return ray.get(ray.get_actor(f"{APP}-{role}", namespace="specsplit").info.remote())


@across_hosts
def test_services_land_on_the_nodes_that_have_their_resources(up, ray_cluster):
    target, draft = service_info("target"), service_info("draft")
    assert target["node_id"] == ray_cluster.target_node
    assert draft["node_id"] == ray_cluster.draft_node
    assert target["address"].startswith("127.0.0.1:") and draft["address"].startswith("127.0.0.1:")


@across_hosts
def test_up_serves_the_targets_greedy_output(up, tiny_target_dir):
    from specsplit.lmkit import models

    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    prompt = "Once upon a time, in a land far away,"
    ids = list(tokenizer.encode(prompt))
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=2)
    msg = pb.GenerateRequest(prompt=prompt, chat=False, max_new_tokens=20, return_token_ids=True, k=4,
                             drafter=pb.DRAFTER_KIND_MODEL)
    text, got, code = run_async(generate(up.address, msg))
    assert code == "OK", text
    assert got == expected[0, len(ids):].tolist()


def test_what_no_node_can_hold_is_a_cli_error_for_up_serve_and_batch(ray_cluster, tmp_path):
    """Each command checks its requests against the cluster before it starts anything (run at once, in parallel)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    cluster = ["--ray-address", ray_cluster.address]
    peers = ["--target", "127.0.0.1:1", "--draft", ""]  # never dialled: the refusal comes first
    commands = {
        "up": ["up", *cluster, "--target-resources", '{"nowhere": 1}', "--port", "0"],
        "serve --ray": ["serve", "--ray", *cluster, *peers, "--ray-num-cpus", "64", "--port", "0"],
        "batch": ["batch", *cluster, *peers, "--input", str(prompts), "--output", str(tmp_path / "out.jsonl"),
                  "--workers", "1", "--worker-cpus", "64"],
    }
    running = {name: subprocess.Popen([sys.executable, "-m", "specsplit.cli", *argv], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, argv in commands.items()}
    errors = {name: process.communicate(timeout=120)[1] for name, process in running.items()}
    for name, process in running.items():
        assert process.returncode == 2, (name, errors[name])
        assert f"cannot run what `specsplit {name}` asks for" in errors[name] and "Traceback" not in errors[name]
        assert "the Ray cluster has CPU 4" in errors[name] and "in all over 3 node(s)" in errors[name], errors[name]
    assert "the target asks for CPU 1, nowhere 1, more than any node of the cluster has" in errors["up"]
    assert "--target-resources" in errors["up"]
    assert "orchestrator replica asks for CPU 64" in errors["serve --ray"] and "--ray-num-cpus" in errors["serve --ray"]
    assert "batch worker asks for CPU 64" in errors["batch"] and "--worker-cpus" in errors["batch"]
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def taken_target_up(address: str) -> list[str]:
    """`specsplit up` asking for the cluster's one `target_node`, which a running `up` holds: it waits 2 s for it
    (--ray-schedule-timeout-s), then must fail (``assert_refused_for_the_taken_target``)."""
    return [sys.executable, "-m", "specsplit.cli", "up", "--ray-address", address, "--ray-app-name", "other",
            "--target-resources", '{"target_node": 1}', "--target-num-cpus", "0", "--no-draft", "--ray-num-cpus", "0",
            "--ray-schedule-timeout-s", "2", "--port", "0"]


def assert_refused_for_the_taken_target(result: subprocess.CompletedProcess, took_s: float) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "could not schedule these within 2 s (--ray-schedule-timeout-s)" in result.stderr, result.stderr[-3000:]
    assert "target_node 1 in all" in result.stderr and "target_node 0 free now" in result.stderr
    assert "Traceback" not in result.stderr
    assert took_s < 60


@across_hosts
def test_service_whose_resources_are_taken_fails_within_the_schedule_timeout(up, ray_cluster):
    """The cluster has one `target_node`, and the running `up` holds it: a second target waits 2 s, then fails."""
    import ray

    began = time.monotonic()
    result = subprocess.run(taken_target_up(ray_cluster.address), capture_output=True, text=True, timeout=120)
    assert_refused_for_the_taken_target(result, time.monotonic() - began)
    with pytest.raises(ValueError):
        ray.get_actor("other-target", namespace="specsplit")
    states = [group["state"] for group in ray.util.placement_group_table().values()]
    assert "PENDING" not in states, states


def test_placement_flags():
    assert target_argv("--model /m --device cuda", 4) == ["--model", "/m", "--device", "cuda", "--tp", "4"]
    assert target_argv("--model /m --tp 2", 4)[-2:] == ["--tp", "2"]  # an explicit --tp wins
    assert model_in(["--device", "cuda", "--model", "/m"]) == "/m" and model_in(["--model=/x"]) == "/x"
    assert Placement(1.0, 2, {"draft": 1.0}).ask("draft").bundle() == {"CPU": 1.0, "GPU": 2, "draft": 1.0}
    assert Placement(0.0).ask("target").bundle() == {}  # asks for nothing: runs anywhere, at once
    assert parse_resources('{"draft": 1}', "--draft-resources") == {"draft": 1.0}
    with pytest.raises(ValueError, match="--draft-resources must be a JSON object"):
        parse_resources("draft=1", "--draft-resources")
    with pytest.raises(ValueError, match="must map resource names to numbers"):
        parse_resources('{"draft": "yes"}', "--draft-resources")
