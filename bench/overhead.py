"""``specsplit bench --suite overhead``: what the split itself costs a round, against a GPU step.

The real services run as processes on loopback with a near-zero-compute
model (one layer, hidden size 16, the default vocabulary), one thread each,
and the orchestrator runs in this process. Part one: one session per mode
(k = 0; k = 4 n-gram, sync and overlapped; k = 4 model), each round's wall
time split into the orchestrator's share, each hop (wire and both gRPC
stacks) and each service's time outside its compute, from the services' own
reports (``ServiceTiming``). Part two: CPU per generated token of each
process and the stack's tokens/s at several concurrent sessions (k = 0; k = 4
n-gram, sync and overlapped, the default). Every
figure is also set against GPU decode steps (``GPU_STEPS``) as a fraction.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from specsplit.bench import runs
from specsplit.lmkit import event_loop, processes
from specsplit.lmkit.heap import collector_clock, freeze_startup_heap
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.loop import LoopStats

# What a target's decode step costs on GPUs, seconds: the budget the split's own cost is held against.
GPU_STEPS = {"8B on one H200 (CUDA graphs)": 0.006, "70B on 4 GPUs, tensor parallel": 0.015}
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] * 4  # repeats: the n-gram drafter finds matches


@dataclass(frozen=True)
class Mode:
    name: str
    k: int
    drafter: DrafterKind
    overlap: bool


MODES = (
    Mode("k0", 0, DrafterKind.NGRAM, False),
    Mode("ngram4-sync", 4, DrafterKind.NGRAM, False),
    Mode("ngram4-overlap", 4, DrafterKind.NGRAM, True),
    Mode("model4-sync", 4, DrafterKind.MODEL, False),
)
# The CPU per token part: k = 0, n-gram k = 4 sync, and n-gram k = 4 with overlap (what a request gets by default).
CONCURRENT_MODES = MODES[:3]


def tiny_model(path: Path) -> Path:
    """A random Llama whose forward costs almost nothing (1 layer, hidden 16) on the default vocabulary, saved with
    the default tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specsplit.lmkit import models

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    models.load_tokenizer(models.DEFAULT_MODEL).save_pretrained(path)
    return path


def add_flags(parser) -> None:
    parser.add_argument("--overhead-rounds", type=int, default=400, help="--suite overhead: rounds per mode, one session")
    parser.add_argument("--overhead-sessions", default="1,8,32,128",
                        help="--suite overhead: concurrent sessions for the CPU per token part")
    parser.add_argument("--overhead-tokens", type=int, default=200,
                        help="--suite overhead: new tokens per session in the CPU per token part (200: the shape "
                             "its goals are stated at; longer generations spread each session's open and first "
                             "rounds over more tokens)")
    parser.add_argument("--overhead-repeats", type=int, default=2,
                        help="--suite overhead: interleaved passes over the modes; medians are reported")
    parser.add_argument("--overhead-target-compile", default="auto", choices=("off", "auto", "inductor"),
                        help="--suite overhead: the target's --compile (its decoder step eager, or compiled)")
    parser.add_argument("--overhead-transports", default="shared,own",
                        help="--suite overhead: how the orchestrator reaches the services, interleaved: shared (every "
                             "session on one Sessions stream per service) and/or own (a stream per session)")


def request(mode: Mode, tokens: int) -> GenerationRequest:
    """A fixed-K greedy request (the adaptive controller would stop drafting on a model that costs nothing)."""
    return GenerationRequest("", False, tokens, SamplingParams(), (), mode.k, mode.drafter, False, adaptive_k=False,
                             overlap=mode.overlap)


async def one_session(orch: Orchestrator, mode: Mode, rounds: int) -> dict:
    """One session's rounds: the wall time of each (the first, with the opens, left out) and where it went."""
    walls, loop, last = [], LoopStats(), None
    async for event in orch.generate(request(mode, rounds * (mode.k + 1)), PROMPT):
        now = time.perf_counter()
        if last is not None:
            walls.append(now - last)
        last = now
        loop = event.loop or loop
    return parts_per_round(walls, loop, mode)


def parts_per_round(walls: list[float], loop: LoopStats, mode: Mode) -> dict:
    """A round's wall time and its parts, ms: the services' compute, each service's time outside it, each hop,
    and the orchestrator's share (what is left: its Python, its gRPC stack's share is in the hops)."""
    n = max(loop.rounds, 1)
    wall = statistics.fmean(walls) if walls else 0.0
    target_compute, target_service = loop.target_compute_s / n, loop.target_service_s / n
    draft_compute, draft_service = loop.draft_compute_s / n, loop.draft_service_s / n
    # The part of the draft's replies the rounds waited for (a wait longer than the reply's own round trip is the
    # orchestrator's: the request's task not started yet, or the reply not read at once).
    waited = min(loop.draft_wait_s, loop.draft_wall_s) / n
    waited_share = waited / (loop.draft_wall_s / n) if loop.draft_wall_s else 0.0
    ms = 1e3
    parts = {
        "target_forward": loop.target_forward_s / n * ms,
        "target_verification": (target_compute - loop.target_forward_s / n) * ms,
        "target_service_outside_compute": (target_service - target_compute) * ms,
        "target_hop": (loop.target_wait_s / n - target_service) * ms,
        "draft_compute_waited": draft_compute * waited_share * ms,
        "draft_service_outside_compute_waited": (draft_service - draft_compute) * waited_share * ms,
        "draft_hop_waited": (loop.draft_wall_s / n - draft_service) * waited_share * ms,
        "orchestrator": (wall - loop.target_wait_s / n - waited) * ms,
    }
    compute = parts["target_forward"] + parts["target_verification"] + parts["draft_compute_waited"]
    return {
        "mode": mode.name, "k": mode.k, "drafter": mode.drafter.name.lower(), "overlap": mode.overlap,
        "rounds": loop.rounds, "tokens_per_round": round(loop.committed / n, 3),
        "round_wall_ms": round(wall * ms, 3),
        "round_wall_ms_median": round(statistics.median(walls) * ms, 3) if walls else 0.0,
        "compute_ms": round(compute, 3),
        "round_less_compute_ms": round(wall * ms - compute, 3),
        "parts_ms": {name: round(value, 3) for name, value in parts.items()},
    }


async def concurrent(orch: Orchestrator, mode: Mode, sessions: int, tokens: int, pids: dict[str, int],
                     metrics_ports: dict[str, int] | None = None) -> dict:
    """``sessions`` at once, each ``tokens`` new tokens: CPU per generated token of each process, tokens/s, and
    the garbage collector's share of each (``collector``)."""
    before, gc_before, start = processes.cpu_seconds(pids), gc_readings(metrics_ports), time.perf_counter()
    done = await asyncio.gather(*(collect(orch, mode, tokens) for _ in range(sessions)))
    wall, used = time.perf_counter() - start, processes.cpu_used(pids, before)
    generated = sum(n for n, _ in done)
    rounds = sum(r for _, r in done)
    return {
        "mode": mode.name, "sessions": sessions, "tokens": generated, "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1), "tokens_per_round": round(generated / max(rounds, 1), 3),
        "cpu_ms_per_token": {name: round(s / generated * 1e3, 4) for name, s in used.items()},
        "collector": collector_use(gc_before, gc_readings(metrics_ports), generated),
    }


def gc_readings(metrics_ports: dict[str, int] | None) -> dict[str, dict]:
    """Each process's garbage collector so far: this one's clock, and each service's from its metrics port
    (passes and seconds per generation, and the bound of the largest bucket a pass fell in)."""
    readings = {"orchestrator": collector_clock().take()}
    for name, port in (metrics_ports or {}).items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        passes, seconds, buckets = [0, 0, 0], [0.0, 0.0, 0.0], [{}, {}, {}]
        for family in text_string_to_metric_families(text):
            if family.name != "specsplit_gc_pause_seconds":
                continue
            for sample in family.samples:
                generation = int(sample.labels["generation"])
                if sample.name.endswith("_count"):
                    passes[generation] = int(sample.value)
                elif sample.name.endswith("_sum"):
                    seconds[generation] = sample.value
                elif sample.name.endswith("_bucket"):
                    buckets[generation][float(sample.labels["le"])] = sample.value
        readings[name] = {"passes": passes, "seconds": seconds, "buckets": buckets}
    return readings


def collector_use(before: dict[str, dict], after: dict[str, dict], tokens: int) -> dict[str, dict]:
    """What each process's collector did between two readings: passes per generation, ms per generated token,
    and the longest pass (this process's exactly; a service's as the bucket bound it fell under)."""
    use = {}
    for name, now in after.items():
        then = before.get(name)
        if then is None:
            continue
        spent = sum(now["seconds"]) - sum(then["seconds"])
        row = {"passes": [a - b for a, b in zip(now["passes"], then["passes"])],
               "ms_per_token": round(spent / max(tokens, 1) * 1e3, 4)}
        if "longest_s" in now:
            row["longest_ms"] = round(max(now["longest_s"]) * 1e3, 3)
        else:  # cumulative buckets: every pass of the window is at most the first bound that holds them all
            bounds = []
            for generation in range(3):
                grown = {le: count - then["buckets"][generation].get(le, 0.0)
                         for le, count in now["buckets"][generation].items()}
                total = grown.get(float("inf"), 0.0)
                if total:
                    bounds.append(min(le for le, count in grown.items() if count == total))
            longest = max(bounds, default=0.0)  # None: past the histogram's largest bound
            row["longest_under_ms"] = None if longest == float("inf") else round(longest * 1e3, 3)
        use[name] = row
    return use


async def collect(orch: Orchestrator, mode: Mode, tokens: int) -> tuple[int, int]:
    generated, rounds = 0, 0
    async for event in orch.generate(request(mode, tokens), PROMPT):
        generated += len(event.token_ids)
        rounds = event.loop.rounds if event.loop is not None else rounds
    return generated, rounds


async def measure(target: str, draft: str, model: str, args, pids: dict[str, int],
                  metrics_ports: dict[str, int] | None = None) -> dict:
    transports = [name.strip() for name in args.overhead_transports.split(",") if name.strip()]
    if not transports or set(transports) - {"shared", "own"}:
        raise ValueError(f"--overhead-transports: shared and/or own, got {args.overhead_transports!r}")
    orchs = {name: await Orchestrator.connect(OrchestratorConfig(target, draft, tokenizer=model,
                                                                 shared_stream_from=1 if name == "shared" else 0))
             for name in transports}
    freeze_startup_heap("the bench's orchestrator")  # as `specsplit serve` does once connected
    sessions = session_counts(args)
    per_round: dict[tuple[str, str], list[dict]] = {}
    cpu: dict[tuple[str, str, int], list[dict]] = {}
    try:
        for orch in orchs.values():
            for mode in MODES:  # warm-up: first calls pay one-off allocations
                await one_session(orch, mode, 20)
        for repeat in range(args.overhead_repeats):
            order = MODES[repeat % len(MODES):] + MODES[: repeat % len(MODES)]  # rotate: no mode always first
            for mode in order:
                for name, orch in orchs.items():
                    row = {"transport": name, **await one_session(orch, mode, args.overhead_rounds)}
                    per_round.setdefault((name, mode.name), []).append(row)
            for n in sessions:
                for mode in CONCURRENT_MODES:
                    for name, orch in orchs.items():
                        row = {"transport": name,
                               **await concurrent(orch, mode, n, args.overhead_tokens, pids, metrics_ports)}
                        cpu.setdefault((name, mode.name, n), []).append(row)
    finally:
        for orch in orchs.values():
            await orch.close()
    return {"per_round": [median_of(rows) for rows in per_round.values()],
            "concurrency": [median_of(rows) for rows in cpu.values()]}


def session_counts(args) -> list[int]:
    """--overhead-sessions as numbers: the concurrencies of the CPU per token part."""
    return [int(n) for n in args.overhead_sessions.split(",") if n.strip()]


def median_of(rows: list[dict]) -> dict:
    """The row of the repeat whose headline figure is the median (every figure of one run, not a mix)."""
    key = "round_wall_ms" if "round_wall_ms" in rows[0] else "tokens_per_s"
    ordered = sorted(rows, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], "repeats": [r[key] for r in rows]}


def against_gpu(result: dict) -> list[dict]:
    """Each mode's round less compute, and the orchestrator's CPU per round at every concurrency, as a fraction of
    a GPU decode step."""
    rows = []
    for r in result["per_round"]:
        rows.append({"what": f"one session, {r['mode']} ({r['transport']}): round less compute",
                     "ms": r["round_less_compute_ms"],
                     **{gpu: round(r["round_less_compute_ms"] / (s * 1e3), 3) for gpu, s in GPU_STEPS.items()}})
    for c in result["concurrency"]:
        per_round = c["cpu_ms_per_token"].get("orchestrator", 0.0) * c["tokens_per_round"] * c["sessions"]
        rows.append({"what": f"{c['sessions']} sessions, {c['mode']} ({c['transport']}): orchestrator CPU per step",
                     "ms": round(per_round, 3),
                     **{gpu: round(per_round / (s * 1e3), 3) for gpu, s in GPU_STEPS.items()}})
    return rows


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    rows = result["per_round"]
    bottoms = [0.0] * len(rows)
    labels = [f"{r['mode']}\n{r['transport']}" for r in rows]
    for part in rows[0]["parts_ms"]:
        values = [max(r["parts_ms"][part], 0.0) for r in rows]
        left.bar(labels, values, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for gpu, s in GPU_STEPS.items():
        left.axhline(s * 1e3, linestyle="--", linewidth=1, color="grey")
        left.text(-0.4, s * 1e3, gpu, fontsize=7, va="bottom")
    left.set(ylabel="ms per round", title="One session: where a round goes (near-zero model)")
    left.legend(fontsize=6)
    left.tick_params(axis="x", labelsize=6)
    for key in sorted({(c["transport"], c["mode"]) for c in result["concurrency"]}):
        points = sorted((c["sessions"], c["cpu_ms_per_token"]) for c in result["concurrency"]
                        if (c["transport"], c["mode"]) == key)
        for process in points[0][1]:
            right.plot([p[0] for p in points], [p[1][process] for p in points], marker="o",
                       label=f"{process}, {key[1]}, {key[0]}")
    right.set(xscale="log", yscale="log", xlabel="concurrent sessions", ylabel="CPU ms per generated token",
              title="CPU per token by process")
    right.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args) -> int:
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp) / "tiny"))
        service = ["--model", model, "--threads", "1", "--max-sessions", str(max(*session_counts(args), 64))]
        ports = {"target": processes.restartable_port(), "draft": processes.restartable_port()}
        target_service = [*service, "--compile", args.overhead_target_compile, "--metrics-port", str(ports["target"])]
        draft_service = [*service, "--metrics-port", str(ports["draft"])]
        with processes.local_services(target_service, draft_service) as (target, draft):
            pids = {"orchestrator": os.getpid(), "target": target.process.pid, "draft": draft.process.pid}
            result = event_loop.run(measure(target.address, draft.address, model, args, pids, ports))
    report = {
        "benchmark": "overhead",
        "model": "random Llama, 1 layer, hidden 16, vocabulary 49152 (near-zero compute)",
        "services": "processes on 127.0.0.1, 1 thread each; the orchestrator in the bench process; greedy, fixed K",
        "target_compile": args.overhead_target_compile,
        "event_loop": event_loop.name(),  # the services' and this process's (``lmkit.event_loop``)
        "transports": "shared: every session on one Sessions stream per service; own: a stream per session",
        "machine": runs.machine(),
        **result,
        "against_gpu_steps": against_gpu(result),
        "duration_s": round(time.time() - started, 1),
    }
    path = runs.write(report, args.json)
    png = plot(result, path)
    for r in result["per_round"]:
        print(f"{r['transport']:6s} {r['mode']:15s} round {r['round_wall_ms']:6.3f} ms, less compute {r['round_less_compute_ms']:6.3f} ms "
              f"({r['tokens_per_round']:.2f} tokens a round): " +
              ", ".join(f"{k} {v:.3f}" for k, v in r["parts_ms"].items()))
    for c in result["concurrency"]:
        print(f"{c['transport']:6s} {c['mode']:15s} {c['sessions']:3d} sessions: {c['tokens_per_s']:8.1f} tok/s, CPU ms/token " +
              " ".join(f"{k} {v:.3f}" for k, v in c["cpu_ms_per_token"].items()) + "; collector ms/token " +
              " ".join(f"{k} {v['ms_per_token']:.3f} (longest {v.get('longest_ms', v.get('longest_under_ms'))} ms)"
                       for k, v in c["collector"].items()))
    print(f"-> {path}" + (f", {png}" if png else ""))
    return 0
