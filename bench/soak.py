"""Soak / load: N concurrent clients for a fixed time, at and above the admission limit.

    python -m specsplit.bench.soak --json bench/results/soak.json [--clients 12 --max-concurrent 8 --duration-s 120]

Draft, target and orchestrator run as separate processes on loopback. Clients
loop on Generate until the time is up. Expected: every error is
RESOURCE_EXHAUSTED (only beyond the limit), no session is left on either
service, and each process's RSS stays flat after warm-up. Loopback only,
bounded in time and count; it stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from pathlib import Path

import grpc

from specsplit.lmkit.processes import rss_mb, start_service
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

PROMPTS = ["Tell me about rivers.", "def add(a, b):", "a b a b a b", "List three colours."]


async def client(address: str, stop_at: float, codes: collections.Counter, tokens: list[int], index: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        i = index
        while time.monotonic() < stop_at:
            request = pb.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=24, k=4)
            i += 1
            try:
                async for reply in stub.Generate(request, timeout=120):
                    if reply.HasField("stats"):
                        tokens[0] += reply.stats.new_tokens
                codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] += 1
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.05)  # a well-behaved client backs off


async def drive(address: str, clients: int, duration_s: float, pids: dict[str, int]) -> dict:
    codes: collections.Counter = collections.Counter()
    tokens = [0]
    samples = {name: [] for name in pids}
    stop_at = time.monotonic() + duration_s

    async def sample_rss():
        while time.monotonic() < stop_at:
            for name, pid in pids.items():
                value = rss_mb(pid)
                if value is None:  # no service of a soak is ever stopped: one that ended failed it
                    raise RuntimeError(f"the {name} process (pid {pid}) ended during the soak; its log says why")
                samples[name].append(round(value, 1))
            await asyncio.sleep(1.0)

    started = time.monotonic()
    await asyncio.gather(sample_rss(), *(client(address, stop_at, codes, tokens, i) for i in range(clients)))
    return {"codes": dict(codes), "tokens": tokens[0], "wall_s": time.monotonic() - started, "rss_mb": samples}


async def leftover_sessions(address: str, stub_cls) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await stub_cls(channel).Stats(pb.StatsRequest())).active_sessions


def run(model: str, draft_model: str, clients: int, max_concurrent: int, duration_s: float, workdir: Path) -> dict:
    target = start_service("specsplit.target_service.server", "target", ["--model", model], workdir, 600)
    draft = start_service("specsplit.draft_service.server", "draft", ["--model", draft_model] if draft_model else [], workdir, 600)
    orch = start_service(
        "specsplit.orchestrator.api.server", "orchestrator",
        ["--target", target.address, "--draft", draft.address, "--tokenizer", model,
         "--max-concurrent", str(max_concurrent)], workdir, 600,
    )
    try:
        pids = {"target": target.process.pid, "draft": draft.process.pid, "orchestrator": orch.process.pid}
        load = asyncio.run(drive(orch.address, clients, duration_s, pids))
        time.sleep(0.5)
        leaked = {
            "target": asyncio.run(leftover_sessions(target.address, pb_grpc.TargetServiceStub)),
            "draft": asyncio.run(leftover_sessions(draft.address, pb_grpc.DraftServiceStub)),
        }
    finally:
        for service in (orch, draft, target):
            service.stop()
    unexpected = {code: n for code, n in load["codes"].items() if code not in ("OK", "RESOURCE_EXHAUSTED")}
    rss_growth = {
        name: round(series[-1] - series[len(series) // 3], 1) if len(series) >= 3 else 0.0
        for name, series in load["rss_mb"].items()
    }
    return {
        "benchmark": "soak",
        "clients": clients,
        "max_concurrent": max_concurrent,
        "duration_s": duration_s,
        "requests_ok": load["codes"].get("OK", 0),
        "errors_by_code": {c: n for c, n in load["codes"].items() if c != "OK"},
        "unexpected_errors": unexpected,
        "tokens": load["tokens"],
        "tokens_per_s": round(load["tokens"] / load["wall_s"], 2),
        "leaked_sessions": leaked,
        "rss_mb": load["rss_mb"],
        "rss_growth_after_warmup_mb": rss_growth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default="smollm2-135m", help="target model")
    parser.add_argument("--draft-model", default="", help="draft model (empty: n-gram)")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=120.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = run(args.model, args.draft_model, args.clients, args.max_concurrent, args.duration_s, Path(tmp))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: report[k] for k in ("requests_ok", "errors_by_code", "leaked_sessions", "rss_growth_after_warmup_mb")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
