"""``specsplit bench --suite prefill``: what a long prompt's prefill costs the sessions already decoding.

``--prefill-service target`` (the default): a target process per ``--prefill-chunks`` value (0: a prompt's prefill
is one forward), the orchestrator in this process, target-only greedy decoding (the prefill's effect alone, no
draft). Each run: ``--prefill-sessions`` short prompts decode; once they stream, a prompt of
``--prefill-prompt-tokens`` tokens arrives. Reported per value: the other sessions' inter-token gaps while the long
prompt waited for its first token (largest, p99, p95, median), the long prompt's time to first token, and the
tokens/s of the short sessions over that window; an event of several tokens (text held back for an incomplete
character) counts as that many rounds over its gap (``spread``). Against their gaps in the ``BASELINE_S`` before it
arrived (their median there is a decode step): how far their p99 gap rose, in decode steps. Values interleaved run
by run, ``--prefill-repeats`` times; medians over repeats.

``--prefill-service draft``: the same on the draft alone, a draft process (``--model`` as its model drafter) per
value of its ``--prefill-chunk``, driven over its ``Session`` streams from this process: the short sessions propose
blocks of 4 back to back, each taken whole; the long one opens and proposes once. Gaps are between the short
sessions' proposals; "first token" is the long session's first block.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from specsplit.bench import runs
from specsplit.lmkit import event_loop, models, processes
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

TEXT = ("The river ran past the old mill and under the stone bridge, where the children of the village "
        "gathered every evening to watch the boats come home with their nets full of silver fish. ")
BASELINE_S = 1.0  # the short sessions decode this long, all streaming, before the long prompt arrives
SHORT_PROMPTS = ("Write a short poem about the sea.", "List three facts about the moon.",
                 "Explain what a compiler does.", "Describe a walk in the forest.")


def add_flags(parser) -> None:
    parser.add_argument("--prefill-service", default="target", choices=("target", "draft"),
                        help="--suite prefill: whose --prefill-chunk is compared: the target's (target-only "
                             "decoding) or the draft's (its model drafter's proposals)")
    parser.add_argument("--prefill-chunks", default="0,256",
                        help="--suite prefill: the service's --prefill-chunk values compared (0: one forward; the "
                             "target's: auto too)")
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
                spread(arrivals[i], time.perf_counter(), len(event.token_ids))
            if all(arrivals):
                streaming.set()
            if "first" in window:
                return

    async def long() -> None:
        await streaming.wait()
        await asyncio.sleep(BASELINE_S)
        window["sent"] = time.perf_counter()
        async for event in orch.generate(request(4), long_ids):
            if event.token_ids and "first" not in window:
                window["first"] = time.perf_counter()

    await alongside(long, short, len(short_ids))
    return window_figures(arrivals, window["sent"], window["first"], BASELINE_S)


def spread(times: list[float], now: float, tokens: int) -> None:
    """Add the arrival of an event of ``tokens`` tokens at ``now`` to ``times`` as that many rounds (target-only
    greedy: a token a round), spread evenly since the arrival before it. An event carries several tokens when
    their text was held back (a character incomplete until the last of them): the rounds went on meanwhile, and
    the gap is the text's, not the decoding's."""
    last = times[-1] if times else now
    times += [last + (now - last) * (j + 1) / tokens for j in range(tokens)]


async def alongside(long, short, shorts: int) -> None:
    """Run ``short(i)`` for each short session beside ``long()`` until all are done (stopped if one fails)."""
    tasks = [asyncio.ensure_future(short(i)) for i in range(shorts)]
    try:
        await long()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def window_figures(arrivals: list[list[float]], sent: float, first: float, baseline_s: float) -> dict:
    """The short sessions' gaps between arrivals (``arrivals``: each one's times) while the long prompt waited from
    ``sent`` to ``first``, and what arrived meanwhile; and their gaps in the ``baseline_s`` before ``sent``: a decode
    step (their median) and how many steps their p99 gap rose by (None without a gap there)."""
    gaps, before_gaps, tokens = [], [], 0
    for times in arrivals:
        inside = [t for t in times if sent <= t <= first]
        before = [t for t in times if t < sent]
        points = ([before[-1]] if before else []) + inside + [first]
        gaps += [b - a for a, b in zip(points, points[1:])]
        tokens += len(inside)
        baseline = [t for t in before if t >= sent - baseline_s]
        before_gaps += [b - a for a, b in zip(baseline, baseline[1:])]
    gaps.sort()
    before_gaps.sort()
    p99 = _rank(gaps, 0.99)
    baseline_figures = {"step_s": None, "others_p99_gap_before_s": None, "p99_rise_steps": None}
    if before_gaps:
        step, p99_before = statistics.median(before_gaps), _rank(before_gaps, 0.99)
        baseline_figures = {"step_s": round(step, 4), "others_p99_gap_before_s": round(p99_before, 3),
                            "p99_rise_steps": round((p99 - p99_before) / step, 2)}
    return {
        "long_ttft_s": round(first - sent, 3),
        "others_max_gap_s": round(gaps[-1], 3),
        "others_p99_gap_s": round(p99, 3),
        "others_p95_gap_s": round(_rank(gaps, 0.95), 3),
        "others_median_gap_s": round(statistics.median(gaps), 4),
        "others_tokens_per_s": round(tokens / (first - sent), 1),
        **baseline_figures,
    }


def _rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of ascending ``ordered`` (nearest rank)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


DRAFT_BLOCK = 4  # tokens a short session's proposal asks for (each taken whole, as if the target accepted it)
# The draft's short sessions grow their context a block a proposal, back to back: a shorter baseline keeps a small
# model's context from filling before the long one arrives.
DRAFT_BASELINE_S = 0.2


async def draft_session(stub, session_id: str, tokens: list[int]):
    """A model-drafter session opened on its own ``Session`` stream."""
    call = stub.Session(metadata=wire_metadata())
    await call.write(pb.DraftRequest(open=pb.DraftOpen(
        session_id=session_id, tokens=tokens, sampling=pb.SamplingParams(), drafter=pb.DRAFTER_KIND_MODEL)))
    reply = await call.read()
    if not reply.HasField("opened"):
        raise RuntimeError(f"the draft did not open {session_id}: {reply}")
    return call


async def draft_run(address: str, short_ids: list[list[int]], long_ids: list[int], run: int) -> dict:
    """Short sessions propose back to back; once each has, the long prompt opens and proposes; gaps meanwhile."""
    arrivals: list[list[float]] = [[] for _ in short_ids]
    streaming, done = asyncio.Event(), asyncio.Event()
    window: dict[str, float] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DraftServiceStub(channel)

        async def short(i: int) -> None:
            call = await draft_session(stub, f"short-{run}-{i}", short_ids[i])
            position, block = len(short_ids[i]), []
            while not done.is_set():
                await call.write(pb.DraftRequest(propose=pb.ProposeRequest(position=position, tokens=block,
                                                                          k=DRAFT_BLOCK)))
                position += len(block)
                block = list((await call.read()).block.tokens)
                arrivals[i].append(time.perf_counter())
                if all(arrivals):
                    streaming.set()
            call.cancel()

        async def long() -> None:
            await streaming.wait()
            await asyncio.sleep(DRAFT_BASELINE_S)
            window["sent"] = time.perf_counter()
            call = await draft_session(stub, f"long-{run}", long_ids)
            await call.write(pb.DraftRequest(propose=pb.ProposeRequest(position=len(long_ids), k=DRAFT_BLOCK)))
            await call.read()
            window["first"] = time.perf_counter()
            done.set()
            call.cancel()

        await alongside(long, short, len(short_ids))
    figures = window_figures(arrivals, window["sent"], window["first"], DRAFT_BASELINE_S)
    figures["others_proposals_per_s"] = figures.pop("others_tokens_per_s")  # an arrival here is a block
    return figures


async def measure(addresses: dict[str, str], tokenizer: str, args) -> dict:
    tok = models.load_tokenizer(tokenizer)
    text_ids = tok.encode(TEXT)
    long_ids = (text_ids * (args.prefill_prompt_tokens // len(text_ids) + 1))[: args.prefill_prompt_tokens]
    short_ids = [tok.encode(p) for p in SHORT_PROMPTS[: args.prefill_sessions]]
    short_ids += [short_ids[i % len(short_ids)] for i in range(len(short_ids), args.prefill_sessions)]
    if args.prefill_service == "draft":
        return await interleaved(list(addresses), lambda chunk, shorts, long, run: draft_run(
            addresses[chunk], shorts, long, run), short_ids, long_ids, args.prefill_repeats)
    orchs = {chunk: await Orchestrator.connect(OrchestratorConfig(address, "", tokenizer=tokenizer))
             for chunk, address in addresses.items()}
    try:
        return await interleaved(list(orchs), lambda chunk, shorts, long, run: one_run(orchs[chunk], shorts, long),
                                 short_ids, long_ids, args.prefill_repeats)
    finally:
        for orch in orchs.values():
            await orch.close()


async def interleaved(values: list[str], run_one, short_ids: list[list[int]], long_ids: list[int],
                      repeats: int) -> dict:
    """``run_one(value, short_ids, long_ids, run)`` for every value, after a warm-up run each (first calls pay
    one-off allocations), ``repeats`` times in alternating order; every run and each value's medians."""
    rows: dict[str, list[dict]] = {value: [] for value in values}
    for value in values:
        await run_one(value, short_ids[:1], long_ids[:64], -1)
    for repeat in range(repeats):
        for value in values if repeat % 2 == 0 else values[::-1]:
            rows[value].append(await run_one(value, short_ids, long_ids, repeat))
    return {"runs": rows,
            "medians": {value: {key: _median([r[key] for r in runs]) for key in runs[0]}
                        for value, runs in rows.items()}}


def _median(values: list) -> float | None:
    """The median of the runs' figures that exist (None where no run had one)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run(args) -> int:
    started = time.time()
    chunks = [c.strip() for c in args.prefill_chunks.split(",") if c.strip()]
    auto = ("auto",) if args.prefill_service == "target" else ()  # the target's chunks can be sized by its cost
    if not chunks or any(c not in auto and not (c.isdigit()) for c in chunks):
        raise ValueError(f"--prefill-chunks: values >= 0{' or auto' if auto else ''}, got {args.prefill_chunks!r}")
    service = args.prefill_service
    with ExitStack() as stack:
        addresses = {}
        for chunk in chunks:
            service_args = ["--model", args.model, "--threads", str(args.target_threads), "--prefill-chunk", chunk]
            if args.target_cpus:
                service_args += ["--cpus", args.target_cpus]
            if service == "draft":
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specsplit-")))
                process = processes.start_service("specsplit.draft_service.server", "draft", service_args, folder)
                stack.callback(process.stop)
            else:
                (process,) = stack.enter_context(processes.local_services(service_args, None))
            addresses[chunk] = process.address
        result = event_loop.run(measure(addresses, args.model, args))
    what = ("the draft's model drafter proposing blocks of 4 for" if service == "draft" else "target-only greedy;")
    report = {
        "benchmark": "prefill",
        "service": service,
        "model": args.model,
        "setup": (f"{what} {args.prefill_sessions} short sessions when a {args.prefill_prompt_tokens}-token prompt "
                  f"arrives; one {service} process per --prefill-chunk value, runs interleaved"),
        "machine": runs.machine(),
        **result,
        "duration_s": round(time.time() - started, 1),
    }
    path = runs.write(report, args.json)
    for chunk, m in result["medians"].items():
        print(f"{service} --prefill-chunk {chunk:>5}: long TTFT {m['long_ttft_s']:.2f} s; others' largest gap "
              f"{m['others_max_gap_s']:.2f} s, p99 {m['others_p99_gap_s']:.2f} s"
              + (f" (+{m['p99_rise_steps']:.1f} steps of {m['step_s']:.3f} s)" if m["step_s"] is not None else "")
              + f", p95 {m['others_p95_gap_s']:.2f} s, median {m['others_median_gap_s']:.3f} s, "
              + (f"{m['others_proposals_per_s']:.1f} proposals/s" if service == "draft"
                 else f"{m['others_tokens_per_s']:.1f} tok/s") + " meanwhile")
    print(f"-> {path}")
    return 0
