"""``specsplit bench --suite interleaved``: several drafters on one prompt set, in one run, prompt by prompt.

    specsplit bench --suite interleaved --drafters ngram,eagle,ngram+eagle,quantized --prompt-set mix \\
        --json bench/results/drafters-mix.json --target-cpus 1 --draft-cpus 0 --target-threads 1

One target service and one draft service (serving every drafter named) stay up
for the whole run. For each prompt, target-only decoding (k = 0) runs first,
then each drafter in turn, so slow drift of a shared machine touches every
column alike; ratios are read within the run. Each drafter (and target-only)
drives its own orchestrator, so adaptive K's cost model learns that drafter's
draft cost alone. ``a+b`` names a chain (``ngram+eagle``: n-gram first, eagle
where it finds nothing); ``name@k`` drafts exactly k tokens a round (else K is
adaptive up to ``--k``, or fixed with ``--fixed-k``); ``name/b`` verifies token trees of
up to b branches (else ``--tree-branches``: by default what ``specsplit serve`` gives a
request, trees where drafter and mode take them; 1: chains). Greedy, or sampled with
``--decoding sampling`` (T 0.7, top-p 0.95, a seed per prompt shared by every
contender: under coupled verification, the default, the seed fixes the text);
every output is compared with target-only's.

Each contender calls the services under a bearer token of its own, so a recycling drafter's table (one per
caller, kept across requests) holds the target's successors of that contender's own text only, never those
of the contenders run before it on the same prompt. ``--warm-prompt-set`` first runs each contender that
recycles over another prompt set, as a caller's table is warm from its earlier requests in service.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specsplit.bench import demo, runs, traffic
from specsplit.bench.evaluation import Comparison, Summary, best_fixed_k, run_one, summarise, theoretical_speedup
from specsplit.bench.prompts import PROMPT_SETS
from specsplit.lmkit import event_loop
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import DEFAULT_TREE_BRANCHES, MAX_TREE_BRANCHES, OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator


@dataclass(frozen=True)
class Entry:
    """One column of the comparison: a drafter, or a chain of them."""

    label: str
    drafter: DrafterKind
    chain: tuple[DrafterKind, ...] = ()
    fixed_k: int = 0  # 0: the run's --k and --fixed-k
    branches: int = 0  # the tree width its requests ask for; 0: the run's --tree-branches

    def settings(self, args) -> tuple[int, bool, int]:
        """(k, adaptive K, tree branches) its requests ask for: its own where named, else the run's flags."""
        return self.fixed_k or args.k, not (self.fixed_k or args.fixed_k), self.branches or args.tree_branches

    @property
    def members(self) -> tuple[DrafterKind, ...]:
        """The drafters it runs: a chain's members, else its one drafter."""
        return self.chain or (self.drafter,)


def add_flags(parser) -> None:
    parser.add_argument(
        "--drafters", default="ngram,eagle,ngram+eagle",
        help="--suite interleaved: drafters compared, comma-separated; a+b is a chain (n-gram first), "
             "name@k a fixed k, name/b trees of up to b branches (both: name@k/b)",
    )
    parser.add_argument(
        "--tree-branches", type=int, default=DEFAULT_TREE_BRANCHES,
        help="--suite interleaved: token-tree branches a request may verify, for drafters named without /b "
             f"(default {DEFAULT_TREE_BRANCHES}, as `specsplit serve` gives a request; 1: chains only)",
    )
    parser.add_argument(
        "--warm-prompt-set", default="", choices=["", *sorted(PROMPT_SETS)],
        help="--suite interleaved: run each contender that recycles over this prompt set first (none in common "
             "with --prompt-set), so its caller's table is warm as after earlier requests",
    )


def parse_entries(spec: str) -> list[Entry]:
    """``ngram,eagle@3,ngram+eagle`` -> entries; unknown names, bad k and repeats are refused."""
    entries = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        head, _, branches = item.partition("/")
        names, _, k = head.partition("@")
        if k and (not k.isdigit() or int(k) < 1):
            raise ValueError(f"--drafters: {item!r}: write a fixed k as name@K with K >= 1")
        if branches and (not branches.isdigit() or not 1 <= int(branches) <= MAX_TREE_BRANCHES):
            raise ValueError(f"--drafters: {item!r}: write a tree width as name/B with 1 <= B <= {MAX_TREE_BRANCHES}")
        try:
            kinds = tuple(DrafterKind[name.strip().upper()] for name in names.split("+"))
        except KeyError as exc:
            raise ValueError(f"--drafters: unknown drafter {exc}; use {[k.name.lower() for k in DrafterKind]}") from None
        if DrafterKind.CHAIN in kinds:
            raise ValueError("--drafters: write a chain as its members joined by '+', e.g. ngram+eagle")
        chain = kinds if len(kinds) > 1 else ()
        entries.append(Entry(item, DrafterKind.CHAIN if chain else kinds[0], chain, int(k or 0), int(branches or 0)))
    if not entries or len({e.label for e in entries}) != len(entries):
        raise ValueError(f"--drafters {spec!r}: name at least one drafter, each once")
    return entries


def draft_flags(args, entries: list[Entry]) -> list[str]:
    """serve-draft flags for every self-drafter the entries use (each flag once)."""
    kinds = {k for e in entries for k in e.members}
    flags: list[str] = []
    for kind in sorted(kinds, key=lambda k: k.value):
        one = demo.self_draft_flags(argparse.Namespace(**{**vars(args), "drafter": kind.name.lower()}))
        for flag, value in zip(one[::2], one[1::2]):
            if flag not in flags:
                flags += [flag, value]
    return flags


TARGET_ONLY = "target-only"


def caller_tokens(folder: Path, labels: list[str]) -> tuple[Path, dict[str, Path]]:
    """A bearer token per caller under ``folder``: the services' token file (``NAME TOKEN`` a line) and each
    caller's own file of its token (an orchestrator's ``peer_token_file``)."""
    tokens = {label: secrets.token_hex(16) for label in labels}
    services = folder / "services.tokens"
    services.write_text("".join(f"caller-{i} {token}\n" for i, token in enumerate(tokens.values())))
    own = {}
    for i, (label, token) in enumerate(tokens.items()):
        own[label] = folder / f"caller-{i}.token"
        own[label].write_text(token + "\n")
    return services, own


def recycles(entry: Entry) -> bool:
    return DrafterKind.RECYCLING in entry.members


async def _measure(args, entries: list[Entry], target_address: str, draft_address: str,
                   token_files: dict[str, Path]) -> dict[str, list[Comparison]]:
    config = OrchestratorConfig(target_address=target_address, draft_address=draft_address, tokenizer=args.model)
    greedy = SamplingParams()
    decoding = decoding_of(args)
    overlap = not args.no_overlap
    prompts = PROMPT_SETS[args.prompt_set]
    baseline_orch = await Orchestrator.connect(replace(config, peer_token_file=str(token_files[TARGET_ONLY])))
    orchs = {e.label: await Orchestrator.connect(replace(config, peer_token_file=str(token_files[e.label])))
             for e in entries}
    try:
        await run_one(baseline_orch, prompts[0], 0, DrafterKind.NGRAM, 8, greedy)
        for e in entries:  # first calls pay one-off allocation costs and seed each cost model
            k, adaptive, branches = e.settings(args)
            await run_one(orchs[e.label], prompts[0], k, e.drafter, 16, greedy, adaptive_k=adaptive,
                          overlap=overlap, chain=e.chain, tree_branches=branches)
        for warm in PROMPT_SETS[args.warm_prompt_set] if args.warm_prompt_set else ():
            for e in filter(recycles, entries):
                k, adaptive, branches = e.settings(args)
                await run_one(orchs[e.label], warm, k, e.drafter, args.max_new_tokens, decoding.params(warm, 0),
                              adaptive_k=adaptive, overlap=overlap, chain=e.chain, tree_branches=branches)
        results: dict[str, list[Comparison]] = {e.label: [] for e in entries}
        for prompt in prompts:
            sampling = decoding.params(prompt, 0)
            baseline = await run_one(baseline_orch, prompt, 0, DrafterKind.NGRAM, args.max_new_tokens, sampling)
            for e in entries:
                k, adaptive, branches = e.settings(args)
                run = await run_one(orchs[e.label], prompt, k, e.drafter, args.max_new_tokens, sampling,
                                    adaptive_k=adaptive, overlap=overlap, chain=e.chain, tree_branches=branches)
                results[e.label].append(Comparison(prompt, baseline, run))
            print(f"{prompt.name}: " + "  ".join(
                f"{e.label} {results[e.label][-1].baseline.wall_s / results[e.label][-1].speculative.wall_s:.2f}x"
                for e in entries), flush=True)
    finally:
        for orch in (baseline_orch, *orchs.values()):
            await orch.close()
    return results


def decoding_of(args) -> traffic.Decoding:
    """The suite's one decoding: sampled when ``--decoding sampling`` asks, else greedy (``both`` included)."""
    return traffic.SAMPLING if args.decoding == "sampling" else traffic.GREEDY


def figures(g: Summary, k: int) -> dict:
    """One drafter's figures over a group of prompts."""
    c = g.draft_cost_ratio
    best_k, best = best_fixed_k(g.acceptance_rate, c, range(1, k + 1))
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
        # The same bound at the best fixed K up to k: what this acceptance and draft cost give where verifying
        # K + 1 tokens costs one step (a GPU at small batch), chains only.
        "verify_free_best_k": best_k, "verify_free_speedup": round(best, 3),
        "rounds": g.rounds,
        "drafted_tokens": g.drafted,
        "mean_drafted_per_round": round(g.drafted / g.rounds, 3) if g.rounds else 0.0,
        "accepted_tokens": g.accepted,
        "identical_to_target_only": g.identical,
        "feature_bytes_per_round": round(g.feature_bytes / g.rounds, 1) if g.rounds else 0.0,
        "tree_rounds": g.tree_rounds,
        "mean_tree_nodes": round(g.tree_nodes / g.tree_rounds, 2) if g.tree_rounds else 0.0,
    }


def report(args, entries: list[Entry], results: dict[str, list[Comparison]]) -> dict:
    drafters = {}
    for e in entries:
        groups = summarise(results[e.label])
        k, adaptive, branches = e.settings(args)
        drafters[e.label] = {"k": k, "adaptive_k": adaptive, "tree_branches": branches, **figures(groups["all"], k),
                             "by_kind": {n: figures(g, k) for n, g in groups.items() if n != "all"}}
    first = results[entries[0].label]
    return {
        "benchmark": "drafters_interleaved",
        "target": args.model,
        "drafters": [e.label for e in entries],
        "eagle_head": args.eagle_head or (args.model if any(
            DrafterKind.EAGLE in e.members for e in entries) else None),
        "prompt_set": args.prompt_set,
        "decoding": decoding_of(args).name,
        "k": args.k, "adaptive_k": not args.fixed_k, "overlap": not args.no_overlap, "tree_branches": args.tree_branches,
        "max_new_tokens": args.max_new_tokens,
        "target_threads": args.target_threads, "draft_threads": args.draft_threads,
        "target_cpus": args.target_cpus or "unpinned", "draft_cpus": args.draft_cpus or "unpinned",
        "results": drafters,
        "per_prompt": [
            {
                "name": c.prompt.name, "kind": c.prompt.kind, "target_only_s": round(c.baseline.wall_s, 4),
                **{e.label: {"s": round(results[e.label][i].speculative.wall_s, 4),
                             "rounds": results[e.label][i].speculative.rounds,
                             "drafted": results[e.label][i].speculative.drafted,
                             "accepted": results[e.label][i].speculative.accepted,
                             "identical": results[e.label][i].identical,
                             "drafted_per_round": results[e.label][i].speculative.drafted_per_round} for e in entries},
            }
            for i, c in enumerate(first)
        ],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
    }


def run(args) -> int:
    entries = parse_entries(args.drafters)
    target_args, draft_args = runs.service_args(argparse.Namespace(**{**vars(args), "drafter": "ngram"}))
    flags = draft_flags(args, entries)
    if args.warm_prompt_set:
        shared = {p.name for p in PROMPT_SETS[args.warm_prompt_set]} & {p.name for p in PROMPT_SETS[args.prompt_set]}
        if shared:
            raise ValueError(f"--warm-prompt-set {args.warm_prompt_set} shares prompts with --prompt-set "
                             f"{args.prompt_set} ({', '.join(sorted(shared)[:3])}): warm on other prompts")
    if flags:
        draft_args += ["--model", args.model, *flags]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="specsplit-callers-") as folder:
        services, own = caller_tokens(Path(folder), [TARGET_ONLY, *(e.label for e in entries)])
        target_args += ["--auth-token-file", str(services)]
        draft_args += ["--auth-token-file", str(services)]
        with local_services(target_args, draft_args) as (target, draft):
            results = event_loop.run(_measure(args, entries, target.address, draft.address, own))
    out = {**report(args, entries, results), "warm_prompt_set": args.warm_prompt_set or None,
           "duration_s": round(time.time() - started, 1)}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    for label, r in out["results"].items():
        kinds = "  ".join(f"{n} {g['speedup']:.2f}x a={g['acceptance_rate']:.2f}" for n, g in r["by_kind"].items())
        print(f"{label:14s} all {r['speedup']:.2f}x  alpha {r['acceptance_rate']:.2f}  "
              f"drafted/round {r['mean_drafted_per_round']:.2f}  c {r['draft_cost_ratio']:.3f}  "
              f"trees {r['tree_rounds']}/{r['rounds']} ({r['mean_tree_nodes']} nodes)  "
              f"identical {r['identical_to_target_only']}/{r['prompts']}  |  {kinds}")
    print(f"-> {path}")
    return 0 if all(r["identical_to_target_only"] == r["prompts"] for r in out["results"].values()) else 1
