"""Token trees against chains, and the fast verify forward against the stock one, end to end.

    python experiments/trees/trees.py --json experiments/trees/trees-demo.json [--prompt-set demo] [--repeats 2]

The default pair (SmolLM2 target, n-gram drafter), greedy, chat template. Two targets run as
processes on the same core, used one at a time: the fast forward (what ``serve-target`` runs) and
``--stock-forward``, with the draft on the other core. Per prompt and repeat the modes run back to
back, their order rotated: ``stock target-only`` and ``stock chain``; ``target-only`` (k = 0 on the
fast target, the baseline of every ratio); ``chain`` (adaptive K, ``tree_branches`` = 1); ``tree``
(adaptive K, up to ``--branches`` continuations, the nodes kept by ``specsplit.orchestrator.decode.policy``);
``tree, fixed K`` (every node the drafter offers at K = ``--k``). Reported per kind and overall:
tokens/s (tokens over wall time, summed), ratios, acceptance, tree rounds and the tokens accepted off
a tree's primary chain, and whether every output equals fast target-only decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from specsplit.bench.prompts import PROMPT_SETS
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator


@dataclass(frozen=True)
class Mode:
    name: str
    stock: bool  # on the --stock-forward target
    k: int
    adaptive: bool = True
    branches: int = 1


async def _generate(orch: Orchestrator, ids: list[int], mode: Mode, max_new: int, overlap: bool) -> dict:
    request = GenerationRequest(
        "", True, max_new, SamplingParams(), (), mode.k, DrafterKind.NGRAM, False, mode.adaptive,
        overlap=overlap, tree_branches=mode.branches,
    )
    tokens: list[int] = []
    async for event in orch.generate(request, ids):
        tokens.extend(event.token_ids)
        if event.stats is not None:
            s = event.stats
            return {
                "tokens": tokens, "wall_s": s.wall_s, "rounds": s.rounds, "drafted": s.drafted_tokens,
                "accepted": s.accepted_tokens, "tree_rounds": s.tree_rounds, "tree_nodes": s.tree_nodes,
                "branch_accepted": s.branch_accepted,
            }
    raise RuntimeError("generation ended without stats")


def _sum(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs)


def _figures(runs: list[dict], baseline: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in runs)
    rate = tokens / _sum(runs, "wall_s")
    base = sum(len(r["tokens"]) for r in baseline) / _sum(baseline, "wall_s")
    return {
        "tokens_per_s": round(rate, 3),
        "vs_target_only": round(rate / base, 3),
        "tokens": tokens,
        "rounds": int(_sum(runs, "rounds")),
        "tokens_per_round": round(tokens / max(_sum(runs, "rounds"), 1), 3),
        "drafted": int(_sum(runs, "drafted")),
        "accepted": int(_sum(runs, "accepted")),
        "tree_rounds": int(_sum(runs, "tree_rounds")),
        "tree_nodes": int(_sum(runs, "tree_nodes")),
        "branch_accepted": int(_sum(runs, "branch_accepted")),
    }


async def _measure(args, fast: str, stock: str, draft: str) -> dict:
    modes = [
        Mode("stock target-only", True, 0), Mode("stock chain", True, args.k),
        Mode("target-only", False, 0), Mode("chain", False, args.k),
        Mode("tree", False, args.k, branches=args.branches),
        Mode("tree, fixed K", False, args.k, adaptive=False, branches=args.branches),
    ]
    if args.no_stock:
        modes = [m for m in modes if not m.stock]
    orchs = {
        True: await Orchestrator.connect(OrchestratorConfig(stock, draft, tokenizer=args.model)) if stock else None,
        False: await Orchestrator.connect(OrchestratorConfig(fast, draft, tokenizer=args.model)),
    }
    prompts = PROMPT_SETS[args.prompt_set]
    runs: dict[str, list[dict]] = {m.name: [] for m in modes}
    try:
        for orch in filter(None, orchs.values()):  # warm each target and seed its cost model
            await _generate(orch, orch.encode(prompts[0].text, True), Mode("warm", False, args.k), 24, not args.no_overlap)
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                ids = orchs[False].encode(prompt.text, True)
                shift = (i + repeat) % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    run = await _generate(orchs[mode.stock], ids, mode, args.max_new_tokens, not args.no_overlap)
                    runs[mode.name].append({**run, "prompt": prompt.name, "kind": prompt.kind, "repeat": repeat})
    finally:
        for orch in filter(None, orchs.values()):
            await orch.close()
    reference = {(r["prompt"], r["repeat"]): r["tokens"] for r in runs["target-only"]}
    kinds = ["all", *sorted({p.kind for p in prompts})]
    report = {}
    for kind in kinds:
        pick = {name: [r for r in rs if kind == "all" or r["kind"] == kind] for name, rs in runs.items()}
        report[kind] = {name: _figures(rs, pick["target-only"]) for name, rs in pick.items()}
        for name in report[kind]:
            report[kind][name]["identical_to_target_only"] = sum(
                r["tokens"] == reference[(r["prompt"], r["repeat"])] for r in pick[name]
            )
        if "chain" in report[kind] and "tree" in report[kind]:
            report[kind]["tree_vs_chain"] = round(
                report[kind]["tree"]["tokens_per_s"] / report[kind]["chain"]["tokens_per_s"], 3
            )
    return {"by_kind": report, "modes": [m.__dict__ for m in modes]}


def run(args) -> dict:
    common = ["--threads", str(args.target_threads), "--cpus", args.target_cpus]
    target = ["--model", args.model, *common]
    draft = ["--threads", "1", "--cpus", args.draft_cpus]
    with local_services(target, draft) as (fast, drafter):
        if args.no_stock:
            measured = asyncio.run(_measure(args, fast.address, "", drafter.address))
        else:
            with local_services([*target, "--stock-forward"], None) as (stock,):
                measured = asyncio.run(_measure(args, fast.address, stock.address, drafter.address))
    return {
        "benchmark": "token_trees",
        "target": args.model,
        "drafter": "ngram",
        "prompt_set": args.prompt_set,
        "decoding": "greedy",
        "k": args.k,
        "branches": args.branches,
        "overlap": not args.no_overlap,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "target_cpus": args.target_cpus,
        "target_threads": args.target_threads,
        "draft_cpus": args.draft_cpus,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        **measured,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python experiments/trees/trees.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--prompt-set", default="demo", choices=sorted(PROMPT_SETS))
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--no-stock", action="store_true", help="skip the --stock-forward target")
    parser.add_argument("--target-cpus", default="1")
    parser.add_argument("--target-threads", type=int, default=1)
    parser.add_argument("--draft-cpus", default="0")
    args = parser.parse_args(argv)
    report = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for kind, figures in report["by_kind"].items():
        line = ", ".join(f"{name} {f['vs_target_only']}x" for name, f in figures.items() if isinstance(f, dict))
        print(f"[{kind}] {line}; tree/chain {figures.get('tree_vs_chain')}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
