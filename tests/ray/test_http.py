"""`specsplit serve --ray --http-port`: the OpenAI-compatible API as Ray Serve's HTTP ingress, and the replicas'
metrics exported by Ray to Prometheus, scraped from each node's metrics agent on a real local cluster.

Serve keeps the HTTP options it started with, so this module starts Serve afresh (and shuts it down after):
the other Ray modules run Serve without proxies.
"""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import openai
import pytest

from specsplit.target_service.ranks import free_port
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async
from tests.ray.conftest import start_cli
from tests.ray.test_serve import generate

pytestmark = pytest.mark.ray

APP = "http-test"
TOKEN = "ray-http-token"
MODEL = "tiny-on-ray"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def ray_http(ray_cluster, tiny_services, tiny_target_dir, tmp_path_factory):
    """(front, base url): 2 replicas behind our gRPC front and Serve's HTTP proxy, with a bearer token."""
    from ray import serve

    serve.shutdown()  # a Serve started by another module keeps its (disabled) proxies
    work = tmp_path_factory.mktemp("ray-http")
    (work / "token").write_text(TOKEN)
    port = free_port()
    front = start_cli(
        ["serve", "--ray", "--ray-address", ray_cluster.address, "--ray-app-name", APP, "--http-port", str(port),
         "--ray-num-replicas", "2", "--ray-num-cpus", "0", "--target", tiny_services.target_address,
         "--draft", tiny_services.draft_address, "--tokenizer", str(tiny_target_dir), "--served-model-name", MODEL,
         "--auth-token-file", str(work / "token"), "--grace-s", "2"],
        work,
    )
    yield front, f"http://127.0.0.1:{port}/v1"
    assert front.stop() == 0, front.log_tail()
    serve.shutdown()


def test_the_openai_client_is_served_by_the_replicas(ray_http, public_api):
    front, url = ray_http
    with openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
                                              extra_body={"k": 4})
        whole = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12,
                                          extra_body={"k": 4})
        streamed = "".join(
            chunk.choices[0].text for chunk in client.completions.create(
                model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, stream=True, extra_body={"k": 4})
        )
    # the same requests through the plain orchestrator's gRPC API
    chat_request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in MESSAGES], max_new_tokens=12, k=4)
    plain_request = pb.GenerateRequest(prompt=PROMPT, chat=False, max_new_tokens=12, k=4)
    assert chat.choices[0].message.content == run_async(generate(public_api, chat_request))[0]
    text, _, code = run_async(generate(public_api, plain_request))
    assert code == "OK" and whole.choices[0].text == streamed == text and text.strip()
    assert whole.usage.completion_tokens == 12 and whole.usage.speculative["k"] == 4
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    # gRPC through the front reaches the same (ingress) replicas

    async def through_front() -> str:
        async with grpc.aio.insecure_channel(front.address) as channel:
            call = pb_grpc.GeneratorStub(channel).Generate(plain_request, metadata=(("authorization",
                                                                                     f"Bearer {TOKEN}"),))
            return "".join([r.text async for r in call])

    assert run_async(through_front()) == text


def scrape_ray_metrics() -> str:
    """Prometheus text from every node's metrics agent."""
    import ray

    texts = []
    for node in ray.nodes():
        if node["Alive"]:
            with urllib.request.urlopen(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10) as r:
                texts.append(r.read().decode())
    return "\n".join(texts)


def total(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples over every series whose labels include ``labels``."""
    out = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            out += float(match.group(2))
    return out


def test_replica_metrics_reach_prometheus_through_ray(ray_http):
    _, url = ray_http
    before = scrape_ray_metrics()
    with openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0) as client:
        for _ in range(4):
            client.completions.create(model=MODEL, prompt="a b a b a b", temperature=0, max_tokens=10,
                                      extra_body={"k": 4, "drafter": "ngram"})
    names = ("ray_specsplit_time_to_first_token_seconds_count", "ray_specsplit_e2e_request_latency_seconds_count",
             "ray_specsplit_request_queue_time_seconds_count", "ray_specsplit_generation_tokens_total")
    deadline = time.monotonic() + 90  # Ray's agents export every few seconds
    while True:
        after = scrape_ray_metrics()
        grown = {name: total(after, name) - total(before, name) for name in names}
        drafted = total(after, "ray_specsplit_spec_decode_num_draft_tokens_total")
        # each metric reaches the agent in an export of its own: wait for the last one asserted below too
        if grown["ray_specsplit_e2e_request_latency_seconds_count"] >= 4 and drafted > 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert grown["ray_specsplit_time_to_first_token_seconds_count"] >= 4, grown
    assert grown["ray_specsplit_e2e_request_latency_seconds_count"] >= 4, grown
    assert grown["ray_specsplit_request_queue_time_seconds_count"] >= 4, grown
    assert grown["ray_specsplit_generation_tokens_total"] >= 40, grown
    assert drafted > 0
    assert total(after, "ray_specsplit_requests_total", code="OK") >= 4
    assert 'ray_specsplit_inter_token_latency_seconds_bucket{' in after and 'le="0.05"' in after
    print("\n".join(line for line in after.splitlines() if line.startswith("ray_specsplit_") and (
        "_count" in line or "_total" in line)))  # shown with -s: the scraped metrics
