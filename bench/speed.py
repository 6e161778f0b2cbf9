"""``specsplit bench --suite speed``: traffic per kind, sync vs overlap, concurrency, HF anchors; JSON + PNG.

One target, the same prompts throughout, in parts (``--parts``), each writing its own JSON:

* ``traffic``: every prompt by target-only, specsplit, HF ``generate`` and HF prompt lookup,
  interleaved, per kind, greedy and/or sampling (``bench/traffic.py``);
* ``modes``: single stream, sync and overlap with fixed and adaptive K, a fixed-K sweep with
  per-position acceptance, and HF anchors (``model.generate``, assisted generation) run after the
  services stop; greedy;
* ``concurrency``: 1..32 sessions through continuous batching, aggregate tokens/s with speculation
  and without (k = 0), ``--concurrency-repeats`` times per level and mode, interleaved; medians.

Draft and target run as processes, pinned apart by ``--target-cpus``/``--draft-cpus`` (standing for
separate devices); the orchestrator runs on the draft's cores.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specsplit.bench import runs, traffic
from specsplit.bench.evaluation import RunResult, best_fixed_k, run_one
from specsplit.bench.prompts import PROMPT_SETS, chat_ids
from specsplit.lmkit import event_loop, models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import cpu_seconds, cpu_used, local_services
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator

GREEDY = SamplingParams()


@dataclass(frozen=True)
class Mode:
    name: str
    k: int
    adaptive: bool
    overlap: bool


PARTS = ("traffic", "modes", "concurrency")


def add_flags(parser) -> None:
    parser.add_argument("--parts", default="traffic,concurrency",
                        help=f"--suite speed: which parts to run, of {','.join(PARTS)}")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="--suite speed: concurrent sessions levels")
    parser.add_argument("--k-sweep", default="1,2,4,8", help="--suite speed: fixed K values for speedup vs K")
    parser.add_argument("--concurrency-max-new-tokens", type=int, default=48, help="--suite speed: tokens per request")
    parser.add_argument("--concurrency-repeats", type=int, default=5,
                        help="--suite speed: runs per level and mode, interleaved; the report gives medians")
    parser.add_argument("--plot", default="", help="--suite speed: write the PNG plot here (default: next to --json)")


def _cpus(spec: str) -> set[int]:
    return {int(c) for c in spec.split(",") if c.strip()} if spec else set(range(os.cpu_count() or 1))


def _pin(spec: str) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, _cpus(spec))


# -- single stream ---------------------------------------------------------------------------------------
async def _pass(orch, prompts, mode: Mode, drafter, max_new) -> list[RunResult]:
    await run_one(orch, prompts[0], mode.k, drafter, 16, GREEDY, adaptive_k=mode.adaptive, overlap=mode.overlap)
    return [
        await run_one(orch, p, mode.k, drafter, max_new, GREEDY, adaptive_k=mode.adaptive, overlap=mode.overlap)
        for p in prompts
    ]


def _per_position(runs: list[RunResult], k_max: int) -> list[float]:
    """P(draft token i is accepted | i tokens were drafted), i = 1..k_max."""
    reached, accepted = [0] * k_max, [0] * k_max
    for r in runs:
        for a, d in zip(r.accepted_per_round, r.drafted_per_round):
            for i in range(min(d, k_max)):
                reached[i] += 1
                accepted[i] += int(i < a)
    return [round(accepted[i] / reached[i], 4) if reached[i] else 0.0 for i in range(k_max)]


def _figures(runs: list[RunResult], baseline: list[RunResult], mode: Mode, hf: dict) -> dict:
    tokens = sum(len(r.token_ids) for r in runs)
    wall = sum(r.wall_s for r in runs)
    base_tps = sum(len(r.token_ids) for r in baseline) / sum(r.wall_s for r in baseline)
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    rounds = sum(r.rounds for r in runs)
    target_step = sum(r.target_compute_s for r in baseline) / max(sum(r.rounds for r in baseline), 1)
    c = (sum(r.draft_compute_s for r in runs) / drafted) / target_step if drafted and target_step else 0.0
    alpha = accepted / drafted if drafted else 0.0
    # Leviathan's bound for the measured alpha and c: at K for fixed K, at the best K <= K_max when adaptive.
    ks = range(1, mode.k + 1) if mode.adaptive else [mode.k]
    bound = best_fixed_k(alpha, c, ks)[1] if mode.k else 1.0
    tps = tokens / wall
    speedup = tps / base_tps
    return {
        "mode": mode.name, "k": mode.k, "adaptive_k": mode.adaptive, "overlap": mode.overlap,
        "tokens": tokens, "tokens_per_s": round(tps, 3),
        "speedup_vs_target_only": round(speedup, 3),
        "speedup_vs_hf_assisted": round(tps / hf["assisted_tokens_per_s"], 3),
        "speedup_vs_hf_generate": round(tps / hf["generate_tokens_per_s"], 3),
        "acceptance_rate": round(alpha, 4), "draft_cost_ratio": round(c, 4),
        "mean_accepted_length": round(tokens / rounds, 3) if rounds else 0.0,
        "mean_drafted_per_round": round(drafted / rounds, 3) if rounds else 0.0,
        "overlap_hits": sum(r.overlap_hits for r in runs), "rounds": rounds,
        "leviathan_bound": round(bound, 3),
        "efficiency_vs_bound": round(speedup / bound, 3),
        "identical_to_target_only": sum(r.token_ids == b.token_ids for r, b in zip(runs, baseline)),
        "per_position_acceptance": _per_position(runs, max(mode.k, 1)),
    }


# -- Hugging Face anchors ----------------------------------------------------------------------------------
def hf_anchors(args, prompts, tokenizer, max_new: int, k: int, drafter: DrafterKind, threads: int) -> dict:
    """Plain and assisted ``generate`` on the target's cores, same prompts, budget and greedy decoding."""
    _pin(args.target_cpus)
    torch.set_num_threads(threads)
    target = models.load_model(models.ModelSpec(args.model, args.device, args.dtype))
    assistant = models.load_model(models.ModelSpec(args.draft_model)) if drafter is DrafterKind.MODEL else None
    extra = {"assistant_model": assistant} if assistant is not None else {"prompt_lookup_num_tokens": k}
    out = {"generate": [], "assisted": []}
    for name, kwargs in (("generate", {}), ("assisted", extra)):
        ids = chat_ids(tokenizer, prompts[0])
        _hf_generate(target, ids, 8, kwargs)  # warm-up
        for p in prompts:
            ids = chat_ids(tokenizer, p)
            start = time.perf_counter()
            new = _hf_generate(target, ids, max_new, kwargs)
            out[name].append((new, time.perf_counter() - start))
    tps = {name: sum(len(n) for n, _ in runs) / sum(s for _, s in runs) for name, runs in out.items()}
    return {
        "generate_tokens_per_s": round(tps["generate"], 3),
        "assisted_tokens_per_s": round(tps["assisted"], 3),
        "assisted": "assistant_model" if assistant is not None else f"prompt_lookup_num_tokens={k}",
        "threads": threads, "cpus": args.target_cpus or "unpinned",
        "outputs": {name: [n for n, _ in runs] for name, runs in out.items()},
    }


@torch.inference_mode()
def _hf_generate(model, ids: list[int], max_new: int, kwargs: dict) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


# -- concurrency -------------------------------------------------------------------------------------------
async def _timed(orch, prompt, mode: Mode, drafter, max_new) -> tuple[list[tuple[float, int]], list[int], object]:
    """One generation's (time, tokens) per streamed event, its token ids and final stats."""
    request = GenerationRequest(prompt.text, True, max_new, GREEDY, (), mode.k, drafter, False, mode.adaptive,
                                overlap=mode.overlap)
    events, ids, stats = [], [], None
    async for event in orch.generate(request, chat_ids(orch.tokenizer, prompt)):
        events.append((time.perf_counter(), len(event.token_ids)))
        ids.extend(event.token_ids)
        stats = event.stats or stats
    return events, ids, stats


async def _concurrent(orch, prompts, level: int, mode: Mode, drafter, max_new, pids: dict[str, int]) -> dict:
    """``level`` generations at once. Decode throughput counts tokens in the window where every session
    is past its prompt's prefill and none has finished: the batched steady state. End to end (prefills
    included, each a full forward over its prompt) is reported beside it, and the CPU seconds each
    process (target, draft, this orchestrator) used per generated token: the work, which the machine's
    noise moves far less than the clock."""
    chosen = [prompts[i % len(prompts)] for i in range(level)]
    cpu_before = cpu_seconds(pids)
    start = time.perf_counter()
    runs = await asyncio.gather(*(_timed(orch, p, mode, drafter, max_new) for p in chosen))
    wall = time.perf_counter() - start
    cpu = cpu_used(pids, cpu_before)
    tokens = sum(len(ids) for _, ids, _ in runs)
    begin = max(events[0][0] for events, _, _ in runs)  # the last session's first token
    end = min(events[-1][0] for events, _, _ in runs)  # the first session to finish
    in_window = sum(n for events, _, _ in runs for t, n in events if begin < t <= end)
    rounds = sum(stats.rounds for _, _, stats in runs)
    return {
        "decode_tokens_per_s": round(in_window / (end - begin), 3) if end > begin else 0.0,
        "decode_window_s": round(end - begin, 3), "decode_window_tokens": in_window,
        "tokens": tokens, "wall_s": round(wall, 3), "end_to_end_tokens_per_s": round(tokens / wall, 3),
        "mean_drafted_per_round": round(sum(s.drafted_tokens for _, _, s in runs) / max(rounds, 1), 3),
        "mean_batch_size": round(sum(s.mean_batch_size * s.rounds for _, _, s in runs) / max(rounds, 1), 3),
        "cpu_ms_per_token": {name: round(1e3 * used / max(tokens, 1), 3) for name, used in cpu.items()},
        "outputs": [ids for _, ids, _ in runs],
    }


async def _modes(orch, prompts, args, drafter):
    k, max_new = args.k, args.max_new_tokens
    baseline = await _pass(orch, prompts, Mode("target-only", 0, False, False), drafter, max_new)
    modes = [Mode("sync-adaptive", k, True, False), Mode("overlap-adaptive", k, True, True),
             Mode("sync-fixed", k, False, False), Mode("overlap-fixed", k, False, True)]
    single = {m.name: (m, await _pass(orch, prompts, m, drafter, max_new)) for m in modes}
    sweep = {}
    for kk in [int(x) for x in args.k_sweep.split(",") if x.strip()]:
        m = Mode(f"sync-fixed-k{kk}", kk, False, False)
        sweep[kk] = (m, await _pass(orch, prompts, m, drafter, max_new))
    return baseline, single, sweep


async def _concurrency(orch, prompts, args, drafter, pids: dict[str, int]) -> list[dict]:
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    on, off = Mode("speculative", args.k, True, True), Mode("no-speculation", 0, False, False)
    conc_max = args.concurrency_max_new_tokens
    await _concurrent(orch, prompts, 2, on, drafter, 8, pids)  # warm-up
    concurrency = []
    for level in levels:
        samples = {"speculative": [], "no_speculation": []}
        for repeat in range(max(args.concurrency_repeats, 1)):
            # ABBA order: neither mode always runs first (warmer caches, drifting machine load)
            order = [("speculative", on), ("no_speculation", off)]
            if repeat % 2:
                order.reverse()
            for name, mode in order:
                samples[name].append(await _concurrent(orch, prompts, level, mode, drafter, conc_max, pids))
        concurrency.append({"sessions": level, **samples})
    return concurrency


async def _measure(args, target, draft, parts: set[str], model) -> dict:
    """The chosen parts against one pair of services (``ServiceProcess``es), through one orchestrator (its
    statistics carry over)."""
    pids = {"target": target.process.pid, "draft": draft.process.pid, "orchestrator": os.getpid()}
    drafter = DrafterKind[args.drafter.upper()]
    prompts = PROMPT_SETS[args.prompt_set]
    config = OrchestratorConfig(target.address, draft.address, tokenizer=args.model, max_concurrent=256,
                                ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    orch = await Orchestrator.connect(config)
    out: dict = {}
    try:
        if "traffic" in parts:
            settings = runs.settings_of(args)
            measured = await traffic.measure(orch, model, prompts, settings, traffic.DECODINGS[args.decoding])
            out["traffic"] = traffic.report(measured, settings)
        _pin(args.draft_cpus)
        if "modes" in parts:
            out["modes"] = await _modes(orch, prompts, args, drafter)
        if "concurrency" in parts:
            out["concurrency"] = await _concurrency(orch, prompts, args, drafter, pids)
    finally:
        await orch.close()
    return out


def _median(samples: list[dict], key: str) -> float:
    return round(statistics.median(s[key] for s in samples), 3)


def _concurrency_table(concurrency: list[dict]) -> list[dict]:
    """One row per level: medians over the repeats, and the repeats themselves.

    The ratio with/without speculation is the median of per-repeat ratios (each
    pair ran back to back). The CPU each process spent per token is the median
    over the repeats, and the total's ratio beside it (below 1: speculation
    did less work a token). Outputs count as identical when every repeat of both
    modes produced the first no-speculation repeat's tokens, session by session.
    """
    key = "decode_tokens_per_s"
    table = []
    for row in concurrency:
        spec, none = row["speculative"], row["no_speculation"]
        reference = none[0]["outputs"]
        identical = sum(all(run["outputs"][i] == ids for run in spec + none) for i, ids in enumerate(reference))
        ratios = [s[key] / n[key] for s, n in zip(spec, none) if n[key]]
        table.append({
            "sessions": row["sessions"],
            "repeats": len(spec),
            "tokens_per_s_speculative": _median(spec, key),
            "tokens_per_s_no_speculation": _median(none, key),
            "speculative_vs_no_speculation": round(statistics.median(ratios), 3) if ratios else 0.0,
            "speculative_vs_no_speculation_per_repeat": [round(r, 3) for r in ratios],
            "tokens_per_s_speculative_per_repeat": [s[key] for s in spec],
            "tokens_per_s_no_speculation_per_repeat": [n[key] for n in none],
            "end_to_end_tokens_per_s_speculative": _median(spec, "end_to_end_tokens_per_s"),
            "end_to_end_tokens_per_s_no_speculation": _median(none, "end_to_end_tokens_per_s"),
            "mean_drafted_per_round_speculative": _median(spec, "mean_drafted_per_round"),
            "mean_batch_size_speculative": _median(spec, "mean_batch_size"),
            "mean_batch_size_no_speculation": _median(none, "mean_batch_size"),
            **_cpu_columns(spec, none),
            "identical_outputs": f"{identical}/{row['sessions']}",
        })
    solo = table[0]["tokens_per_s_no_speculation"] if table else 0.0
    solo_spec = table[0]["tokens_per_s_speculative"] if table else 0.0
    for row in table:
        row["no_speculation_vs_one_session"] = round(row["tokens_per_s_no_speculation"] / solo, 3) if solo else 0.0
        row["speculative_vs_one_session"] = round(row["tokens_per_s_speculative"] / solo_spec, 3) if solo_spec else 0.0
    return table


def _cpu_columns(spec: list[dict], none: list[dict]) -> dict:
    if not all(s.get("cpu_ms_per_token") for s in spec + none):
        return {}
    names = list(spec[0]["cpu_ms_per_token"])
    columns = {}
    for mode, samples in (("speculative", spec), ("no_speculation", none)):
        columns[f"cpu_ms_per_token_{mode}"] = {
            n: round(statistics.median(s["cpu_ms_per_token"][n] for s in samples), 3) for n in names}
    total = {mode: sum(columns[f"cpu_ms_per_token_{mode}"].values()) for mode in ("speculative", "no_speculation")}
    columns["cpu_per_token_speculative_vs_no_speculation"] = (
        round(total["speculative"] / total["no_speculation"], 3) if total["no_speculation"] else 0.0)
    return columns


def _modes_report(args, baseline, single, sweep, hf) -> dict:
    base_tokens = sum(len(r.token_ids) for r in baseline)
    base_tps = base_tokens / sum(r.wall_s for r in baseline)
    modes = {name: _figures(runs, baseline, m, hf) for name, (m, runs) in single.items()}
    k_sweep = [_figures(runs, baseline, m, hf) for m, runs in sweep.values()]
    hf_identical = sum(a == r.token_ids for a, r in zip(hf["outputs"]["assisted"], single["overlap-adaptive"][1]))
    hf_summary = {key: v for key, v in hf.items() if key != "outputs"}
    hf_summary["assisted_identical_to_specsplit"] = f"{hf_identical}/{len(baseline)}"
    by_name = {m["mode"]: m for m in modes.values()}
    return {
        "decoding": "greedy",
        "target_only_tokens_per_s": round(base_tps, 3),
        "hf": hf_summary,
        "modes": modes,
        "k_sweep": k_sweep,
        "goals": {
            "overlap_beats_sync": by_name["overlap-adaptive"]["tokens_per_s"] > by_name["sync-adaptive"]["tokens_per_s"],
            "speculative_vs_hf_assisted_ge_1_3": by_name["overlap-adaptive"]["speedup_vs_hf_assisted"] >= 1.3,
        },
    }


def _concurrency_report(args, concurrency) -> dict:
    table = _concurrency_table(concurrency)
    at = {row["sessions"]: row for row in table}
    return {
        "concurrency_max_new_tokens": args.concurrency_max_new_tokens,
        "concurrency_repeats": args.concurrency_repeats,
        "concurrency": table,
        "goals": {
            "speculation_ge_0_95_no_speculation_at_every_level": all(
                r["speculative_vs_no_speculation"] >= 0.95 for r in table),
            "throughput_8_sessions_ge_3x_one": at.get(8, {}).get("no_speculation_vs_one_session", 0.0) >= 3.0,
        },
    }


def _report(args, measured: dict, hf: dict | None) -> dict:
    """The JSON of a run: each part's figures and goals."""
    report = {
        "benchmark": "speed", **runs.header(args), "parts": sorted(measured),
        "placement": (f"target on cpus {args.target_cpus or 'all'} ({args.target_threads} threads), draft on "
                      f"cpus {args.draft_cpus or 'all'}; orchestrator on the draft's cpus for modes and "
                      "concurrency; HF anchors with the target's threads"),
        "goals": {},
    }
    if "traffic" in measured:
        report["traffic"] = measured["traffic"]
        for decoding, block in measured["traffic"]["decodings"].items():
            report["goals"].update({f"traffic_{decoding}_{k}": v for k, v in block["goals"].items()})
    if "modes" in measured:
        part = _modes_report(args, *measured["modes"], hf)
        report["goals"].update(part.pop("goals"))
        report["single_stream"] = part
    if "concurrency" in measured:
        part = _concurrency_report(args, measured["concurrency"])
        report["goals"].update(part.pop("goals"))
        report.update(part)
    return report


def plot(report: dict, path: Path) -> bool:
    """A PNG of what the run measured: traffic per kind, speedup vs K, throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("traffic", "single_stream", "concurrency") if name in report]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        {"traffic": _plot_traffic, "single_stream": _plot_modes, "concurrency": _plot_concurrency}[name](ax, report)
    fig.suptitle(f"specsplit on {report['target']}, drafter {report['drafter']}, {report['machine']['cpus']} CPUs, "
                 f"prompt set {report['prompt_set']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_traffic(ax, report: dict) -> None:
    decodings = report["traffic"]["decodings"]
    rows = [k for k in next(iter(decodings.values()))["rows"] if k.startswith("kind:") or k == "all"]
    width = 0.8 / (2 * len(decodings))
    for i, (decoding, block) in enumerate(decodings.items()):
        xs = [j + (2 * i) * width for j in range(len(rows))]
        ax.bar(xs, [block["rows"][r]["specsplit_vs_target_only"] or 0 for r in rows], width, label=f"specsplit, {decoding}")
        lookup = []
        for r in rows:
            row = block["rows"][r]
            best = row["best_hf_lookup"]
            lookup.append(row["tokens_per_s"][best] / row["tokens_per_s"]["target-only"] if best else 0.0)
        ax.bar([x + width for x in xs], lookup, width, label=f"best HF lookup, {decoding}", alpha=0.6)
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xticks([j + width for j in range(len(rows))], [r.split(":")[-1] for r in rows], rotation=60, fontsize=7)
    ax.set(ylabel="tokens/s vs target-only", title="Traffic per kind")
    ax.legend(fontsize=7)


def _plot_modes(ax, report: dict) -> None:
    part = report["single_stream"]
    sweep = part["k_sweep"]
    ax.plot([m["k"] for m in sweep], [m["speedup_vs_target_only"] for m in sweep], "o-", label="sync, fixed K")
    ax.plot([m["k"] for m in sweep], [m["leviathan_bound"] for m in sweep], "--", color="grey", label="Leviathan bound")
    for name, marker in (("sync-adaptive", "s"), ("overlap-adaptive", "D")):
        m = part["modes"][name]
        ax.plot([report["k"]], [m["speedup_vs_target_only"]], marker, label=f"{name} (K ≤ {report['k']})")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set(xlabel="K (draft tokens per round)", ylabel="speedup vs target-only", title="Speedup vs K")
    ax.legend(fontsize=8)


def _plot_concurrency(ax, report: dict) -> None:
    rows = report["concurrency"]
    xs = [r["sessions"] for r in rows]
    ax.plot(xs, [r["tokens_per_s_speculative"] for r in rows], "o-", label="speculation (adaptive, overlap)")
    ax.plot(xs, [r["tokens_per_s_no_speculation"] for r in rows], "s-", label="no speculation")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent sessions", ylabel="aggregate decode tokens/s",
           title="Throughput vs concurrency (batched verification)")
    ax.legend(fontsize=8)


def run(args) -> int:
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - set(PARTS):
        raise ValueError(f"--parts must name some of {','.join(PARTS)}, got {args.parts!r}")
    target_args, draft_args = runs.service_args(args)
    target_args += ["--max-sessions", "128"]
    draft_args += ["--max-sessions", "128"]
    started = time.time()
    model = runs.load_anchor_model(args) if "traffic" in parts and not args.no_hf else None
    with local_services(target_args, draft_args) as (target, draft):
        measured = event_loop.run(_measure(args, target, draft, parts, model))
    hf = None
    if "modes" in parts:  # after the services stopped: the anchors get the target's cores to themselves
        tokenizer = models.load_tokenizer(args.model)
        hf = hf_anchors(args, PROMPT_SETS[args.prompt_set], tokenizer, args.max_new_tokens, args.k,
                        DrafterKind[args.drafter.upper()], args.target_threads)
    report = _report(args, measured, hf)
    report["duration_s"] = round(time.time() - started, 1)
    path = runs.write(report, args.json)
    png = Path(args.plot) if args.plot else path.with_suffix(".png")
    if not plot(report, png):
        png = None
    if "traffic" in report:
        traffic.print_rows(report["traffic"])
    for name, m in report.get("single_stream", {}).get("modes", {}).items():
        print(f"{name:17s} {m['tokens_per_s']:6.1f} tok/s  x{m['speedup_vs_target_only']:.2f} target-only  "
              f"x{m['speedup_vs_hf_assisted']:.2f} HF assisted  efficiency {m['efficiency_vs_bound']:.2f}")
    for row in report.get("concurrency", []):
        print(f"{row['sessions']:3d} sessions  {row['tokens_per_s_speculative']:7.1f} tok/s speculative  "
              f"{row['tokens_per_s_no_speculation']:7.1f} without  (x{row['speculative_vs_no_speculation']:.2f}, "
              f"median of {row['speculative_vs_no_speculation_per_repeat']})")
    print(f"goals: {report['goals']} -> {path}" + (f", {png}" if png else ""))
    return 0
