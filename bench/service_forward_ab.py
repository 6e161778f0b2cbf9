"""Target-only and speculative decoding through the services, with the fast forward and the stock one.

    python -m specsplit.bench.service_forward_ab --json bench/results/service-forward-ab.json [--prompts 6] [--tokens 32]

One run, the default pair (SmolLM2 target with 2 threads, n-gram drafter with
1), greedy, chat template, nothing pinned (as the traffic bench). For each
target forward (``serve-target`` as it runs by default, and with
``--stock-forward``) a target and a draft service are started and every prompt
is generated target-only (k = 0), with speculation (adaptive K <= 8, overlap),
and target-only again; tokens/s are the tokens over the seconds of each mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from pathlib import Path

import torch
from specsplit.bench.evaluation import run_one
from specsplit.bench.prompts import PROMPT_SETS
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.config import OrchestratorConfig
from specsplit.orchestrator.generation import Orchestrator

MODES = (("target-only", 0), ("speculative", 8), ("target-only again", 0))


async def _measure(target: str, draft: str, prompts, tokens: int) -> dict[str, float]:
    orch = await Orchestrator.connect(OrchestratorConfig(target_address=target, draft_address=draft,
                                                         tokenizer=models.DEFAULT_MODEL))
    try:
        await run_one(orch, prompts[0], 0, DrafterKind.NGRAM, 8, SamplingParams(), adaptive_k=True, overlap=True)
        figures = {}
        for name, k in MODES:
            runs = [await run_one(orch, p, k, DrafterKind.NGRAM, tokens, SamplingParams(), adaptive_k=True,
                                  overlap=True) for p in prompts]
            figures[name] = round(sum(len(r.token_ids) for r in runs) / sum(r.wall_s for r in runs), 3)
        return figures
    finally:
        await orch.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specsplit.bench.service_forward_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--prompts", type=int, default=6, help="the first N prompts of the held-out mixed split")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    common = ["--device", "cpu", "--dtype", "float32"]
    prompts = PROMPT_SETS["mixed-heldout"][: args.prompts]
    report = {"benchmark": "service_forward_ab", "prompts": [p.name for p in prompts], "tokens": args.tokens,
              "target_threads": 2, "machine": {"platform": platform.platform(), "torch": torch.__version__}}
    for forward, flags in (("fast", []), ("stock", ["--stock-forward"]), ("fast, again", [])):
        target = ["--model", models.DEFAULT_MODEL, "--threads", "2", *common, *flags]
        with local_services(target, ["--threads", "1", *common]) as (t, d):
            report[forward] = asyncio.run(_measure(t.address, d.address, prompts, args.tokens))
        print(forward, report[forward], flush=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
