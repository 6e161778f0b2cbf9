"""``specsplit bench --json PATH``: speculative vs target-only decoding on the demo prompts, as JSON.

Both decodings run in one process against the same target service (k = 0 is
target-only), on the same prompts and token budget, greedy. Services are
started as separate processes on loopback; ``--target-cpus``/``--draft-cpus``
pin them to different cores (they stand for separate devices).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench import demo, interleaved, speed
from bench.evaluation import Summary, compare, summarise, theoretical_speedup
from bench.prompts import PROMPT_SETS
from lmkit.kinds import DrafterKind
from lmkit.processes import local_services
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Orchestrator


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    demo.build_parser(parser)
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument(
        "--suite", default="compare", choices=["compare", "speed", "interleaved"],
        help="compare: speculative vs target-only on a prompt set; speed: modes, K sweep, concurrency, HF anchors, "
             "plot; interleaved: several --drafters against target-only, prompt by prompt, in one run",
    )
    speed.add_flags(parser)
    interleaved.add_flags(parser)
    parser.add_argument("--target-cpus", default="", help="pin the target to these CPUs, e.g. '0,1'")
    parser.add_argument("--draft-cpus", default="", help="pin the draft to these CPUs")
    parser.add_argument(
        "--prompt-set", default="demo", choices=sorted(PROMPT_SETS),
        help="demo: the 8 demo prompts; drafters: 4 code-edit + 4 free-text prompts (drafter comparison); "
             "mix: the demo prompts plus 4 more open prose prompts (EAGLE)",
    )
    return parser


def figures(g: Summary, k: int) -> dict:
    c = g.draft_cost_ratio
    return {
        "prompts": g.prompts,
        "prompt_names": g.names,
        "new_tokens": g.new_tokens,
        "tokens_per_s_target_only": round(g.tokens_per_s_target_only, 3),
        "tokens_per_s_speculative": round(g.tokens_per_s_speculative, 3),
        "speedup": round(g.speedup, 3),
        "acceptance_rate": round(g.acceptance_rate, 4),
        "mean_accepted_length": round(g.mean_accepted_length, 3),
        "draft_cost_ratio": round(c, 4),
        "theoretical_speedup": round(theoretical_speedup(g.acceptance_rate, k, c), 3),
        "rounds": g.rounds,
        "drafted_tokens": g.drafted,
        "mean_drafted_per_round": round(g.drafted / g.rounds, 3) if g.rounds else 0.0,
        "accepted_tokens": g.accepted,
        "identical_to_target_only": g.identical,
        "feature_bytes_per_round": round(g.feature_bytes / g.rounds, 1) if g.rounds else 0.0,
    }


async def _measure(args, target_address: str, draft_address: str) -> dict:
    config = OrchestratorConfig(target_address=target_address, draft_address=draft_address, tokenizer=args.model)
    orch = await Orchestrator.connect(config)
    try:
        drafter = DrafterKind[args.drafter.upper()]
        prompts = PROMPT_SETS[args.prompt_set]
        results = await compare(
            orch, prompts, args.k, drafter, args.max_new_tokens, adaptive_k=not args.fixed_k,
            overlap=not args.no_overlap,
        )
    finally:
        await orch.close()
    groups = summarise(results)
    report = {"k": args.k, "adaptive_k": not args.fixed_k, "overlap": not args.no_overlap,
              **figures(groups["all"], args.k)}
    report["by_kind"] = {name: figures(g, args.k) for name, g in groups.items() if name != "all"}
    report["per_prompt"] = [
        {
            "name": c.prompt.name,
            "kind": c.prompt.kind,
            "new_tokens": len(c.speculative.token_ids),
            "speculative_s": round(c.speculative.wall_s, 4),
            "target_only_s": round(c.baseline.wall_s, 4),
            "rounds": c.speculative.rounds,
            "drafted": c.speculative.drafted,
            "accepted": c.speculative.accepted,
            "identical": c.identical,
        }
        for c in results
    ]
    return report


def pin(args, target_args: list[str], draft_args: list[str]) -> None:
    """--target-cpus / --draft-cpus as the services' own --cpus flags."""
    if args.target_cpus:
        target_args += ["--cpus", args.target_cpus]
    if args.draft_cpus:
        draft_args += ["--cpus", args.draft_cpus]


def run(args) -> int:
    if args.suite == "speed":
        return speed.run(args)
    if args.suite == "interleaved":
        return interleaved.run(args)
    target_args, draft_args = demo.service_args(args)
    pin(args, target_args, draft_args)
    started = time.time()
    with local_services(target_args, draft_args) as (target, draft):
        report = asyncio.run(_measure(args, target.address, draft.address))
    report = {
        "benchmark": "speculative_vs_target_only",
        "target": args.model,
        "drafter": args.drafter,
        "draft_model": args.draft_model or None,
        "self_draft_flags": demo.self_draft_flags(args) if not args.draft_model else [],
        "chain": [k.name.lower() for k in demo.chain_members(args)],
        "prompt_set": args.prompt_set,
        "decoding": "greedy",
        "max_new_tokens": args.max_new_tokens,
        "tp": args.tp,
        "target_threads": args.target_threads,
        "draft_threads": args.draft_threads,
        "target_cpus": args.target_cpus or "unpinned",
        "draft_cpus": args.draft_cpus or "unpinned",
        **report,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "duration_s": round(time.time() - started, 1),
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"speedup {report['speedup']:.2f}x  acceptance {report['acceptance_rate']:.2f}  "
        f"mean accepted length {report['mean_accepted_length']:.2f}  "
        f"({report['tokens_per_s_speculative']:.1f} vs {report['tokens_per_s_target_only']:.1f} tok/s) -> {path}"
    )
    return 0
