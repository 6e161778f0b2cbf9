"""Time to first token of a fresh orchestrator's sessions, one after another, with a model drafter.

    python -m specsplit.bench.first_blocks --json bench/results/first-blocks.json [--sessions 8] [--k 3] [--overlap]

The network suite's placement (SmolLM2 target on core 1 with one thread, the
int8 self-draft on core 0 with the orchestrator, this process) and fixed K: a
session's first round asks the draft for a block before the target's prefill,
and the draft reads the context from the open on (``Drafter.prepare``). Per
session, in order: the time to its first token, and how long the orchestrator
was willing to wait for that first block (0: not waited for; the draft timeout
while the orchestrator has no target step to price a block by). The first
sessions of an orchestrator are where the cost model knows least.
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
from specsplit.bench.prompts import PROMPT_SETS, chat_ids
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator import links
from specsplit.orchestrator.config import OrchestratorConfig
from specsplit.orchestrator.generation import GenerationRequest, Orchestrator


async def _sessions(target: str, draft: str, prompts, k: int, overlap: bool, tokens: int) -> list[dict]:
    waits: list[float] = []
    send = links.DraftLink.send

    def recorded(link, committed, assumed, *args, **kwargs):  # the wait granted to each session's first block
        first = link._cold
        call = send(link, committed, assumed, *args, **kwargs)
        if first and call is not None:
            waits.append(max(call.deadline - asyncio.get_running_loop().time(), 0.0))
        return call

    links.DraftLink.send = recorded
    orch = await Orchestrator.connect(OrchestratorConfig(target, draft, tokenizer=models.DEFAULT_MODEL))
    out = []
    try:
        for prompt in prompts:
            request = GenerationRequest(prompt.text, True, tokens, SamplingParams(), (), k, DrafterKind.QUANTIZED,
                                        False, False, overlap=overlap)
            start, first = time.perf_counter(), None
            async for event in orch.generate(request, chat_ids(orch.tokenizer, prompt)):
                if first is None and event.token_ids:
                    first = time.perf_counter() - start
            out.append({"prompt": prompt.name, "ttft_s": round(first, 3), "first_block_wait_s": round(waits[-1], 3)
                        if len(waits) == len(out) + 1 else None})
    finally:
        links.DraftLink.send = send
        await orch.close()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specsplit.bench.first_blocks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per session")
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args(argv)
    mixed = PROMPT_SETS["mixed"]
    prompts = [mixed[i % len(mixed)] for i in range(args.sessions)]
    common = ["--device", "cpu", "--dtype", "float32", "--max-sessions", "16"]
    target = ["--model", models.DEFAULT_MODEL, "--threads", "1", "--cpus", "1", *common]
    draft = ["--model", models.DEFAULT_MODEL, "--quantize", "int8-dynamic", "--threads", "1", "--cpus", "0", *common]
    with local_services(target, draft) as (t, d):
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {0})
        sessions = asyncio.run(_sessions(t.address, d.address, prompts, args.k, args.overlap, args.tokens))
    out = {"benchmark": "first_blocks", "k": args.k, "overlap": args.overlap, "tokens": args.tokens,
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
           "sessions": sessions}
    for s in sessions:
        print(s, flush=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
