"""``specsplit bench --suite network``: speculation across emulated links, against target-only over the same links.

The links are **emulated** (``specsplit.bench.netem``: a relay in front of the draft and one in front
of the target, shaped alike), each level's shape checked against itself first
(``specsplit.bench.netem_check``). For each added round trip in ``--link-rtt-ms`` a fresh
orchestrator runs, interleaved: target-only, then per drafter sync and overlap with fixed and
adaptive K (order rotating per level), then target-only again; ``--network-repeats N`` pools N runs
of the cells. Speedups are against the mean of the target-only passes, whose spread is the level's
noise band. Per cell: tokens/s, speedup, acceptance α, draft cost ratio c, mean k, overlap hit rate,
late blocks, identical outputs, and a Leviathan-style bound with the links added (``bound``).
Placement as in the speed suite; the relays are unpinned.

``--network-hosts`` runs it across hosts built in the machine (``specsplit.bench.hosts``, root): draft and
target each on a host of their own, the orchestrator (this process) on a third, every byte crossing veth
links and the router host; each level's relays run on the router host, and level 0 is the bare path.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specsplit.bench import netem
from specsplit.bench.evaluation import best_fixed_k
from specsplit.bench.hosts import Hosts
from specsplit.bench.netem_check import self_check
from specsplit.bench.prompts import PROMPT_SETS
from specsplit.lmkit import event_loop
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import ServiceProcess, local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.loop import LoopStats
from specsplit.orchestrator.decode.policy.model import expected_tokens

GREEDY = SamplingParams()


@dataclass(frozen=True)
class Cell:
    name: str
    drafter: DrafterKind | None  # None: target-only
    k: int
    adaptive: bool = False
    overlap: bool = False


@dataclass
class Run:
    """One generation: its tokens, wall time and the loop's figures."""

    ids: list[int]
    wall_s: float
    loop: LoopStats


def add_flags(parser) -> None:
    parser.add_argument("--link-delay-ms", type=float, default=0.0,
                        help="emulated links (bench.netem) in front of draft and target: one-way delay, each direction")
    parser.add_argument("--link-jitter-ms", type=float, default=0.0, help="emulated links: jitter (standard deviation)")
    parser.add_argument("--link-rate-mbit", type=float, default=0.0, help="emulated links: bandwidth (0: unlimited)")
    parser.add_argument("--link-rtt-ms", default="0,0.5,2,10,50",
                        help="--suite network: added round trips to measure (each link; 0 = loopback, no relay)")
    parser.add_argument("--link-jitter-fraction", type=float, default=0.1,
                        help="--suite network: jitter (standard deviation) as a fraction of the one-way delay")
    parser.add_argument("--network-drafters", default="ngram,quantized",
                        help="--suite network: drafters to measure (quantized: the target in int8 on the draft's core)")
    parser.add_argument("--network-fixed-k", default="ngram:8,quantized:3",
                        help="--suite network: K for the fixed-K cells and the bound of adaptive K, per drafter")
    parser.add_argument("--network-prompts", type=int, default=8, help="--suite network: first N prompts of the set")
    parser.add_argument("--network-hosts", action="store_true",
                        help="--suite network: draft, target and orchestrator each on a host built in this machine "
                             "(network namespaces, root), the links' relays on the router host")
    parser.add_argument("--network-repeats", type=int, default=1,
                        help="--suite network: passes over the cells per level, each followed by target-only "
                             "(the cells' order rotates per pass); figures pool every pass")


def _fixed_k(spec: str) -> dict[str, int]:
    out = {}
    for item in spec.split(","):
        name, _, k = item.partition(":")
        if not k.strip().isdigit():
            raise ValueError(f"--network-fixed-k: expected NAME:K items, got {item!r}")
        out[name.strip()] = int(k)
    return out


def cells_for(drafters: list[str], fixed_k: dict[str, int]) -> list[Cell]:
    """The speculative cells of one level, per drafter: sync/overlap x fixed/adaptive."""
    cells = []
    for name in drafters:
        kind, k = DrafterKind[name.upper()], fixed_k.get(name, 8)
        for overlap in (False, True):
            for adaptive in (False, True):
                label = f"{name}-{'overlap' if overlap else 'sync'}-{'adaptive' if adaptive else 'fixed'}"
                cells.append(Cell(label, kind, k, adaptive, overlap))
    return cells


def link_shape(args) -> netem.Shape:
    """The --link-* flags of the compare suite as one shape for both links."""
    return netem.Shape.from_ms(args.link_delay_ms, args.link_jitter_ms, args.link_rate_mbit)


# -- measuring ---------------------------------------------------------------------------------------------
async def _generate(orch: Orchestrator, text: str, cell: Cell, max_new: int) -> Run:
    request = GenerationRequest(text, True, max_new, GREEDY, (), cell.k if cell.drafter else 0,
                                cell.drafter or DrafterKind.NGRAM, False, cell.adaptive, overlap=cell.overlap)
    ids, loop, start = [], None, time.perf_counter()
    async for event in orch.generate(request, await orch.tokenize(text, chat=True)):
        ids.extend(event.token_ids)
        loop = event.loop or loop
    return Run(ids, time.perf_counter() - start, loop)


async def _level(addresses: dict[str, str], args, prompts, cells: list[Cell], rotate: int) -> dict:
    """One link shape: target-only, then per repeat the cells (order rotated by ``rotate`` and the repeat) and
    target-only again."""
    config = OrchestratorConfig(addresses["target"], addresses["draft"], tokenizer=args.model)
    orch = await Orchestrator.connect(config)
    target_only = Cell("target-only", None, 0)
    try:
        await _generate(orch, prompts[0].text, target_only, 8)  # warm-up: first calls pay one-off costs
        for cell in {c.drafter: c for c in cells if c.adaptive and c.overlap}.values():
            await _generate(orch, prompts[0].text, cell, 16)
        async def passes(cell: Cell) -> list[Run]:
            return [await _generate(orch, p.text, cell, args.max_new_tokens) for p in prompts]

        runs: dict[str, list[list[Run]]] = {"target-only": [await passes(target_only)]}
        for repeat in range(max(args.network_repeats, 1)):
            start = (rotate + repeat) % len(cells)
            for cell in cells[start:] + cells[:start]:
                runs.setdefault(cell.name, []).append(await passes(cell))
            runs["target-only"].append(await passes(target_only))
        links = orch.measured.costs.links
        measured = {name: {"srtt_ms": round(rtt.srtt * 1e3, 4), "rttvar_ms": round(rtt.rttvar * 1e3, 4),
                           "samples": rtt.samples}
                    for name, rtt in (("draft", links.draft), ("target", links.target))}
    finally:
        await orch.close()
    return {"runs": runs, "links_measured": measured}


def _tokens_per_s(runs: list[Run]) -> float:
    return sum(len(r.ids) for r in runs) / sum(r.wall_s for r in runs)


def bound(alpha: float, k: int, c: float, step_s: float, rtt_t: float, rtt_d: float, overlap: bool) -> float:
    """Leviathan et al. 2023's E(α, k) / (k c + 1) with the links' round trips added, for one k.

    Verification of a block costs one target step T (their assumption; on a CPU
    a wider verify costs more), R_t and R_d are the round trips measured on the
    target and draft links, c the draft's time per token it drafted over T:

        sync:     E (T + R_t) / (T + R_t + R_d + k c T)
        overlap:  E (T + R_t) / (max(T + R_t, R_d + (k + 1) c T) + (1 - α^(k+1)) (R_d + k c T))

    c counts every reply but a session's first (which reads the context): blocks
    drafted ahead and not used count, and so does the guess of the bonus token
    they start with. A fixed-K cell is bounded at its k; an adaptive cell at the
    best k <= K with α from the fixed-K cell (adaptive K drafts where it expects
    acceptance, so its own α is selected).
    """
    if k == 0:
        return 1.0
    e = expected_tokens(alpha, k)
    base = step_s + rtt_t
    draft = k * c * step_s
    if not overlap:
        return e * base / (base + rtt_d + draft)
    ahead = rtt_d + (k + 1) * c * step_s
    return e * base / (max(base, ahead) + (1 - alpha ** (k + 1)) * (rtt_d + draft))


def _cell_figures(cell: Cell, runs: list[Run], base_tps: float, reference: list[list[int]], step_s: float,
                  links: dict, bound_alpha: float | None = None) -> dict:
    loops = [r.loop for r in runs]
    drafted, accepted = sum(s.drafted for s in loops), sum(s.accepted for s in loops)
    rounds = sum(s.rounds for s in loops)
    ahead = sum(s.ahead_started for s in loops)
    hits = sum(s.overlap_hits for s in loops)
    alpha = accepted / drafted if drafted else 0.0
    warm_tokens = sum(s.draft_warm_tokens for s in loops)
    c = sum(s.draft_warm_s for s in loops) / warm_tokens / step_s if warm_tokens and step_s else 0.0
    rtt_t, rtt_d = links["target"]["srtt_ms"] / 1e3, links["draft"]["srtt_ms"] / 1e3
    ks = range(0, cell.k + 1) if cell.adaptive else [cell.k]
    a = alpha if bound_alpha is None else bound_alpha
    best = max(bound(a, k, c, step_s, rtt_t, rtt_d, cell.overlap) for k in ks)
    tps = _tokens_per_s(runs)
    return {
        "cell": cell.name, "drafter": cell.drafter.name.lower(), "k": cell.k, "adaptive_k": cell.adaptive,
        "overlap": cell.overlap, "tokens_per_s": round(tps, 3), "speedup_vs_target_only": round(tps / base_tps, 3),
        "acceptance_rate": round(alpha, 4), "draft_cost_ratio": round(c, 4),
        "mean_k": round(sum(sum(s.k_per_round) for s in loops) / max(rounds, 1), 3),
        "mean_drafted_per_round": round(drafted / rounds, 3) if rounds else 0.0,
        "mean_accepted_length": round(sum(s.committed for s in loops) / rounds, 3) if rounds else 0.0,
        "rounds": rounds, "ahead_started": ahead, "overlap_hits": hits,
        # proposals sent to the draft, before a verification or ahead during one (0: target-only steps)
        "draft_requests_per_round": round(sum(s.draft_requests for s in loops) / rounds, 3) if rounds else 0.0,
        "overlap_hit_rate": round(hits / ahead, 4) if ahead else None,
        # a verification's result found the next block already there (drafted ahead, usable, arrived first)
        "next_block_waiting_rate": round(sum(s.overlap_waiting for s in loops) / rounds, 4) if rounds else 0.0,
        "late_blocks": sum(s.late_blocks for s in loops), "busy_rounds": sum(s.busy_rounds for s in loops),
        "leviathan_style_bound": round(best, 3), "efficiency_vs_bound": round(tps / base_tps / best, 3),
        "bound_alpha": round(a, 4),
        "leviathan_bound_loopback": round(best_fixed_k(a, c, ks)[1], 3),
        "identical_to_target_only": f"{sum(r.ids == ids for r, ids in zip(runs, reference))}/{len(runs)}",
    }


def level_report(rtt_ms: float, measured: dict, cells: list[Cell], check: dict | None, relays: dict) -> dict:
    """A level's figures; each cell's pool every pass it ran (``--network-repeats``)."""
    runs = measured["runs"]
    passes = [_tokens_per_s(p) for p in runs["target-only"]]
    base_tps = statistics.fmean(passes)
    reference = [r.ids for r in runs["target-only"][0]]
    repeats = len(runs["target-only"]) - 1
    first = runs["target-only"][0]
    step_s = sum(r.loop.target_compute_s for r in first) / max(sum(r.loop.rounds for r in first), 1)
    out = {
        "added_rtt_ms": rtt_ms,
        "self_check": check,
        "relays": relays,
        "links_measured": measured["links_measured"],
        "target_only_tokens_per_s": round(base_tps, 3),
        "target_only_passes_tokens_per_s": [round(p, 3) for p in passes],
        "noise": round((max(passes) - min(passes)) / base_tps, 4),  # the spread of its target-only passes
        "repeats": repeats,
        "target_only_identical_across_passes": all(
            [r.ids for r in p] == reference for p in runs["target-only"][1:]),
        "target_step_ms": round(step_s * 1e3, 3),
    }
    figures: dict[str, dict] = {}
    # Fixed cells first: an adaptive cell's bound takes alpha from the fixed cell of its drafter and mode, since
    # adaptive K drafts only where it expects acceptance and its own alpha is selected.
    for c in sorted(cells, key=lambda c: c.adaptive):
        fixed = figures.get(c.name.replace("-adaptive", "-fixed")) if c.adaptive else None
        pooled = [run for repeat in runs[c.name] for run in repeat]
        figures[c.name] = _cell_figures(c, pooled, base_tps, reference * repeats, step_s, measured["links_measured"],
                                        fixed["acceptance_rate"] if fixed else None)
    out["cells"] = [figures[c.name] for c in cells]
    return out


def goals(levels: list[dict], drafters: list[str]) -> dict:
    """The goals of docs/performance.md for links, as this run met them."""
    def cell(level, name):
        return next(c for c in level["cells"] if c["cell"] == name)

    out = {}
    for d in drafters:
        adaptive = [(lv["added_rtt_ms"], cell(lv, f"{d}-{m}-adaptive")["speedup_vs_target_only"], lv["noise"])
                    for lv in levels for m in ("sync", "overlap")]
        out[f"{d}_min_adaptive_speedup"] = min(s for _, s, _ in adaptive)
        out[f"{d}_never_slower_than_target_only"] = all(s >= 1.0 - noise for _, s, noise in adaptive)
        at = {lv["added_rtt_ms"]: cell(lv, f"{d}-overlap-adaptive")["speedup_vs_target_only"] for lv in levels}
        if 0 in at and 2 in at and at[0] > 1.0:
            out[f"{d}_overlap_at_2ms_kept_of_loopback_gain"] = round((at[2] - 1) / (at[0] - 1), 3)
            out[f"{d}_overlap_at_2ms_vs_loopback_speedup"] = round(at[2] / at[0], 3)
        if 10 in at:
            out[f"{d}_overlap_adaptive_speedup_at_10ms"] = at[10]
    return out


# -- plot --------------------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    xs = [max(lv["added_rtt_ms"], 0.1) for lv in levels]  # log axis: loopback drawn at 0.1 ms
    drafters = report["drafters"]
    fig, axes = plt.subplots(1, len(drafters) + 1, figsize=(5.2 * (len(drafters) + 1), 4.2))
    for ax, d in zip(axes, drafters):
        for mode, style in (("sync-fixed", "o:"), ("sync-adaptive", "o-"), ("overlap-fixed", "s:"),
                            ("overlap-adaptive", "s-")):
            name = f"{d}-{mode}"
            ys = [next(c for c in lv["cells"] if c["cell"] == name)["speedup_vs_target_only"] for lv in levels]
            ax.plot(xs, ys, style, label=mode)
        bounds = [next(c for c in lv["cells"] if c["cell"] == f"{d}-overlap-adaptive")["leviathan_style_bound"]
                  for lv in levels]
        ax.plot(xs, bounds, "--", color="grey", label="bound (overlap, adaptive)")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xscale("log")
        ax.set(xlabel="added RTT per link, ms (emulated; loopback at 0.1)", ylabel="speedup vs target-only",
               title=f"{d}: speedup vs link RTT")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for d in drafters:
        for mode in ("overlap-fixed", "overlap-adaptive"):
            ys = [next(c for c in lv["cells"] if c["cell"] == f"{d}-{mode}")["overlap_hit_rate"] or 0.0
                  for lv in levels]
            ax.plot(xs, ys, "o-", label=f"{d} {mode}")
    ax.set_xscale("log")
    ax.set(xlabel="added RTT per link, ms", ylabel="blocks drafted ahead that were used", ylim=(0, 1),
           title="Overlap hit rate")
    ax.legend(fontsize=7)
    fig.suptitle(f"specsplit across emulated links: {report['target']}, {report['machine']['cpus']} CPUs, "
                 f"target-only {levels[0]['target_only_tokens_per_s']:.1f} tok/s on loopback", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run -----------------------------------------------------------------------------------------------
def _pin(spec: str) -> None:
    if spec and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in spec.split(",") if c.strip()})


def service_args(args, drafters: list[str]) -> tuple[list[str], list[str]]:
    common = ["--device", args.device, "--dtype", args.dtype, "--max-sessions", "16"]
    target = ["--model", args.model, "--threads", str(args.target_threads), *common]
    draft = ["--threads", str(args.draft_threads), *common]
    if "quantized" in drafters:
        draft += ["--model", args.model, "--quantize", args.quantize]
    target += ["--cpus", args.target_cpus] if args.target_cpus else []
    draft += ["--cpus", args.draft_cpus] if args.draft_cpus else []
    return target, draft


@contextlib.contextmanager
def placed_services(args, target_args: list[str], draft_args: list[str], workdir: Path):
    """(hosts or None, target, draft): the services on loopback, or each on a host of its own (--network-hosts)."""
    if not args.network_hosts:
        with local_services(target_args, draft_args) as (target, draft):
            yield None, target, draft
        return
    with Hosts(["orch", "draft", "target"]) as net:
        target = net.start_service("target", "specsplit.target_service.server", "target", target_args, workdir)
        draft = net.start_service("draft", "specsplit.draft_service.server", "draft", draft_args, workdir)
        yield net, target, draft


@contextlib.contextmanager
def shaped_links(net: Hosts | None, services: dict[str, ServiceProcess], shape: netem.Shape, workdir: Path,
                 seed: int):
    """({role: address the orchestrator connects to}, {role: relay}) for the block: relays shaped ``shape`` in
    front of each service (none for a zero shape), on loopback or on the router host; the relays stopped after."""
    if net is None:
        with netem.links({role: s.address for role, s in services.items()}, shape, workdir, seed) as links:
            yield links
        return
    if shape == netem.Shape():
        yield {role: net.reach(role, s) for role, s in services.items()}, {}
        return
    addresses, relays = {}, {}
    try:
        for i, (role, service) in enumerate(services.items()):
            addresses[role], relays[role] = net.relay(role, service.port, shape, workdir, f"{role}-relay-{seed}",
                                                      seed + i)
        yield addresses, relays
    finally:
        for relay in relays.values():
            with contextlib.suppress(Exception):
                relay.stop()


def run(args) -> int:
    drafters = [d.strip() for d in args.network_drafters.split(",") if d.strip()]
    unknown = [d for d in drafters if d not in ("ngram", "quantized", "model")]
    if unknown:
        raise ValueError(f"--network-drafters: {unknown}; use ngram, quantized or model")
    rtts = [float(x) for x in args.link_rtt_ms.split(",") if x.strip()]
    cells = cells_for(drafters, _fixed_k(args.network_fixed_k))
    prompts = PROMPT_SETS[args.prompt_set][: args.network_prompts]
    target_args, draft_args = service_args(args, drafters)
    started = time.time()
    levels = []
    with tempfile.TemporaryDirectory(prefix="specsplit-net-") as tmp, \
            placed_services(args, target_args, draft_args, Path(tmp)) as (net, target, draft):
        _pin(args.draft_cpus)
        for i, rtt in enumerate(rtts):
            one_way = rtt / 2
            shape = netem.Shape.from_ms(one_way, args.link_jitter_fraction * one_way)
            check = self_check(shape, Path(tmp), pings=int(min(200, max(40, 2000 / max(rtt, 1e-3))))) if rtt else None
            with shaped_links(net, {"draft": draft, "target": target}, shape, Path(tmp), i) as (addresses, relays):
                # across hosts this process is the orchestrator's host while it measures (gRPC made in there)
                with net.inside("orch") if net else contextlib.nullcontext():
                    measured = event_loop.run(_level(addresses, args, prompts, cells, rotate=i))
                relay_stats = {name: link.stop() for name, link in relays.items()}
            levels.append(level_report(rtt, measured, cells, check, relay_stats))
            lv = levels[-1]
            print(f"RTT {rtt:5.1f} ms: target-only {lv['target_only_tokens_per_s']:.1f} tok/s (noise "
                  f"{lv['noise']:.1%}); " + ", ".join(f"{c['cell']} x{c['speedup_vs_target_only']:.2f}"
                                                     for c in lv["cells"]), flush=True)
    report = {
        "benchmark": "network", "emulated_links": True, "target": args.model, "drafters": drafters,
        "topology": ("across hosts: draft, target and orchestrator each on a host of its own, relays on the router "
                     "host" if args.network_hosts else "loopback"),
        "quantize": args.quantize if "quantized" in drafters else None, "prompt_set": args.prompt_set,
        "prompts": [p.name for p in prompts], "decoding": "greedy", "max_new_tokens": args.max_new_tokens,
        "repeats": max(args.network_repeats, 1),
        "fixed_k": _fixed_k(args.network_fixed_k), "link_rtt_ms": rtts,
        "link_jitter_fraction": args.link_jitter_fraction,
        "placement": (f"target pinned to cpus {args.target_cpus or 'all'} ({args.target_threads} threads), draft to "
                      f"cpus {args.draft_cpus or 'all'} ({args.draft_threads} threads); orchestrator on the draft's "
                      "cpus; relays unpinned"),
        "levels": levels, "goals": goals(levels, drafters),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "duration_s": round(time.time() - started, 1),
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    png = Path(args.plot) if args.plot else path.with_suffix(".png")
    plot(report, png)
    print(f"goals: {report['goals']} -> {path}, {png}")
    return 0
