"""``specsplit bench --json PATH``: specsplit against target-only and HF anchors on a prompt set, per kind.

Every contender (target-only through the same target service, specsplit,
``model.generate``, and Hugging Face prompt lookup at each ``--hf-lookup`` N)
generates every prompt, interleaved (``bench/traffic.py``), greedy and/or
sampling. Services are started as separate processes on loopback;
``--target-cpus``/``--draft-cpus`` pin them to different cores (they stand for
separate devices); the HF anchors run in this process with the target's threads.
``--suite network`` measures the speedup against emulated links' round trips
(``bench/network.py``).
"""

from __future__ import annotations

import argparse
import time

from specsplit.bench import (
    abuse,
    demo,
    interleaved,
    network,
    overhead,
    pools,
    prefill,
    runs,
    speed,
    step,
    structured,
    traffic,
)
from specsplit.bench.prompts import PROMPT_SETS
from specsplit.lmkit import event_loop
from specsplit.lmkit.processes import local_services
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    demo.build_parser(parser)
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument(
        "--suite", default="compare", choices=["compare", "speed", "interleaved", "network", "overhead", "structured", "step", "prefill",
                                     "pools", "abuse"],
        help="compare: contenders per kind on a prompt set; speed: the same on both decodings, concurrency, plot; "
             "interleaved: several --drafters against target-only, prompt by prompt, in one run; "
             "network: speedup vs emulated link round trip, sync/overlap, fixed/adaptive K, plot; "
             "overhead: what the split costs a round and a token with a near-zero model, against GPU steps; "
             "structured: JSON-schema extraction, constrained target-only vs n-gram drafts plus forced tokens; "
             "step: the target's packed forward by width and batch, transformers' forward vs the decoder step, "
             "eager and compiled; prefill: other sessions' inter-token gaps while a long prompt prefills, by "
             "the target's --prefill-chunk; pools: tokens/s and time to first token by the number of target "
             "and draft replicas in each pool; abuse: /health latency and each process's memory while the HTTP "
             "front is probed (large prompts, chunked bodies, slowloris, unauthenticated floods, stalled readers)",
    )
    speed.add_flags(parser)
    interleaved.add_flags(parser)
    network.add_flags(parser)
    overhead.add_flags(parser)
    structured.add_flags(parser)
    step.add_flags(parser)
    prefill.add_flags(parser)
    pools.add_flags(parser)
    abuse.add_flags(parser)
    parser.add_argument("--target-cpus", default="", help="pin the target to these CPUs, e.g. '0,1'")
    parser.add_argument("--draft-cpus", default="", help="pin the draft to these CPUs")
    parser.add_argument(
        "--prompt-set", default="mixed", choices=sorted(PROMPT_SETS),
        help="mixed: 55 prompts of 11 kinds (mixed-dev / mixed-heldout: its two splits); demo: the 8 demo prompts; "
             "drafters: 4 code-edit + 4 free-text prompts; mix: the demo prompts plus 4 more open prose prompts (EAGLE)",
    )
    parser.add_argument("--decoding", default="both", choices=sorted(traffic.DECODINGS),
                        help="both (a sampling row beside greedy), greedy, or sampling (T 0.7, top-p 0.95, a seed "
                             "per prompt); --suite interleaved runs one: sampling if asked, else greedy")
    parser.add_argument("--hf-lookup", default="3,8", help="HF prompt_lookup_num_tokens values to run ('' = none)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face anchors")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved passes over the prompt set")
    return parser


async def measure_traffic(args, target_address: str, draft_address: str, decodings, model) -> dict:
    config = OrchestratorConfig(target_address=target_address, draft_address=draft_address, tokenizer=args.model,
                                ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    orch = await Orchestrator.connect(config)
    settings = runs.settings_of(args)
    try:
        measured = await traffic.measure(orch, model, PROMPT_SETS[args.prompt_set], settings, decodings)
    finally:
        await orch.close()
    return traffic.report(measured, settings)


def run(args) -> int:
    if args.suite == "speed":
        return speed.run(args)
    if args.suite == "interleaved":
        return interleaved.run(args)
    if args.suite == "network":
        return network.run(args)
    if args.suite == "overhead":
        return overhead.run(args)
    if args.suite == "structured":
        return structured.run(args)
    if args.suite == "step":
        return step.run(args)
    if args.suite == "prefill":
        return prefill.run(args)
    if args.suite == "pools":
        return pools.run(args)
    if args.suite == "abuse":
        return abuse.run(args)
    started = time.time()
    model = None if args.no_hf else runs.load_anchor_model(args)
    with local_services(*runs.service_args(args)) as (target, draft):
        result = event_loop.run(
            measure_traffic(args, target.address, draft.address, traffic.DECODINGS[args.decoding], model))
    report = {"benchmark": "traffic", **runs.header(args), **result, "duration_s": round(time.time() - started, 1)}
    path = runs.write(report, args.json)
    traffic.print_rows(result)
    print(f"-> {path}")
    return 0
