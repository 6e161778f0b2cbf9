"""`specsplit serve --ray`: the orchestrator as a Ray Serve application on a real local cluster.

Greedy output equals the plain orchestrator's; a full queue is RESOURCE_EXHAUSTED;
each replica's health check follows its target; build_app refuses bad args.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.ray_deploy import options
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, wait_until
from tests.ray.conftest import start_cli

pytestmark = pytest.mark.ray

APP = "serve-test"
STALLED_SEND_S = 3.0  # the front ends a stream its client reads nothing of for this long
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4, 5, 6,", "a b a b a b a b"]


@pytest.fixture(scope="module")
def ray_front(ray_cluster, tiny_services, tiny_target_dir, tmp_path_factory):
    """`specsplit serve --ray` with 2 replicas, each running 1 generation with 1 more queued."""
    front = start_cli(
        ["serve", "--ray", "--ray-address", ray_cluster.address, "--ray-app-name", APP,
         "--ray-num-replicas", "2", "--ray-max-ongoing-requests", "1", "--ray-max-queued-requests", "1",
         "--ray-num-cpus", "0", "--target", tiny_services.target_address, "--draft", tiny_services.draft_address,
         "--tokenizer", str(tiny_target_dir), "--grace-s", "2", "--grpc-stalled-send-s", str(STALLED_SEND_S)],
        tmp_path_factory.mktemp("ray-front"),
    )
    yield front
    assert front.stop() == 0, front.log_tail()


async def generate(address: str, request: pb.GenerateRequest,
                   streaming: asyncio.Event | None = None) -> tuple[str, list[int], str]:
    """(text, token ids, status code name) of one Generate call; ``streaming`` is set at its first response."""
    text, ids = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            async for response in pb_grpc.GeneratorStub(channel).Generate(request, timeout=120):
                text.append(response.text)
                ids.extend(response.token_ids)
                if streaming is not None:
                    streaming.set()
        except grpc.aio.AioRpcError as exc:
            return exc.details(), ids, exc.code().name
    return "".join(text), ids, "OK"


def request(prompt: str, max_new_tokens: int, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, chat=False, max_new_tokens=max_new_tokens, return_token_ids=True, **fields)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_ray_served_greedy_output_equals_the_plain_orchestrator(ray_front, public_api, drafter):
    from specsplit.lmkit.kinds import DrafterKind

    kind = DrafterKind[drafter.upper()].value
    for prompt in PROMPTS:
        msg = request(prompt, 20, k=4, drafter=kind)
        on_ray = run_async(generate(ray_front.address, msg))
        plain = run_async(generate(public_api, msg))
        assert on_ray[2] == "OK", on_ray
        assert on_ray == plain, f"{drafter} diverged on {prompt!r}"


def test_replicas_are_running_and_the_front_reports_serving(ray_front):
    from ray import serve

    app = serve.status().applications[APP]
    assert app.status == "RUNNING"
    assert app.deployments["Orchestrator"].replica_states == {"RUNNING": 2}

    async def health():
        async with grpc.aio.insecure_channel(ray_front.address) as channel:
            return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))

    assert run_async(health()).status == health_pb2.HealthCheckResponse.SERVING


def test_the_front_answers_info_as_the_plain_orchestrator(ray_front, public_api):
    async def info(address):
        async with grpc.aio.insecure_channel(address) as channel:
            return await pb_grpc.GeneratorStub(channel).Info(pb.InfoRequest(), timeout=60)

    on_ray, plain = run_async(info(ray_front.address)), run_async(info(public_api))
    assert on_ray == plain and on_ray.wire_version >= 2 and on_ray.model_id


def test_requests_beyond_replicas_and_queue_are_resource_exhausted(ray_front, tiny_services):
    """2 replicas x 1 running + 1 queued: with both replicas streaming and one request waiting, more are refused.

    Staged, not one burst: Serve counts a request as queued until its replica is picked, so in a
    simultaneous burst on a loaded machine even the first requests can fill the queue of 1.
    """
    long = 480  # tokens: the admitted requests are still running while the extra ones arrive

    async def staged():
        admitted = []
        for i in range(2):  # one per replica, each streaming before the next is sent
            streaming = asyncio.Event()
            admitted.append(asyncio.create_task(
                generate(ray_front.address, request(f"Once upon a time {i}", long, k=0), streaming)))
            await asyncio.wait_for(streaming.wait(), 60)
        admitted.append(asyncio.create_task(generate(ray_front.address, request("Once upon a time 2", long, k=0))))
        await asyncio.sleep(0.5)  # the third waits in the queue: no replica is free
        extra = await asyncio.gather(*[generate(ray_front.address, request(f"Extra {i}", 8, k=0)) for i in range(4)])
        return await asyncio.gather(*admitted), extra

    started = time.monotonic()
    admitted, extra = run_async(staged())
    elapsed = time.monotonic() - started
    assert [code for _, _, code in admitted] == ["OK"] * 3, admitted
    assert [code for _, _, code in extra] == ["RESOURCE_EXHAUSTED"] * 4, (extra, f"{elapsed:.1f} s")
    refusal = extra[0][0]
    assert "--ray-max-queued-requests" in refusal and "retry" in refusal
    assert all(0 < len(ids) <= long for _, ids, _ in admitted)
    assert run_async(generate(ray_front.address, request("after the burst", 4)))[2] == "OK"
    assert wait_until(lambda: tiny_services.target_engine.sessions.stats()[0] == 0)  # no session left behind


def test_cancelled_call_stops_the_replicas_generation(ray_front, tiny_services):
    """A client that hangs up after 3 tokens of 400 ends the generation on the replica and frees its sessions."""
    engine = tiny_services.target_engine
    rounds_before = engine.sessions.stats()[2]

    async def hang_up_early():
        async with grpc.aio.insecure_channel(ray_front.address) as channel:
            call = pb_grpc.GeneratorStub(channel).Generate(request("Once upon a time", 400, k=0))
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    call.cancel()
                    return

    run_async(hang_up_early())
    assert wait_until(lambda: engine.sessions.stats()[0] == 0)
    assert engine.sessions.stats()[2] - rounds_before < 200  # k = 0: one round per token; 400 if never cancelled


def test_invalid_request_keeps_its_status_and_message(ray_front):
    text, _, code = run_async(generate(ray_front.address, request("", 8)))
    assert code == "INVALID_ARGUMENT" and "prompt is empty" in text
    text, _, code = run_async(generate(ray_front.address, request("hi", 8, sampling=pb.SamplingParams(temperature=-1))))
    assert code == "INVALID_ARGUMENT" and "temperature" in text


def test_the_front_refuses_a_generate_over_the_replicas_bound_before_reading_it(
    ray_front, tiny_services, tiny_target_dir, background_loop
):
    """The front's transport reads no more of a Generate than ``specsplit serve``'s does (the target's context
    of the tokenizer's longest tokens), far under the 64 MiB ceiling, and never forwards it."""
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import Orchestrator
    from specsplit.orchestrator.api.server import max_generate_bytes

    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    bound = max_generate_bytes(orch)
    background_loop.run(orch.close())
    text, _, code = run_async(generate(ray_front.address, request("a" * (bound + 1), 8)))
    assert code == "RESOURCE_EXHAUSTED" and "larger than max" in text and str(bound) in text, text  # the transport's
    assert "orchestrator on Ray" in ray_front.log_tail(200)  # and the front serves on


def test_a_client_that_never_reads_its_stream_loses_it_and_the_front_serves_on(ray_front):
    """A Generate stream nobody reads (its flow-control window pinned full by responses with logprobs) is ended
    after --grpc-stalled-send-s, its generation with it, not held open for the whole generation; the same
    client is served again meanwhile. (Its status may never reach a client that reads nothing.)"""
    long_request = pb.GenerateRequest(prompt="Once upon a time", chat=False, max_new_tokens=480,
                                      return_logprobs=True, top_logprobs=20,
                                      sampling=pb.SamplingParams(temperature=1.0, seed=1))
    stalled_line = "read nothing of its Generate stream"
    seen_before = ray_front.log_path.read_text().count(stalled_line)

    async def stall_then_generate():
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(ray_front.address, options=options) as channel:
            stalled = pb_grpc.GeneratorStub(channel).Generate(long_request)  # never read
            await stalled.initial_metadata()
            await asyncio.to_thread(
                wait_until, lambda: ray_front.log_path.read_text().count(stalled_line) > seen_before, 60)
            again = [r async for r in pb_grpc.GeneratorStub(channel).Generate(request("hi", 4), timeout=60)]
            stalled.cancel()
            return again

    again = run_async(stall_then_generate(), 120)
    assert ray_front.log_path.read_text().count(stalled_line) == seen_before + 1, ray_front.log_tail(40)
    assert again[-1].HasField("stats")


def test_replica_health_check_follows_its_target(tiny_services, tiny_target_dir, background_loop, monkeypatch):
    """check_health passes while the target answers and raises once it is gone (Serve then replaces the replica)."""
    from specsplit.orchestrator.api import metrics
    from specsplit.ray_deploy.serve_app import OrchestratorReplica

    # The replica's __init__ switches its process to Ray's metrics backend; here that process is pytest's worker.
    monkeypatch.setattr(metrics, "_backend", metrics._backend)
    from specsplit.target_service.server import start_server

    target_server, port = background_loop.run(start_server(tiny_services.target_engine))
    replica = OrchestratorReplica.func_or_class.__new__(OrchestratorReplica.func_or_class)
    argv = ["--target", f"127.0.0.1:{port}", "--draft", "", "--tokenizer", str(tiny_target_dir)]

    async def check():
        await replica.__init__(argv)
        await replica.check_health()
        await target_server.stop(0)
        with pytest.raises(RuntimeError, match="unreachable"):
            await replica.check_health()
        await replica.orch.close()

    background_loop.run(check())


def test_build_app_turns_args_into_the_same_flags():
    from specsplit.ray_deploy.serve_app import build_app

    args = {"target": "dns:///target:50052", "draft": "", "k": 4, "fixed_k": True, "num_replicas": 3}
    assert options.flags_to_argv({k: v for k, v in args.items() if k != "num_replicas"}) == [
        "--target", "dns:///target:50052", "--draft", "", "--k", "4", "--fixed-k"
    ]
    app = build_app(args)
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3 and deployment.max_queued_requests == 16
    with pytest.raises(ValueError, match="--bogus"):
        build_app({"target": "127.0.0.1:1", "bogus": 1})
    with pytest.raises(ValueError, match="--k must be >= 0"):
        build_app({"target": "127.0.0.1:1", "k": -1})
