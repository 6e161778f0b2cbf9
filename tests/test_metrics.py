"""Prometheus metrics: the orchestrator's per-request figures and a service's HTTP exporter."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY

from lmkit.processes import start_service
from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from target_service.ranks import free_port
from tests.conftest import run_async

pytestmark = pytest.mark.services


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def eventually(name: str, expected: float, **labels) -> float:
    """The server records a refused call right after the client has its status: allow it a moment."""
    deadline = time.monotonic() + 5
    while value(name, **labels) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return value(name, **labels)


def test_orchestrator_counts_requests_tokens_and_acceptance(public_api):
    before = {n: value(n) for n in ("specsplit_generated_tokens_total", "specsplit_drafted_tokens_total",
                                    "specsplit_accepted_tokens_total")}
    ok_before = value("specsplit_requests_total", code="OK")
    bad_before = value("specsplit_requests_total", code="INVALID_ARGUMENT")

    async def go():
        async with grpc.aio.insecure_channel(public_api) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            replies = [r async for r in stub.Generate(pb.GenerateRequest(prompt="a b a b a b a", max_new_tokens=30, k=4))]
            try:
                [r async for r in stub.Generate(pb.GenerateRequest(prompt=""))]
            except grpc.aio.AioRpcError:
                pass
            return replies[-1].stats

    stats = run_async(go())
    assert eventually("specsplit_requests_total", ok_before + 1, code="OK") == ok_before + 1
    assert eventually("specsplit_requests_total", bad_before + 1, code="INVALID_ARGUMENT") == bad_before + 1
    assert value("specsplit_generated_tokens_total") - before["specsplit_generated_tokens_total"] == stats.new_tokens
    assert value("specsplit_drafted_tokens_total") - before["specsplit_drafted_tokens_total"] == stats.drafted_tokens
    assert value("specsplit_accepted_tokens_total") - before["specsplit_accepted_tokens_total"] == stats.accepted_tokens
    first_drafted = value("specsplit_position_drafted_total", position="0")
    assert first_drafted >= value("specsplit_position_accepted_total", position="0")
    assert value("specsplit_active_generations") == 0


def test_service_exports_sessions_over_http(tmp_path, tiny_target_dir):
    port = free_port()
    target = start_service("target_service.server", "target",
                           ["--model", str(tiny_target_dir), "--metrics-port", str(port)], tmp_path, 300)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        target.stop()
    assert 'specsplit_ready{service="TargetService"} 1.0' in body
    assert 'specsplit_active_sessions{service="TargetService"} 0.0' in body
    assert "specsplit_rounds_total" in body
