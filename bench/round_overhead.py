"""Per-round overhead of the split: wire, serialization and Python, against the compute it wraps.

    python -m specsplit.bench.round_overhead --json bench/results/round-overhead.json

Draft and target run as separate processes on loopback with a tiny model
(near-zero compute), so the wall time of a round minus the compute the services
report is what the split itself costs; compare it with one target forward of a
real model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.config import OrchestratorConfig
from specsplit.orchestrator.generation import GenerationRequest, Orchestrator


def tiny_model(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specsplit.lmkit import models

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    models.load_tokenizer(models.DEFAULT_MODEL).save_pretrained(path)
    return path


async def measure(target: str, draft: str, model: str, rounds: int, k: int, drafter: DrafterKind,
                  adaptive: bool = False) -> dict:
    orch = await Orchestrator.connect(OrchestratorConfig(target, draft, tokenizer=model))
    walls, computes, requests, loop_rounds = [], [], 0, 0
    try:
        for _ in range(3):
            request = GenerationRequest("", False, rounds * (k + 1), SamplingParams(), (), k, drafter, False, adaptive)
            start = time.perf_counter()
            last = start
            async for event in orch.generate(request, [1, 2, 3, 4]):
                now = time.perf_counter()
                walls.append(now - last)
                last = now
                if event.stats is not None:
                    computes.append((event.stats.draft_compute_s + event.stats.target_compute_s) / event.stats.rounds)
                if event.loop is not None:
                    requests, loop_rounds = requests + event.loop.draft_requests, loop_rounds + event.loop.rounds
    finally:
        await orch.close()
    walls = walls[1:]  # the first round carries the session opens
    return {
        "k": k,
        "drafter": drafter.name.lower(),
        "adaptive_k": adaptive,
        "draft_requests_per_round": round(requests / max(loop_rounds, 1), 3),
        "rounds": len(walls),
        "round_wall_ms_median": round(statistics.median(walls) * 1e3, 3),
        "round_wall_ms_p90": round(statistics.quantiles(walls, n=10)[-1] * 1e3, 3),
        "service_compute_ms_mean": round(statistics.mean(computes) * 1e3, 3),
        "overhead_ms_median": round((statistics.median(walls) - statistics.mean(computes)) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp) / "tiny"))
        args_t = ["--model", model, "--threads", "1"]
        args_d = ["--model", model, "--threads", "1"]
        with local_services(args_t, args_d) as (target, draft):
            results = [
                asyncio.run(measure(target.address, draft.address, model, args.rounds, k, kind, adaptive))
                # the adaptive n-gram session: a free block of this near-zero-compute target saves less than the
                # draft's round trip, so its rounds are k = 0 rounds through a speculative session
                for k, kind, adaptive in [(0, DrafterKind.NGRAM, False), (4, DrafterKind.NGRAM, False),
                                          (4, DrafterKind.MODEL, False), (4, DrafterKind.NGRAM, True)]
            ]
    report = {"benchmark": "round_overhead", "transport": "grpc.aio bidi streams on 127.0.0.1", "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(r)


if __name__ == "__main__":
    main()
