"""``python -m specsplit.bench.chaos``: a chaos soak against real processes, then the checks; writes JSON, exits 1 on a broken promise."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

import grpc

from specsplit.bench.chaos import checker, schedule
from specsplit.bench.chaos.driver import (
    LinkControl,
    Load,
    catalogue,
    leaked_sessions,
    references,
    run_faults,
    sample_rss,
    sessions_opened,
)
from specsplit.bench.chaos.stack import Stack
from specsplit.bench.hosts import HostError, Hosts
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc


async def _max_context(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await pb_grpc.TargetServiceStub(channel).Info(pb.InfoRequest(), timeout=30)).max_context


async def _drive(stack: Stack, args, faults: list[schedule.Fault], link: LinkControl) -> dict:
    entries = catalogue(args.max_new_tokens, sampled=True)
    refs = await references(stack.orchestrator.address, entries, args.deadline_s)
    max_context = await _max_context(stack.targets[0].address)
    rng = random.Random(args.seed)
    load = Load(stack.orchestrator.address, entries, args.deadline_s, time.monotonic(), rng)
    stop_at = load.t0 + args.duration_s
    rss: dict[str, list[float]] = {}
    clients = [load.client(i, stop_at) for i in range(args.clients)]
    fault_task = run_faults(stack, faults, load, link, args.clients, max_context, rng)
    *_, windows, _ = await asyncio.gather(*clients, fault_task, sample_rss(stack, stop_at + 5.0, rss))
    leaked = await leaked_sessions(stack)
    return {"records": load.records, "references": refs, "windows": windows, "rss": rss, "leaked": leaked,
            "opened": await sessions_opened(stack), "entries": len(entries)}


def kinds_of(args) -> tuple[str, ...]:
    """The fault kinds of ``--kinds`` (default: every kind the stack has), checked against the stack."""
    allowed = schedule.HOSTS_KINDS if args.hosts else schedule.KINDS
    if not args.kinds:
        return allowed
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in allowed]
    if unknown or not kinds:
        where = "" if args.hosts else " (partition needs --hosts)"
        raise ValueError(f"--kinds: {unknown or 'none given'}; choose from {', '.join(allowed)}{where}")
    return kinds


def run(args, workdir: Path) -> dict:
    kinds = kinds_of(args)
    if args.replicas is None:
        args.replicas = 2 if args.hosts else 1
    if args.replicas < 1 or (args.replicas > 1 and not args.hosts):
        raise ValueError(f"--replicas {args.replicas}: at least 1, and more than 1 only with --hosts")
    faults = schedule.draw(args.seed, args.duration_s, args.fault_every_s, kinds)
    where = f"across hosts, {args.replicas} replicas of each service" if args.hosts else "on loopback"
    print(f"chaos: seed {args.seed}, {len(faults)} faults over {args.duration_s:.0f} s, {args.clients} clients, "
          f"{where}")
    for fault in faults:
        print(f"  {fault}")
    with Hosts(Stack.hosts(args.replicas)) if args.hosts else contextlib.nullcontext() as net:
        run_data = _run_stack(args, workdir, faults, net)
    records = run_data["records"]
    verdict = checker.check(records, run_data["references"])
    during = [r for r in records if checker.overlaps(r, run_data["windows"])]
    calm = [r for r in records if not checker.overlaps(r, run_data["windows"])]
    growth = checker.rss_growth(run_data["rss"])
    report = {
        "benchmark": "chaos",
        "topology": (f"across hosts: {args.replicas} target and {args.replicas} draft replicas, orchestrator and "
                     "clients on hosts of their own" if args.hosts else "loopback"),
        "seed": args.seed,
        "duration_s": args.duration_s,
        "clients": args.clients,
        "model": args.model,
        "draft_model": args.draft_model or "(n-gram)",
        "catalogue_entries": run_data["entries"],
        "schedule": [str(f) for f in faults],
        "faults_by_kind": dict(collections.Counter(f.kind for f in faults)),
        "requests_by_outcome": verdict.requests_by_outcome,
        "tokens_checked": verdict.tokens_checked,
        "mismatches": verdict.mismatches,
        "contradicted": verdict.contradicted,
        "undocumented_failures": verdict.undocumented,
        "wrong_failures": verdict.wrong_failures,
        "hangs": verdict.hangs,
        "leaked_sessions": run_data["leaked"],
        "sessions_opened_per_replica": run_data["opened"],  # by each replica's last instance
        "rss_growth_after_warmup_pct": growth,
        "latency_during_faults": checker.latency_summary(during),
        "latency_without_faults": checker.latency_summary(calm),
        "ok": verdict.ok and not any(run_data["leaked"].values()),
    }
    return report


def _run_stack(args, workdir: Path, faults: list[schedule.Fault], net: Hosts | None) -> dict:
    """Start the stack (on loopback, or across ``net``'s hosts with the load on its client host), drive it, stop it."""
    draft_args = ["--model", args.draft_model] if args.draft_model else []
    stack = Stack(workdir, args.model, draft_args, args.grace_s,
                  ["--max-concurrent", str(args.max_concurrent), "--draft-timeout-s", str(args.draft_timeout_s)],
                  net, args.replicas)
    try:
        stack.start()
        with net.inside("client") if net else contextlib.nullcontext():
            return asyncio.run(_drive(stack, args, faults, LinkControl(stack.draft_links)))
    finally:
        stack.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specsplit.bench.chaos", description=__doc__)
    parser.add_argument("--json", default="", help="write the report here")
    parser.add_argument("--model", default="smollm2-135m", help="target model")
    parser.add_argument("--draft-model", default="", help="draft model (empty: n-gram only)")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--max-concurrent", type=int, default=16, help="the orchestrator's admission limit")
    parser.add_argument("--seed", type=int, default=7, help="draws the fault schedule and the clients' requests")
    parser.add_argument("--fault-every-s", type=float, default=10.0, help="mean seconds between faults")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--deadline-s", type=float, default=120.0, help="each request's gRPC timeout")
    parser.add_argument("--grace-s", type=float, default=10.0, help="the orchestrator's drain on SIGTERM")
    parser.add_argument("--draft-timeout-s", type=float, default=1.0, help="the orchestrator's per-round draft deadline")
    parser.add_argument("--hosts", action="store_true",
                        help="run across hosts built in this machine (network namespaces; needs root): each replica, "
                             "the orchestrator and the clients on a host of their own; adds the partition fault")
    parser.add_argument("--replicas", type=int, default=None,
                        help="target and draft replicas each (default 2 with --hosts, else 1; more than 1: --hosts)")
    parser.add_argument("--kinds", default="",
                        help=f"fault kinds to draw, comma-separated (default every one: {', '.join(schedule.KINDS)}; "
                             "and partition with --hosts)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="specsplit-chaos-") as tmp:
        try:
            report = run(args, Path(tmp))
        except (ValueError, HostError) as exc:
            raise SystemExit(f"python -m specsplit.bench.chaos: {exc}") from None
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    keys = ("faults_by_kind", "requests_by_outcome", "tokens_checked", "leaked_sessions",
            "sessions_opened_per_replica", "rss_growth_after_warmup_pct", "latency_during_faults",
            "latency_without_faults", "ok")
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    for key in ("mismatches", "contradicted", "undocumented_failures", "wrong_failures", "hangs"):
        if report[key]:
            print(f"{key}: {len(report[key])}: {report[key][:5]}")
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
