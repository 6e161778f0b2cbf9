"""``specsplit bench --suite pools``: throughput and time to first token by the number of replicas in each pool.

``max(--pool-targets)`` target processes and ``max(--pool-drafts)`` draft processes (``runs.service_args``:
the bench's model, drafter, threads), started once. For each (targets, drafts) pair an orchestrator in this
process is given the first that many of each (``--target A,B --draft C,D``) and runs ``--pool-sessions``
generations of ``--max-new-tokens`` tokens at once, greedy, over the demo prompts. Reported per pair: the
aggregate tokens/s, the median and p95 time to first token, and how the sessions spread over the replicas
(each service's ``Stats.sessions_opened``). Pairs interleaved run by run, ``--pool-repeats`` times; medians.

Every replica shares this machine's cores with the others and the orchestrator, so on a small CPU host
more replicas divide the same cores (the figures then say what the pool costs, not what it gains); on
separate hosts or devices each replica brings its own.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from specsplit.bench import runs
from specsplit.bench.prompts import DEMO_PROMPTS, chat_ids
from specsplit.lmkit import event_loop, processes
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.peers import draft_client, target_client


def add_flags(parser) -> None:
    parser.add_argument("--pool-targets", default="1,2", help="--suite pools: target replica counts compared")
    parser.add_argument("--pool-drafts", default="1,2", help="--suite pools: draft replica counts compared")
    parser.add_argument("--pool-sessions", type=int, default=8, help="--suite pools: generations run at once")
    parser.add_argument("--pool-repeats", type=int, default=2,
                        help="--suite pools: interleaved runs per pair; medians are reported")


def counts(text: str, flag: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: replica counts >= 1, got {text!r}")
    return values


async def opened(addresses: list[str], client) -> list[int]:
    """``Stats.sessions_opened`` of each service at ``addresses`` (``client``: ``peers.target_client`` or
    ``draft_client``): how many sessions it has opened since it started."""
    out = []
    for address in addresses:
        peer = client(address)
        try:
            out.append((await peer.stats()).sessions_opened)
        finally:
            await peer.close()
    return out


async def one_run(orch: Orchestrator, prompts: list[list[int]], args) -> dict:
    drafter = DrafterKind[args.drafter.upper()]
    request = GenerationRequest("", False, args.max_new_tokens, SamplingParams(ignore_eos=True), (), args.k,
                                drafter, args.fixed_k, overlap=not args.no_overlap)
    firsts: list[float] = []
    tokens = 0
    started = time.perf_counter()

    async def one(ids: list[int]) -> None:
        nonlocal tokens
        first = None
        async for event in orch.generate(request, ids):
            if event.token_ids and first is None:
                first = time.perf_counter() - started
            tokens += len(event.token_ids)
        firsts.append(first if first is not None else float("nan"))

    await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(args.pool_sessions)))
    wall = time.perf_counter() - started
    firsts.sort()
    return {"tokens_per_s": round(tokens / wall, 1), "ttft_median_s": round(statistics.median(firsts), 3),
            "ttft_p95_s": round(firsts[min(len(firsts) - 1, int(0.95 * len(firsts)))], 3)}


async def measure(targets: list[str], drafts: list[str], pairs: list[tuple[int, int]], args) -> dict:
    tokenizer = args.model
    orchs = {}
    for t, d in pairs:
        config = OrchestratorConfig(",".join(targets[:t]), ",".join(drafts[:d]), tokenizer=tokenizer)
        orchs[(t, d)] = await Orchestrator.connect(config)
    prompts = [chat_ids(orchs[pairs[0]].tokenizer, p) for p in DEMO_PROMPTS]
    rows: dict[tuple[int, int], list[dict]] = {pair: [] for pair in pairs}
    spread: dict[tuple[int, int], list[list[int]]] = {}
    try:
        for orch in orchs.values():  # warm-up: first calls pay one-off allocations
            await one_run(orch, prompts[:1], args)
        for repeat in range(args.pool_repeats):
            order = pairs if repeat % 2 == 0 else pairs[::-1]
            for pair in order:
                before_t, before_d = await opened(targets, target_client), await opened(drafts, draft_client)
                rows[pair].append(await one_run(orchs[pair], prompts, args))
                after_t, after_d = await opened(targets, target_client), await opened(drafts, draft_client)
                spread[pair] = [[b - a for a, b in zip(before_t, after_t)], [b - a for a, b in zip(before_d, after_d)]]
    finally:
        for orch in orchs.values():
            await orch.close()
    name = {pair: f"{pair[0]}t{pair[1]}d" for pair in pairs}
    return {
        "runs": {name[p]: r for p, r in rows.items()},
        "medians": {name[p]: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for p, rs in rows.items()},
        "sessions_per_replica_last_run": {name[p]: {"targets": s[0], "drafts": s[1]} for p, s in spread.items()},
    }


def run(args) -> int:
    started = time.time()
    target_counts = counts(args.pool_targets, "--pool-targets")
    draft_counts = counts(args.pool_drafts, "--pool-drafts")
    pairs = [(t, d) for t in target_counts for d in draft_counts]
    target_args, draft_args = runs.service_args(args)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specsplit-pools-")))

        def start(module: str, name: str, argv: list[str]):
            service = processes.start_service(module, name, argv, workdir)
            stack.callback(service.stop)
            return service

        targets = [start("specsplit.target_service.server", f"target-{i}", target_args)
                   for i in range(max(target_counts))]
        drafts = [start("specsplit.draft_service.server", f"draft-{i}", draft_args) for i in range(max(draft_counts))]
        result = event_loop.run(measure([t.address for t in targets], [d.address for d in drafts], pairs, args))
    report = {
        "benchmark": "pools",
        "model": args.model,
        "draft_model": args.draft_model,
        "drafter": args.drafter,
        "setup": (f"{args.pool_sessions} greedy generations of {args.max_new_tokens} tokens at once over the demo "
                  f"prompts; target replicas {target_counts}, draft replicas {draft_counts}, all on this machine "
                  f"(target threads {args.target_threads}, draft threads {args.draft_threads}); pairs interleaved"),
        "machine": runs.machine(),
        **result,
        "duration_s": round(time.time() - started, 1),
    }
    path = runs.write(report, args.json)
    for name, m in result["medians"].items():
        spread = result["sessions_per_replica_last_run"][name]
        print(f"{name}: {m['tokens_per_s']:.1f} tok/s, TTFT median {m['ttft_median_s']:.2f} s, "
              f"p95 {m['ttft_p95_s']:.2f} s; sessions per target {spread['targets']}, per draft {spread['drafts']}")
    print(f"-> {path}")
    return 0
