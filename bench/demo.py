"""``specsplit demo``: draft and target as separate processes on loopback, a few prompts, the figures.

Every prompt runs twice through the same target service: target-only
(k = 0) and speculative. Greedy output must be identical; the demo says so.
"""

from __future__ import annotations

import argparse

from specsplit.bench.evaluation import compare, summarise
from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.draft_service import medusa
from specsplit.draft_service.eagle_head import BUNDLED
from specsplit.lmkit import event_loop, models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.orchestrator.api.config import DEFAULT_DRAFTER, DEFAULT_K, OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="target model reference")
    parser.add_argument("--draft-model", default="", help="draft model for --drafter model")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER.name.lower(), choices=[k.name.lower() for k in DrafterKind])
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="draft block size (upper bound unless --fixed-k)")
    parser.add_argument("--fixed-k", action="store_true", help="draft exactly k per round (no adaptive k)")
    parser.add_argument("--no-overlap", action="store_true", help="draft and verify in turn (no pipelined drafting)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ngram-min", type=int, default=OrchestratorConfig.ngram_min, help="n-gram drafter: shortest match")
    parser.add_argument("--ngram-max", type=int, default=OrchestratorConfig.ngram_max, help="n-gram drafter: longest match")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for the target (gloo on CPU)")
    parser.add_argument("--target-threads", type=int, default=2)
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=models.AUTO_DTYPE, help="auto: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--layerskip-layers", type=int, default=4, help="--drafter layerskip: layers kept")
    parser.add_argument("--layerskip-adapter", default="", help="--drafter layerskip: exit adapter from distill")
    parser.add_argument("--quantize", default="int8", help="--drafter quantized: int8 or int8-weight")
    parser.add_argument(
        "--eagle-head", default="",
        help=f"--drafter eagle: a head folder (default: the bundled head for {', '.join(sorted(BUNDLED))})",
    )
    parser.add_argument(
        "--medusa-head", default="",
        help=f"--drafter medusa: a folder of Medusa heads (default: the bundled heads for {', '.join(sorted(medusa.BUNDLED))})",
    )
    parser.add_argument(
        "--chain", default="ngram,quantized",
        help="--drafter chain: members tried in order each round (comma-separated drafter names)",
    )
    return parser


def chain_members(args) -> tuple[DrafterKind, ...]:
    """The --chain flag as drafter kinds (only meaningful with --drafter chain)."""
    if args.drafter != "chain":
        return ()
    try:
        members = tuple(DrafterKind[name.strip().upper()] for name in args.chain.split(",") if name.strip())
    except KeyError as exc:
        raise ValueError(f"--chain: unknown drafter {exc}; use names from {[k.name.lower() for k in DrafterKind]}") from None
    # demo and bench send no explicit chain: the orchestrator's default chain (n-gram, then the one
    # model drafter this draft service is started with) is what these flags describe.
    if len(members) != 2 or members[0] is not DrafterKind.NGRAM or members[1] in (DrafterKind.NGRAM, DrafterKind.CHAIN):
        raise ValueError("--chain must be ngram followed by one model drafter, e.g. ngram,quantized or ngram,layerskip")
    return members


def self_draft_flags(args) -> list[str]:
    """serve-draft flags for the self-drafters the chosen drafter (or chain) uses, derived from the target."""
    kinds = {DrafterKind[args.drafter.upper()], *chain_members(args)}
    flags = []
    if DrafterKind.LAYERSKIP in kinds:
        flags += ["--layerskip-adapter", args.layerskip_adapter] if args.layerskip_adapter else [
            "--layerskip-layers", str(args.layerskip_layers)
        ]
    if DrafterKind.QUANTIZED in kinds:
        flags += ["--quantize", args.quantize]
    if DrafterKind.EAGLE in kinds:
        if not args.eagle_head and args.model not in BUNDLED:
            raise ValueError(f"--drafter eagle: no head is bundled for {args.model}; pass --eagle-head DIR "
                             "(train one with `specsplit distill --eagle`)")
        flags += ["--eagle-head", args.eagle_head or args.model]  # a bundled head is named by its target
    if DrafterKind.MEDUSA in kinds:
        if not args.medusa_head and args.model not in medusa.BUNDLED:
            raise ValueError(f"--drafter medusa: no heads are bundled for {args.model}; pass --medusa-head DIR (train "
                             "them with `specsplit distill --medusa`)")
        flags += ["--medusa-head", args.medusa_head or args.model]  # bundled heads are named by their target
    return flags


def service_args(args) -> tuple[list[str], list[str]]:
    common = ["--device", args.device, "--dtype", args.dtype]
    target = ["--model", args.model, "--threads", str(args.target_threads), "--tp", str(args.tp), *common]
    draft = ["--threads", str(args.draft_threads), *common]
    derived = self_draft_flags(args)
    if derived and args.draft_model:
        raise ValueError("self-drafters derive from the target; drop --draft-model for layerskip/quantized")
    if args.draft_model:
        draft += ["--model", args.draft_model]
    elif derived:
        draft += ["--model", args.model, *derived]
    return target, draft


async def _run(args, target_address: str, draft_address: str) -> int:
    config = OrchestratorConfig(target_address=target_address, draft_address=draft_address, tokenizer=args.model)
    orch = await Orchestrator.connect(config)
    try:
        drafter = DrafterKind[args.drafter.upper()]
        results = await compare(
            orch, DEMO_PROMPTS, args.k, drafter, args.max_new_tokens, adaptive_k=not args.fixed_k,
            overlap=not args.no_overlap,
        )
    finally:
        await orch.close()
    for c in results:
        s = c.speculative
        print(f"\n=== {c.prompt.name} ({c.prompt.kind}) ===")
        print(s.text.strip())
        rate = s.accepted / s.drafted if s.drafted else 0.0
        print(
            f"--- {len(s.token_ids)} tokens, {s.rounds} target passes, acceptance {rate:.2f}, "
            f"{len(s.token_ids) / s.wall_s:.1f} tok/s vs {len(c.baseline.token_ids) / c.baseline.wall_s:.1f} "
            f"target-only, identical to target-only: {'yes' if c.identical else 'NO'}"
        )
    k_mode = "fixed" if args.fixed_k else "adaptive, at most"
    drafting = "in turn with verification" if args.no_overlap else "overlapped with verification"
    print(
        f"\nspecsplit demo: target {args.model} (tp={args.tp}), drafter {args.drafter}, k {k_mode} {args.k}, "
        f"drafting {drafting}, greedy"
    )
    for name, g in summarise(results).items():
        print(
            f"[{name:8s}] prompts {g.prompts}  acceptance rate {g.acceptance_rate:.2f}  "
            f"mean accepted length {g.mean_accepted_length:.2f}  "
            f"tokens/s {g.tokens_per_s_speculative:.1f} (target-only {g.tokens_per_s_target_only:.1f})  "
            f"speedup {g.speedup:.2f}x  identical {g.identical}/{g.prompts}"
        )
    return 0 if all(c.identical for c in results) else 1


def run(args) -> int:
    target_args, draft_args = service_args(args)
    print("starting target and draft services on loopback (first run converts the model, ~30 s)...", flush=True)
    with local_services(target_args, draft_args) as (target, draft):
        return event_loop.run(_run(args, target.address, draft.address))
