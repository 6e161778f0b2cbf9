"""What a round costs on open text, by how the draft is asked, with draft and target on one CPU.

    python experiments/open_rounds/open_rounds.py --json experiments/open_rounds/open-rounds.json [--kinds prose,chat,code-write] [--repeats 2]
        [--decoding sampling|greedy] [--split dev|heldout]

The traffic bench's set-up (SmolLM2 target with 2 threads, n-gram drafter with 1, nothing pinned, the
orchestrator in this process), sampling at T 0.7 and top-p 0.95 with a seed per prompt (or greedy),
on the mixed set's open kinds, where drafts are rarely accepted. Each prompt runs target-only
(k = 0), adaptive K in sync, and adaptive K with overlap, interleaved, ``--repeats`` times. Per mode,
a round's wall time, draft requests (sent before a verification or ahead during one), drafted and
accepted tokens, the target's own compute (what the target service reports: did the forward get
slower, or did the time go around it?), and the CPU each process spent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
from collections import defaultdict
from pathlib import Path

import torch

from specsplit.bench.evaluation import run_one
from specsplit.bench.prompts import PROMPT_SETS
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import cpu_seconds, cpu_used, local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator

MODES = {"target-only": (0, False), "sync": (8, False), "overlap": (8, True)}  # name -> (k, overlap)


SAMPLING = {"temperature": 0.7, "top_p": 0.95}


async def _one(orch: Orchestrator, prompt, k: int, overlap: bool, seed: int, tokens: int, greedy: bool,
               pids: dict[str, int]) -> dict[str, float]:
    sampling = SamplingParams() if greedy else SamplingParams(**SAMPLING, seed=seed)
    cpu_before = cpu_seconds(pids)
    run = await run_one(orch, prompt, k, DrafterKind.NGRAM, tokens, sampling, adaptive_k=k > 0, overlap=overlap)
    cpu = {f"cpu_s_{name}": used for name, used in cpu_used(pids, cpu_before).items()}
    return {"wall_s": run.wall_s, "rounds": run.rounds, "tokens": len(run.token_ids), "drafted": run.drafted,
            "accepted": run.accepted, "target_compute_s": run.target_compute_s,
            "draft_compute_s": run.draft_compute_s, "draft_requests": run.draft_requests, **cpu}


async def _measure(target: str, draft: str, pids: dict[str, int], prompts, repeats: int, tokens: int,
                   greedy: bool) -> dict[str, dict[str, float]]:
    orch = await Orchestrator.connect(OrchestratorConfig(target_address=target, draft_address=draft,
                                                         tokenizer=models.DEFAULT_MODEL))
    totals: dict[str, dict[str, float]] = {name: defaultdict(float) for name in MODES}
    try:
        await _one(orch, prompts[0], 8, True, 0, 8, greedy, pids)  # warm-up
        for repeat in range(repeats):
            for i, prompt in enumerate(prompts):
                for name, (k, overlap) in MODES.items():
                    for key, value in (
                        await _one(orch, prompt, k, overlap, 1000 * repeat + i, tokens, greedy, pids)
                    ).items():
                        totals[name][key] += value
    finally:
        await orch.close()
    report = {}
    for name, t in totals.items():
        rounds = max(t["rounds"], 1)
        report[name] = {
            "tokens_per_s": round(t["tokens"] / t["wall_s"], 3),
            "ms_per_round": round(1e3 * t["wall_s"] / rounds, 2),
            "target_compute_ms_per_round": round(1e3 * t["target_compute_s"] / rounds, 2),
            "draft_requests_per_round": round(t["draft_requests"] / rounds, 3),
            "draft_compute_ms_per_request": round(1e3 * t["draft_compute_s"] / max(t["draft_requests"], 1), 3),
            **{f"cpu_ms_per_round_{name[6:]}": round(1e3 * t[name] / rounds, 2) for name in t if name.startswith("cpu_s_")},
            "rounds": int(t["rounds"]), "drafted": int(t["drafted"]), "accepted": int(t["accepted"]),
        }
    base = report["target-only"]["tokens_per_s"]
    for name in MODES:
        report[name]["x_target_only"] = round(report[name]["tokens_per_s"] / base, 3)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python experiments/open_rounds/open_rounds.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--kinds", default="prose,chat,code-write")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--split", default="dev", choices=("dev", "heldout"),
                        help="which split of the mixed set (tune on dev; heldout checks)")
    parser.add_argument("--decoding", default="sampling", choices=("sampling", "greedy"))
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    prompts = [p for p in PROMPT_SETS[f"mixed-{args.split}"] if p.kind in kinds]
    if not prompts:
        parser.error(f"--kinds {args.kinds}: no {args.split} prompt of these kinds")
    common = ["--device", "cpu", "--dtype", "float32"]
    target = ["--model", models.DEFAULT_MODEL, "--threads", "2", *common]
    with local_services(target, ["--threads", "1", *common]) as (t, d):
        pids = {"target": t.process.pid, "draft": d.process.pid, "orchestrator": os.getpid()}
        report = asyncio.run(_measure(t.address, d.address, pids, prompts, args.repeats, args.tokens,
                                     args.decoding == "greedy"))
    out = {"benchmark": "open_rounds", "split": args.split, "prompts": [p.name for p in prompts], "kinds": kinds, "repeats": args.repeats,
           "tokens": args.tokens, "sampling": None if args.decoding == "greedy" else SAMPLING,
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": torch.get_num_threads()},
           "modes": report}
    for name, figures in report.items():
        print(f"{name:12s} {figures}", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
