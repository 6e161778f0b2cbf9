"""Load generator for the OpenAI-compatible HTTP API: Poisson arrivals at given request rates, speculation on and off.

    python -m specsplit.bench.load --json bench/results/load.json [--rates 0.25,0.5,1] [--requests 16] [--max-tokens 48]
    python -m specsplit.bench.load --url http://HOST:8000/v1 --model NAME --json out.json   # an already running server

Without ``--url`` it starts target, n-gram draft and orchestrator (``--http-port``)
on loopback, pinned like the speed suite. Each request streams
``/v1/chat/completions`` (greedy, the demo prompts in turn), timed on the client:
time to first token, inter-token latency (a speculative round may deliver several
tokens in one chunk), time per output token ((e2e - TTFT) / (tokens - 1)) and end
to end. At each rate the two modes run back to back on the same arrival times
(speculation: the server's default adaptive K; none: ``k = 0``). Goodput
(DistServe, Zhong et al. 2024) counts the requests per second that met both SLOs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from specsplit.bench.prompts import DEMO_PROMPTS

MODES = {"speculation": {}, "none": {"k": 0}}  # extra request fields per mode


@dataclass
class Sample:
    """One request as the client saw it (seconds from its own send)."""

    sent_at: float  # seconds after the run started
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    acceptance_rate: float | None = None  # from usage.speculative
    mean_k: float | None = None
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Poisson arrival times: exponential gaps with mean 1 / rate, starting at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, sample: Sample) -> None:
    start = time.perf_counter()
    last = None
    try:
        async with session.post(f"{url}/chat/completions", json=body) as response:
            if response.status != 200:
                sample.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sample.error = chunk["error"]["message"][:200]
                    return
                if chunk.get("usage"):
                    sample.tokens = chunk["usage"]["completion_tokens"]
                    speculative = chunk["usage"].get("speculative") or {}
                    sample.acceptance_rate, sample.mean_k = speculative.get("acceptance_rate"), speculative.get("mean_k")
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if last is None:
                        sample.ttft = now - start
                    else:
                        sample.itl.append(now - last)
                    last = now
        sample.e2e = time.perf_counter() - start
    except aiohttp.ClientError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"


async def run_load(url: str, model: str, rate: float, n: int, mode: str, max_tokens: int,
                   seed: int) -> tuple[list[Sample], float]:
    """``n`` requests at Poisson arrivals of ``rate`` per second; (samples, wall seconds) once all have finished."""
    times = arrivals(rate, n, seed)
    samples = [Sample(t) for t in times]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        tasks = []
        for i, (at, sample) in enumerate(zip(times, samples)):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            prompt = DEMO_PROMPTS[(seed + i) % len(DEMO_PROMPTS)].text
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                    "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                    **MODES[mode]}
            tasks.append(asyncio.create_task(one_request(session, url, body, sample)))
        await asyncio.gather(*tasks)
        return samples, time.perf_counter() - start


def percentiles(values: list[float]) -> dict:
    """p50, p90, p99 (linear interpolation between order statistics) and the mean."""
    if not values:
        return {}
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": round(cuts[49], 4), "p90": round(cuts[89], 4), "p99": round(cuts[98], 4),
            "mean": round(statistics.fmean(values), 4)}


def summarise(samples: list[Sample], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    done = [s for s in samples if not s.error and s.e2e is not None]
    good = [s for s in done if s.ttft is not None and s.ttft <= slo_ttft and (s.tpot or 0.0) <= slo_tpot]
    tokens = sum(s.tokens for s in done)
    return {
        "requests": len(samples),
        "completed": len(done),
        "errors": [s.error for s in samples if s.error],
        "wall_s": round(wall, 2),
        "request_throughput": round(len(done) / wall, 4),
        "output_tokens_per_s": round(tokens / wall, 2),
        "goodput_req_per_s": round(len(good) / wall, 4),
        "slo_attained": round(len(good) / len(samples), 3),
        "ttft_s": percentiles([s.ttft for s in done if s.ttft is not None]),
        "itl_s": percentiles([gap for s in done for gap in s.itl]),
        "tpot_s": percentiles([s.tpot for s in done if s.tpot is not None]),
        "e2e_s": percentiles([s.e2e for s in done]),
        "tokens_per_chunk": round(tokens / max(1, sum(len(s.itl) + 1 for s in done)), 3),
        "mean_k": _mean([s.mean_k for s in done]),
        "acceptance_rate": _mean([s.acceptance_rate for s in done]),
    }


def _mean(values: list[float | None]) -> float | None:
    """The mean over requests that report the value (k = 0 reports no drafting)."""
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 3) if present else None


def measure(args, url: str, model: str) -> list[dict]:
    rows = []
    for rate in args.rates:
        for mode in MODES:  # back to back, the same arrival times
            samples, wall = asyncio.run(run_load(url, model, rate, args.requests, mode, args.max_tokens, args.seed))
            row = {"rate": rate, "mode": mode, **summarise(samples, wall, args.slo_ttft_s, args.slo_tpot_s)}
            row["samples"] = [{k: v for k, v in asdict(s).items() if k != "itl"} | {"chunks": len(s.itl) + 1}
                              for s in samples]
            rows.append(row)
            print(f"rate {rate}/s {mode:11s}: TTFT p50 {row['ttft_s'].get('p50')} s, ITL p50 "
                  f"{row['itl_s'].get('p50')} s, e2e p90 {row['e2e_s'].get('p90')} s, goodput "
                  f"{row['goodput_req_per_s']}/s, {row['output_tokens_per_s']} tok/s, mean K {row['mean_k']}, "
                  f"acceptance {row['acceptance_rate']}", flush=True)
    return rows


def _kinds() -> str:
    kinds = [p.kind for p in DEMO_PROMPTS]
    return ", ".join(f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds))


def start_stack(args, workdir: Path):
    """Target, draft and orchestrator (with --http-port) as processes; returns (processes, url)."""
    from specsplit.lmkit.processes import start_service
    from specsplit.target_service.ranks import free_port

    port = free_port()
    target = start_service("specsplit.target_service.server", "target",
                           ["--model", args.model, "--cpus", args.target_cpus, "--threads", "1"], workdir, 900)
    started = [target]
    try:
        draft = start_service("specsplit.draft_service.server", "draft", ["--cpus", args.draft_cpus], workdir, 600)
        started.append(draft)
        orch = start_service("specsplit.orchestrator.api.server", "orchestrator",
                             ["--target", target.address, "--draft", draft.address, "--tokenizer", args.model,
                              "--http-port", str(port), "--served-model-name", "specsplit",
                              "--max-new-tokens-limit", str(max(args.max_tokens, 128))], workdir, 600)
        started.append(orch)
    except BaseException:
        for service in reversed(started):
            service.stop()
        raise
    return started, f"http://127.0.0.1:{port}/v1"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--url", default="", help="base URL of a running server (.../v1); default: start one")
    parser.add_argument("--model", default="smollm2-135m", help="target model (and, with --url, the model name)")
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")], default=[0.25, 0.5, 1.0],
                        help="request rates per second, comma-separated")
    parser.add_argument("--requests", type=int, default=16, help="requests per rate and mode")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival times and the prompt order")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput: time to first token at most this")
    parser.add_argument("--slo-tpot-s", type=float, default=0.15, help="goodput: time per output token at most this")
    parser.add_argument("--target-cpus", default="1", help="CPUs of the target process")
    parser.add_argument("--draft-cpus", default="0", help="CPUs of the draft, the orchestrator and this client")
    args = parser.parse_args(argv)
    if args.url:
        rows, placement = measure(args, args.url.rstrip("/"), args.model), "an external server"
    else:
        os.sched_setaffinity(0, {int(c) for c in args.draft_cpus.split(",")})
        with tempfile.TemporaryDirectory(prefix="specsplit-load-") as tmp:
            started, url = start_stack(args, Path(tmp))
            try:
                rows = measure(args, url, "specsplit")
            finally:
                for service in reversed(started):
                    service.stop()
        placement = (f"target pinned to cpus {args.target_cpus} (1 thread); n-gram draft, orchestrator and this "
                     f"client on cpus {args.draft_cpus}")
    report = {
        "benchmark": "load",
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "placement": placement,
        "workload": f"streamed /v1/chat/completions, greedy, the {len(DEMO_PROMPTS)} demo prompts in turn "
                    f"({_kinds()}), Poisson arrivals; speculation = the server's default (n-gram, adaptive K <= 8), "
                    "none = k 0",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "results": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
