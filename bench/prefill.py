"""``specsplit bench --suite prefill``: what a long prompt's prefill costs the sessions already decoding.

A target process per ``--prefill-chunks`` value (0: a prompt's prefill is one forward), the orchestrator in this
process, target-only greedy decoding (the prefill's effect alone, no draft). Each run: ``--prefill-sessions``
short prompts decode; once they stream, a prompt of ``--prefill-prompt-tokens`` tokens arrives. Reported per
value: the other sessions' inter-token gaps while the long prompt waited for its first token (largest, p95,
median), the long prompt's time to first token, and the tokens/s of the short sessions over that window. Values
interleaved run by run, ``--prefill-repeats`` times; medians over repeats.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from contextlib import ExitStack

from specsplit.bench import runs
from specsplit.lmkit import models, processes
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.config import OrchestratorConfig
from specsplit.orchestrator.generation import GenerationRequest, Orchestrator

TEXT = ("The river ran past the old mill and under the stone bridge, where the children of the village "
        "gathered every evening to watch the boats come home with their nets full of silver fish. ")
SHORT_PROMPTS = ("Write a short poem about the sea.", "List three facts about the moon.",
                 "Explain what a compiler does.", "Describe a walk in the forest.")


def add_flags(parser) -> None:
    parser.add_argument("--prefill-chunks", default="0,256",
                        help="--suite prefill: the target's --prefill-chunk values compared (0: one forward)")
    parser.add_argument("--prefill-prompt-tokens", type=int, default=1024,
                        help="--suite prefill: the long prompt's length in tokens")
    parser.add_argument("--prefill-sessions", type=int, default=4,
                        help="--suite prefill: short sessions decoding when the long prompt arrives")
    parser.add_argument("--prefill-repeats", type=int, default=2,
                        help="--suite prefill: interleaved runs per value; medians are reported")


def request(tokens: int) -> GenerationRequest:
    """Target-only greedy; the short sessions go on past an end of sequence, so they decode through the window."""
    return GenerationRequest("", False, tokens, SamplingParams(ignore_eos=True), (), 0, DrafterKind.NGRAM, False)


async def one_run(orch: Orchestrator, short_ids: list[list[int]], long_ids: list[int]) -> dict:
    """Short sessions decode; the long prompt arrives once each has streamed; gaps while it waits."""
    arrivals: list[list[float]] = [[] for _ in short_ids]
    streaming = asyncio.Event()
    window: dict[str, float] = {}

    async def short(i: int) -> None:
        async for event in orch.generate(request(4096), short_ids[i]):
            if event.token_ids:
                arrivals[i].append(time.perf_counter())
            if all(arrivals):
                streaming.set()
            if "first" in window:
                return

    async def long() -> None:
        await streaming.wait()
        await asyncio.sleep(0.2)
        window["sent"] = time.perf_counter()
        async for event in orch.generate(request(4), long_ids):
            if event.token_ids and "first" not in window:
                window["first"] = time.perf_counter()

    shorts = [asyncio.ensure_future(short(i)) for i in range(len(short_ids))]
    try:
        await long()
        await asyncio.gather(*shorts)
    finally:
        for task in shorts:
            task.cancel()
    sent, first = window["sent"], window["first"]
    gaps, tokens = [], 0
    for times in arrivals:
        inside = [t for t in times if sent <= t <= first]
        before = [t for t in times if t < sent]
        points = ([before[-1]] if before else []) + inside + [first]
        gaps += [b - a for a, b in zip(points, points[1:])]
        tokens += len(inside)
    gaps.sort()
    return {
        "long_ttft_s": round(first - sent, 3),
        "others_max_gap_s": round(gaps[-1], 3),
        "others_p95_gap_s": round(gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))], 3),
        "others_median_gap_s": round(statistics.median(gaps), 4),
        "others_tokens_per_s": round(tokens / (first - sent), 1),
    }


async def measure(addresses: dict[int, str], tokenizer: str, args) -> dict:
    tok = models.load_tokenizer(tokenizer)
    text_ids = tok.encode(TEXT)
    long_ids = (text_ids * (args.prefill_prompt_tokens // len(text_ids) + 1))[: args.prefill_prompt_tokens]
    short_ids = [tok.encode(p) for p in SHORT_PROMPTS[: args.prefill_sessions]]
    short_ids += [short_ids[i % len(short_ids)] for i in range(len(short_ids), args.prefill_sessions)]
    orchs = {chunk: await Orchestrator.connect(OrchestratorConfig(address, "", tokenizer=tokenizer))
             for chunk, address in addresses.items()}
    rows: dict[int, list[dict]] = {chunk: [] for chunk in addresses}
    try:
        for orch in orchs.values():  # warm-up: first calls pay one-off allocations
            await one_run(orch, short_ids[:1], long_ids[:64])
        for repeat in range(args.prefill_repeats):
            order = list(orchs) if repeat % 2 == 0 else list(orchs)[::-1]
            for chunk in order:
                rows[chunk].append(await one_run(orchs[chunk], short_ids, long_ids))
    finally:
        for orch in orchs.values():
            await orch.close()
    return {"runs": {str(c): r for c, r in rows.items()},
            "medians": {str(c): {key: statistics.median(r[key] for r in runs_) for key in runs_[0]}
                        for c, runs_ in rows.items()}}


def run(args) -> int:
    started = time.time()
    chunks = [int(c) for c in args.prefill_chunks.split(",") if c.strip()]
    if not chunks or min(chunks) < 0:
        raise ValueError(f"--prefill-chunks: values >= 0, got {args.prefill_chunks!r}")
    with ExitStack() as stack:
        addresses = {}
        for chunk in chunks:
            target_args = ["--model", args.model, "--threads", str(args.target_threads), "--prefill-chunk", str(chunk)]
            if args.target_cpus:
                target_args += ["--cpus", args.target_cpus]
            (target,) = stack.enter_context(processes.local_services(target_args, None))
            addresses[chunk] = target.address
        result = asyncio.run(measure(addresses, args.model, args))
    report = {
        "benchmark": "prefill",
        "model": args.model,
        "setup": (f"target-only greedy; {args.prefill_sessions} short sessions decoding when a "
                  f"{args.prefill_prompt_tokens}-token prompt arrives; one target process per --prefill-chunk "
                  "value, runs interleaved"),
        "machine": runs.machine(),
        **result,
        "duration_s": round(time.time() - started, 1),
    }
    path = runs.write(report, args.json)
    for chunk, m in result["medians"].items():
        print(f"--prefill-chunk {chunk:>5}: long TTFT {m['long_ttft_s']:.2f} s; others' largest gap "
              f"{m['others_max_gap_s']:.2f} s, p95 {m['others_p95_gap_s']:.2f} s, median {m['others_median_gap_s']:.3f} s, "
              f"{m['others_tokens_per_s']:.1f} tok/s meanwhile")
    print(f"-> {path}")
    return 0
