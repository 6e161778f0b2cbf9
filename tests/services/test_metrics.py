"""Prometheus metrics: the orchestrator's per-request figures and a service's HTTP exporter."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY

from specsplit.lmkit.processes import start_service
from specsplit.target_service.ranks import free_port
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async

pytestmark = pytest.mark.services


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def eventually(name: str, at_least: float, **labels) -> float:
    """The server records a refused call right after the client has its status: allow it a moment. At least:
    the counter is the process's, and a server of another test module in this worker (an HTTP front a probe
    still polls) may count its own requests meanwhile."""
    deadline = time.monotonic() + 5
    while value(name, **labels) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return value(name, **labels)


def test_orchestrator_counts_requests_tokens_acceptance_and_latencies(public_api):
    names = ("specsplit_generation_tokens_total", "specsplit_prompt_tokens_total",
             "specsplit_spec_decode_num_draft_tokens_total", "specsplit_spec_decode_num_accepted_tokens_total",
             "specsplit_spec_decode_num_drafts_total", "specsplit_time_to_first_token_seconds_count",
             "specsplit_e2e_request_latency_seconds_count", "specsplit_request_queue_time_seconds_count",
             "specsplit_inter_token_latency_seconds_count")
    before = {n: value(n) for n in names}
    ok_before = value("specsplit_requests_total", code="OK")
    bad_before = value("specsplit_requests_total", code="INVALID_ARGUMENT")
    length_before = value("specsplit_request_success_total", finished_reason="length")

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
    delta = {n: value(n) - before[n] for n in names}
    assert eventually("specsplit_requests_total", ok_before + 1, code="OK") >= ok_before + 1
    assert eventually("specsplit_requests_total", bad_before + 1, code="INVALID_ARGUMENT") >= bad_before + 1
    assert value("specsplit_request_success_total", finished_reason="length") == length_before + 1
    assert delta["specsplit_generation_tokens_total"] == stats.new_tokens == 30
    assert delta["specsplit_prompt_tokens_total"] == stats.prompt_tokens
    assert delta["specsplit_spec_decode_num_draft_tokens_total"] == stats.drafted_tokens
    assert delta["specsplit_spec_decode_num_accepted_tokens_total"] == stats.accepted_tokens
    assert 0 < delta["specsplit_spec_decode_num_drafts_total"] <= stats.rounds
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta[f"specsplit_{histogram}_seconds_count"] == 1, histogram
    # one gap per round after the first (each round commits at least one token)
    assert delta["specsplit_inter_token_latency_seconds_count"] == stats.rounds - 1
    first_drafted = value("specsplit_spec_decode_num_draft_tokens_per_pos_total", position="0")
    assert first_drafted >= value("specsplit_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert value("specsplit_num_requests_running") == 0


def test_service_exports_sessions_over_http(tmp_path, tiny_target_dir):
    port = free_port()
    # 2 layers x 4 KV heads x 16 dims x 2 (K, V) x 4 bytes = 1,024 bytes a position: a budget of 100 positions
    target = start_service("specsplit.target_service.server", "target",
                           ["--model", str(tiny_target_dir), "--metrics-port", str(port), "--kv-budget-bytes", "102400"],
                           tmp_path, 300)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        target.stop()
    assert 'specsplit_ready{service="TargetService"} 1.0' in body
    assert 'specsplit_active_sessions{service="TargetService"} 0.0' in body
    assert "specsplit_rounds_total" in body
    assert 'specsplit_kv_budget{service="TargetService",unit="positions"} 100.0' in body
    assert 'specsplit_kv_reserved{service="TargetService",unit="positions"} 0.0' in body
