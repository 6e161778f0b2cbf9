"""Attacks on the public front: a real orchestrator over the tiny services, served by uvicorn on 127.0.0.1,
probed with raw sockets (slowloris, chunked uploads, clients that never read), httpx and the openai client.

Each test names the attack it makes; every refusal must come in OpenAI's error shape (never a 500, a
traceback or a hang) and be counted in ``specsplit_refused_requests_total``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import grpc
import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import prometheus_client
import pytest

from specsplit.lmkit.auth import Tokens
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import HttpLimits, OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.server import start_server
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, wait_until

pytestmark = pytest.mark.services

MODEL = "tiny-llama"
TOKEN = "s3cret-token"
BODY_LIMIT = 256 * 1024
LIMITS = HttpLimits(max_body_bytes=BODY_LIMIT, header_timeout_s=0.5, body_timeout_s=0.5, stalled_send_s=1.0,
                    trusted_hosts=("127.0.0.1",))
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0}


class Front:
    def __init__(self, port: int, locked_port: int, grpc_address: str, orch: Orchestrator) -> None:
        self.port, self.locked_port, self.grpc_address, self.orch = port, locked_port, grpc_address, orch
        self.url = f"http://127.0.0.1:{port}"

    def post(self, path: str, content: bytes, headers: dict | None = None, **kwargs) -> httpx.Response:
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=30, **kwargs)


@pytest.fixture(scope="module")
def front(tiny_services, tiny_target_dir, background_loop):
    """The HTTP API (``LIMITS``; one generation per caller) and the gRPC API over one orchestrator, and the
    HTTP API again with a token."""
    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir),
                                served_model_names=(MODEL,), max_new_tokens_limit=4096, max_concurrent_per_caller=1,
                                max_stop_chars=64)
    orch = background_loop.run(Orchestrator.connect(config))
    app = openai_server.build_app(orch, limits=LIMITS)
    http = background_loop.run(openai_server.start_http_server(app, "127.0.0.1", 0, limits=LIMITS))
    locked = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch, Tokens(fixed=TOKEN), LIMITS),
                                                                 "127.0.0.1", 0, limits=LIMITS))
    server, grpc_port = background_loop.run(start_server(orch))
    yield Front(http.port, locked.port, f"127.0.0.1:{grpc_port}", orch)
    background_loop.run(server.stop(0))
    background_loop.run(http.stop())
    background_loop.run(locked.stop())
    background_loop.run(orch.close())


def refused(reason: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value("specsplit_refused_requests_total", {"reason": reason}) or 0.0


def assert_openai_error(response: httpx.Response, status: int, fragment: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error
    return error


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout if it does not within 10 s)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- size before work ---------------------------------------------------------------------------------------


def test_a_chunked_upload_is_refused_at_the_body_limit_without_reading_the_rest(front):
    before = refused("body_too_large")
    sock = connect(front.port)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"[" * 4096
    for _ in range(BODY_LIMIT // len(chunk) + 2):  # past the limit, and never the final 0-length chunk
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    answer = read_until_closed(sock)  # the server answers and closes while the upload is still "going on"
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"connection: close" in head.lower()
    assert f"over {BODY_LIMIT} bytes" in json.loads(body)["error"]["message"]
    assert refused("body_too_large") == before + 1


def test_a_prompt_over_its_byte_limit_is_refused_before_tokenizing_on_grpc_and_http(front):
    limit = front.orch.prompt_byte_limit  # 512 positions x the longest SmolLM2 token
    assert 512 <= limit < BODY_LIMIT * 2
    before = refused("prompt_too_large")
    over = limit // 2 + 1  # two-byte characters: just over the limit, under the gRPC receive bound

    async def generate():
        async with grpc.aio.insecure_channel(front.grpc_address) as channel:
            stream = pb_grpc.GeneratorStub(channel).Generate(pb.GenerateRequest(prompt="é" * over, max_new_tokens=2))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.read()
            return caught.value

    error = run_async(generate(), 60)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prompt is {2 * over} bytes (with its tools and grammar); at most {limit}" in error.details()
    turns = [{"role": "user", "content": "a" * (limit // 2)}, {"role": "assistant", "content": "b" * (limit // 2)}]
    response = front.post("/v1/chat/completions", json.dumps({**CHAT, "messages": turns}).encode())
    assert_openai_error(response, 400, f"at most {limit} are accepted")
    assert refused("prompt_too_large") == before + 2


def test_health_answers_while_a_long_prompt_is_tokenized(tiny_services, tiny_target_dir, background_loop):
    """A prompt of 1.2 MB (far over the tiny model's context) is tokenized, then refused; meanwhile /health
    answers, since tokenizing runs off the event loop. The bound is a sanity limit, not a timing."""
    config = OrchestratorConfig(tiny_services.target_address, "", str(tiny_target_dir), served_model_names=(MODEL,),
                                max_prompt_bytes=4 * 1024 * 1024)
    orch = background_loop.run(Orchestrator.connect(config))
    http = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    url = f"http://127.0.0.1:{http.port}"
    outcome = {}

    def big_request() -> None:
        body = {"model": MODEL, "prompt": "hello world, how are things? " * 40_000, "max_tokens": 2}
        outcome["response"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    try:
        worker = threading.Thread(target=big_request)
        worker.start()
        waits = []
        with httpx.Client(base_url=url, timeout=30) as client:
            while worker.is_alive():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                waits.append(time.monotonic() - start)
                time.sleep(0.02)
        worker.join()
        assert_openai_error(outcome["response"], 400, "tokens but the model's context is 512")
        assert len(waits) >= 5 and max(waits) < 1.0, (len(waits), max(waits))
    finally:
        background_loop.run(http.stop())
        background_loop.run(orch.close())


# -- slow and silent clients --------------------------------------------------------------------------------


def test_slowloris_headers_are_cut_off_after_the_header_timeout(front):
    before = refused("header_timeout")
    sock = connect(front.port)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed_after = None
    start = time.monotonic()
    try:
        for _ in range(100):  # a header byte every 50 ms, for up to 5 s
            sock.sendall(b"X")
            time.sleep(0.05)
            if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                closed_after = time.monotonic() - start
                break
    except BlockingIOError:
        pass
    except (BrokenPipeError, ConnectionResetError):
        closed_after = time.monotonic() - start
    if closed_after is None:
        sock.settimeout(5)
        closed_after = time.monotonic() - start if read_until_closed(sock) == b"" else None
    sock.close()
    assert closed_after is not None and closed_after < 5, "the server kept a trickling connection open"
    assert refused("header_timeout") == before + 1


def test_an_idle_connection_that_sends_nothing_is_closed(front):
    sock = connect(front.port)
    assert read_until_closed(sock) == b""  # within 10 s, or socket.timeout fails the test
    sock.close()


def test_a_body_held_open_gets_408_after_the_body_timeout(front):
    before = refused("body_timeout")
    sock = connect(front.port)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
    answer = read_until_closed(sock)
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert "did not arrive within 0.5 s" in json.loads(body)["error"]["message"]
    assert refused("body_timeout") == before + 1


def test_a_client_that_never_reads_its_stream_loses_its_slot(tiny_services, tiny_target_dir, background_loop):
    """One generation per caller: a stream nobody reads would hold this caller's slot for good. The server's
    send buffer is pinned small (accepted sockets inherit it), so a few dozen chunks fill every buffer."""
    config = OrchestratorConfig(tiny_services.target_address, "", str(tiny_target_dir), served_model_names=(MODEL,),
                                max_concurrent_per_caller=1)
    orch = background_loop.run(Orchestrator.connect(config))
    http = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch, limits=LIMITS),
                                                               "127.0.0.1", 0, limits=LIMITS))
    for listener in http.server.servers[0].sockets:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    before = refused("stalled_send")
    sock = connect(http.port, rcvbuf=4096)
    body = json.dumps({**CHAT, "max_tokens": 400, "stream": True, "logprobs": True, "top_logprobs": 20,
                       "temperature": 1.0, "seed": 1}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        assert wait_until(lambda: orch.active == 1, 10)
        assert wait_until(lambda: refused("stalled_send") == before + 1, 120), ("the stream kept its slot", orch.active)
        assert wait_until(lambda: orch.active == 0, 10)
        response = httpx.post(f"http://127.0.0.1:{http.port}/v1/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 200, response.text  # the same caller is served again
    finally:
        sock.close()
        background_loop.run(http.stop())
        background_loop.run(orch.close())


def test_a_generation_past_the_deadline_ends_with_504(tiny_services, tiny_target_dir, background_loop):
    config = OrchestratorConfig(tiny_services.target_address, "", str(tiny_target_dir), served_model_names=(MODEL,),
                                max_generation_s=0.2)
    orch = background_loop.run(Orchestrator.connect(config))
    http = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    before = refused("generation_deadline")
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="-", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=500, temperature=0)
        assert caught.value.status_code == 504
        assert "ran past the server's limit of 0.2 s" in caught.value.message
        assert refused("generation_deadline") == before + 1
        assert wait_until(lambda: orch.active == 0, 5)
    finally:
        background_loop.run(http.stop())
        background_loop.run(orch.close())


def test_one_caller_cannot_take_a_second_slot_but_another_caller_can(front):
    before = refused("caller_quota")
    first = openai.OpenAI(base_url=front.url + "/v1", api_key="caller-a", max_retries=0)
    stream = first.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=400, stream=True,
                                           temperature=1.0, seed=3)
    try:
        next(iter(stream))  # caller a's generation is running
        with pytest.raises(openai.RateLimitError, match="this caller already has 1 generations in flight"):
            first.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
        other = openai.OpenAI(base_url=front.url + "/v1", api_key="caller-b", max_retries=0)
        assert other.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2).choices
    finally:
        stream.close()
        first.close()
    assert refused("caller_quota") == before + 1


# -- what a request must look like ---------------------------------------------------------------------------


def test_schema_and_docs_pages_are_off_when_a_token_is_set(front):
    for path in ("/openapi.json", "/docs", "/redoc"):
        locked = httpx.get(f"http://127.0.0.1:{front.locked_port}{path}")
        assert locked.status_code == 404, path
    assert httpx.get(front.url + "/openapi.json").json()["info"]["title"] == "specsplit"


def test_a_cross_site_text_plain_post_is_refused_with_415(front):
    before = refused("media_type")
    response = front.post("/v1/chat/completions", json.dumps(CHAT).encode(), {"content-type": "text/plain"})
    assert_openai_error(response, 415, "Content-Type must be application/json, got 'text/plain'")
    assert refused("media_type") == before + 1


def test_an_untrusted_host_header_is_refused(front):
    response = front.post("/v1/chat/completions", json.dumps(CHAT).encode(), {"host": "evil.example"})
    assert_openai_error(response, 400, "'evil.example' is not one this server answers to")
    assert httpx.get(front.url + "/health", headers={"host": "evil.example"}).status_code == 200  # probes


def _nested(depth: int) -> bytes:
    return json.dumps(CHAT).encode()[:-1] + b', "user": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("body, fragment", [
    (json.dumps({**CHAT, "top_k": 2**31}).encode(), "top_k must be at most 2147483647"),
    (json.dumps({**CHAT, "k": 2**32}).encode(), "k must be at most 4294967295"),
    (json.dumps(CHAT).encode()[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", "a number too long to read"),
    (_nested(100_000), "nests arrays or objects too deeply"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}).encode(), "lone UTF-16 surrogate"),
    (json.dumps({**CHAT, "stop": "\ud800"}).encode(), "lone UTF-16 surrogate"),
    (json.dumps({**CHAT, "model": "\ud800"}).encode(), "lone UTF-16 surrogate"),
    (json.dumps({**CHAT, "stop": "x" * 65}).encode(), "a stop string is 65 characters; at most 64"),
], ids=["top_k-2^31", "k-2^32", "max_tokens-5000-digits", "nested-100k", "surrogate-content", "surrogate-stop",
        "surrogate-model", "stop-too-long"])
def test_bad_input_is_a_400_in_openai_shape(front, body, fragment):
    assert_openai_error(front.post("/v1/chat/completions", body), 400, fragment)


# -- fuzzing -------------------------------------------------------------------------------------------------


def test_schemathesis_finds_no_server_error_and_no_response_off_the_schema(front):
    """Bodies generated from the server's own OpenAPI schema (valid and not): none gets a 5xx, and every
    response matches what the schema documents."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    schema = schemathesis.openapi.from_url(front.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    for operation in operations:
        @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            case.headers = {**(case.headers or {}), "host": "127.0.0.1"}
            case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)

        check()


def test_a_grpc_generation_past_the_deadline_ends_with_deadline_exceeded(tiny_services, tiny_target_dir,
                                                                         background_loop):
    config = OrchestratorConfig(tiny_services.target_address, "", str(tiny_target_dir), max_generation_s=0.2)
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch))

    async def generate():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=500)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in pb_grpc.GeneratorStub(channel).Generate(request):
                    pass
            return caught.value

    try:
        error = run_async(generate(), 120)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "ran past the server's limit of 0.2 s" in error.details()
        assert wait_until(lambda: orch.active == 0, 5)
    finally:
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())


def test_a_grpc_client_that_never_reads_its_stream_loses_its_slot(tiny_services, tiny_target_dir, background_loop):
    """One generation per caller: a Generate stream nobody reads would hold the slot for good. The client's
    flow-control window is pinned (no BDP probing), so a few dozen responses with logprobs fill it."""
    config = OrchestratorConfig(tiny_services.target_address, "", str(tiny_target_dir), max_concurrent_per_caller=1,
                                grpc_stalled_send_s=1.0)
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch))
    before = refused("stalled_send")
    request = pb.GenerateRequest(prompt="Once upon a time", chat=False, max_new_tokens=480, return_logprobs=True,
                                 top_logprobs=20, sampling=pb.SamplingParams(temperature=1.0, seed=1))

    async def stall_then_generate():
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            stalled = pb_grpc.GeneratorStub(channel).Generate(request)  # never read
            await stalled.initial_metadata()
            await asyncio.to_thread(wait_until, lambda: refused("stalled_send") == before + 1, 120)
            await asyncio.to_thread(wait_until, lambda: orch.active == 0, 10)
            again = [r async for r in pb_grpc.GeneratorStub(channel).Generate(
                pb.GenerateRequest(prompt="hi", max_new_tokens=2))]  # the same caller is served again
            stalled.cancel()
            return again

    try:
        again = run_async(stall_then_generate(), 180)
        assert refused("stalled_send") == before + 1, ("the stream kept its slot", orch.active)
        assert again[-1].HasField("stats")
    finally:
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())
