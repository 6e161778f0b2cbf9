"""The measurements of ``bench/gpu_check``, one function per stage; each returns a JSON-ready dict.

Service stages talk to the real draft and target services over gRPC, as the
orchestrator does: raw session streams for the step costs (the services report
each call's compute time; the client times the round trip around it) and the
orchestrator itself for end-to-end decoding. The device stages (copy
bandwidth, host syncs per forward) run in this process and need CUDA.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specsplit.bench.evaluation import theoretical_speedup
from specsplit.bench.oracle_drafter import ORACLE, Oracle
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.decode.peers import DraftStream, TargetStream, draft_client, target_client
from specsplit.v1 import specsplit_pb2 as pb

GREEDY = SamplingParams()


@dataclass(frozen=True)
class Sizes:
    """How much each stage measures; the tiny sizes keep the CPU run inside the tests short."""

    prompt_len: int
    warmup: int
    reps: int  # per verify width and per draft k
    widths: tuple[int, ...]  # verify widths (draft tokens + 1)
    batch_levels: tuple[int, ...]  # concurrent sessions
    batch_rounds: int
    prompts: int  # end to end
    new_tokens: int
    k: int
    alphas: tuple[float, ...]
    k_sweep: tuple[int, ...]  # more k at alpha 0.8
    equality_prompts: int
    equality_tokens: int
    contexts: tuple[int, ...]  # positions a session holds when the static step is timed at them


REAL_SIZES = Sizes(prompt_len=512, warmup=3, reps=10, widths=tuple(range(1, 17)),
                   batch_levels=(1, 2, 4, 8, 16, 32, 64), batch_rounds=8, prompts=4, new_tokens=128, k=4,
                   alphas=(0.5, 0.7, 0.8, 0.9, 1.0), k_sweep=(2, 8), equality_prompts=8, equality_tokens=64,
                   contexts=(512, 4096, 16384))
TINY_SIZES = Sizes(prompt_len=16, warmup=1, reps=2, widths=(1, 2, 5, 8, 16), batch_levels=(1, 2, 4),
                   batch_rounds=3, prompts=2, new_tokens=24, k=4, alphas=(0.8, 1.0), k_sweep=(),
                   equality_prompts=4, equality_tokens=16, contexts=(16, 64))


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _ms(values) -> float:
    return round(statistics.median(values), 3) if values else 0.0


# -- target: decode step and verify widths ------------------------------------------------------------------
def _open_target(prompt: list[int], session_id: str) -> pb.TargetOpen:
    return pb.TargetOpen(session_id=session_id, tokens=prompt, mode=VerificationMode.GREEDY.value)


async def target_steps(address: str, prompt: list[int], sizes: Sizes, vocab: int) -> dict:
    """t(width) for each width, interleaved in shuffled order each repeat; ratios to t(1)."""
    client = target_client(address)
    stream = TargetStream.over(client.stub.Session())
    rng = random.Random(1)
    samples: dict[int, list[tuple[float, float]]] = {w: [] for w in sizes.widths}
    try:
        await stream.open(_open_target(prompt, "gpu-check-steps"))
        position = len(prompt)
        result = await stream.verify(position, [], None)  # the prefill
        position += result.accepted + 1
        for rep in range(sizes.warmup + sizes.reps):
            for width in rng.sample(list(sizes.widths), len(sizes.widths)):
                block = [rng.randrange(vocab) for _ in range(width - 1)]
                start = time.perf_counter()
                result = await stream.verify(position, block, None)
                wall_ms = (time.perf_counter() - start) * 1e3
                position += result.accepted + 1
                if rep >= sizes.warmup:
                    samples[width].append((result.timing.compute_us / 1e3, wall_ms))
    finally:
        await stream.close()
        await client.close()
    compute = {w: _ms([c for c, _ in s]) for w, s in samples.items()}
    step = compute[1]
    return {
        "context_tokens": len(prompt),
        "decode_step_ms": step,
        "verify_ms": {str(w): compute[w] for w in sizes.widths},
        "verify_over_step": {str(w): round(compute[w] / step, 3) if step else 0.0 for w in sizes.widths},
        "round_trip_ms": {str(w): _ms([wall for _, wall in s]) for w, s in samples.items()},
        # gRPC, serialization, scheduling and Python around one target call, without a draft
        "target_call_overhead_ms": _ms([wall - c for c, wall in samples[1]]),
        "repeats": sizes.reps,
    }


# -- draft: step cost ------------------------------------------------------------------------------------
async def _draft_token_ms(client, prompt: list[int], sizes: Sizes, vocab: int, session_id: str,
                          sampling: pb.SamplingParams) -> dict[int, float]:
    """One model-drafter session's cost per drafted token at k = 1 and k = sizes.k (service compute time)."""
    stream = DraftStream.over(client.stub.Session())
    rng = random.Random(2)
    per_k: dict[int, list[float]] = {1: [], sizes.k: []}
    try:
        await stream.open(pb.DraftOpen(session_id=session_id, tokens=prompt, drafter=DrafterKind.MODEL.value,
                                       sampling=sampling))
        position = len(prompt)
        await stream.propose(position, [], 1)  # the prefill
        for rep in range(sizes.warmup + sizes.reps):
            for k in per_k:
                block = await stream.propose(position, [rng.randrange(vocab)], k)  # one committed token, then k
                position += 1
                if rep >= sizes.warmup:
                    per_k[k].append(block.timing.compute_us / 1e3 / k)
    finally:
        await stream.close()
    return {k: _ms(v) for k, v in per_k.items()}


async def draft_steps(address: str, prompt: list[int], sizes: Sizes, vocab: int, target_step_ms: float) -> dict:
    """The model drafter's cost per drafted token at k = 1 and k = sizes.k, and c against the target step: greedy
    (under --compile cuda-graphs each block is one replay of a captured chain), and the same tokens drafted token by
    token (a zero logit bias sends the request down the per-token loop over the same captured step)."""
    client = draft_client(address)
    try:
        token_ms = await _draft_token_ms(client, prompt, sizes, vocab, "gpu-check-draft", pb.SamplingParams())
        one_by_one = await _draft_token_ms(client, prompt, sizes, vocab, "gpu-check-draft-loop",
                                           pb.SamplingParams(logit_bias={0: 0.0}))
    finally:
        await client.close()
    return {
        "draft_token_ms": {str(k): v for k, v in token_ms.items()},
        "draft_token_ms_token_by_token": {str(k): v for k, v in one_by_one.items()},
        "cost_ratio_c": round(token_ms[sizes.k] / target_step_ms, 4) if target_step_ms else 0.0,
        "k": sizes.k,
    }


# -- batched verification ----------------------------------------------------------------------------------
async def _batched_session(address: str, index: int, prompt: list[int], rounds: int, k: int, vocab: int,
                           ready: asyncio.Barrier) -> list[pb.VerifyResult]:
    rng = random.Random(100 + index)
    results = []
    client = target_client(address)
    stream = TargetStream.over(client.stub.Session())
    try:
        try:
            await stream.open(_open_target(prompt, f"gpu-check-batch-{index}"))
            result = await stream.verify(len(prompt), [], None)  # the prefill runs alone
            position = len(prompt) + result.accepted + 1
            await ready.wait()
        except BaseException:
            await ready.abort()  # the others and the timer stop waiting
            raise
        for _ in range(rounds):
            result = await stream.verify(position, [rng.randrange(vocab) for _ in range(k)], None)
            position += result.accepted + 1
            results.append(result)
    finally:
        await stream.close()
        await client.close()
    return results


async def batched_verify(address: str, prompts: list[list[int]], sizes: Sizes, vocab: int, step_ms: float) -> dict:
    """N sessions each verifying blocks of k tokens at once: the shared forward's time and the throughput."""
    levels = []
    for n in sizes.batch_levels:
        ready = asyncio.Barrier(n + 1)
        tasks = [asyncio.create_task(_batched_session(address, i, prompts[i % len(prompts)], sizes.batch_rounds,
                                                      sizes.k, vocab, ready)) for i in range(n)]
        await ready.wait()  # every prefill done: time the decode rounds alone
        start = time.perf_counter()
        per_session = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        results = [r for rs in per_session for r in rs]
        forward_ms = _ms([r.timing.compute_us / 1e3 for r in results])
        levels.append({
            "sessions": n,
            "mean_batch_size": round(statistics.mean(r.forward.batch_size for r in results), 2),
            "forward_ms": forward_ms,
            "forward_over_step": round(forward_ms / step_ms, 3) if step_ms else 0.0,
            "verified_tokens_per_s": round(len(results) * (sizes.k + 1) / wall, 1),
            "committed_tokens_per_s": round(sum(r.accepted + 1 for r in results) / wall, 1),
        })
    return {"k": sizes.k, "rounds": sizes.batch_rounds, "levels": levels}


# -- end to end through the orchestrator --------------------------------------------------------------------
async def _generate(orch: Orchestrator, prompt: list[int], k: int, drafter: DrafterKind, max_new: int):
    request = GenerationRequest("", False, max_new, GREEDY, (), k, drafter, False, adaptive_k=False, overlap=False)
    ids, final = [], None
    async for event in orch.generate(request, list(prompt)):
        ids.extend(event.token_ids)
        final = event if event.finish is not None else final
    return ids, final.stats


def _run_figures(runs) -> dict:
    """Totals over a list of (ids, stats) runs."""
    tokens = sum(len(ids) for ids, _ in runs)
    wall = sum(s.wall_s for _, s in runs)
    rounds = sum(s.rounds for _, s in runs)
    drafted = sum(s.drafted_tokens for _, s in runs)
    draft_s = sum(s.draft_compute_s for _, s in runs)
    target_s = sum(s.target_compute_s for _, s in runs)
    return {
        "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "rounds": rounds, "drafted": drafted, "accepted": sum(s.accepted_tokens for _, s in runs),
        # rounds the orchestrator decoded without the draft because it was late or down: should be 0
        "draft_fallback_rounds": sum(s.draft_fallback_rounds for _, s in runs),
        "tokens_per_round": round(tokens / rounds, 3) if rounds else 0.0,
        "draft_token_ms": round(draft_s / drafted * 1e3, 3) if drafted else 0.0,
        "target_ms_per_round": round(target_s / rounds * 1e3, 3) if rounds else 0.0,
        # what the split costs per round beyond the services' compute: gRPC, serialization, Python
        "overhead_ms_per_round": round((wall - draft_s - target_s) / rounds * 1e3, 3) if rounds else 0.0,
    }


def _identical(runs, reference: list[list[int]]) -> dict:
    firsts = [next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), None) for (ids, _), ref in
              zip(runs, reference)]
    return {"identical": f"{sum(ids == ref for (ids, _), ref in zip(runs, reference))}/{len(reference)}",
            "first_divergence": firsts}


async def end_to_end(target: str, draft: str, tokenizer: str, prompts: list[list[int]], sizes: Sizes,
                     oracle_file: Path, step_ms: float, verify_over_step: dict, deadline: float) -> dict:
    """Target-only decoding, then the oracle drafter at each α (k fixed, sync): speedup and Leviathan's bound."""
    orch = await Orchestrator.connect(OrchestratorConfig(target, draft, tokenizer=tokenizer, max_concurrent=256))
    try:
        await _generate(orch, prompts[0], 0, ORACLE, 4)  # warm-up
        baseline = [await _generate(orch, p, 0, ORACLE, sizes.new_tokens) for p in prompts]
        truth = [ids for ids, _ in baseline]
        base = _run_figures(baseline)
        plan = [(alpha, sizes.k) for alpha in sizes.alphas] + [(0.8, k) for k in sizes.k_sweep]
        runs = []
        for alpha, k in plan:
            if time.monotonic() > deadline:
                runs.append({"alpha": alpha, "k": k, "skipped": "out of the time budget"})
                continue
            Oracle(alpha, {tuple(p): t for p, t in zip(prompts, truth)}, seed=int(alpha * 100) + k).write(oracle_file)
            spec = [await _generate(orch, p, k, ORACLE, sizes.new_tokens) for p in prompts]
            runs.append(_alpha_figures(alpha, k, spec, truth, base, step_ms, verify_over_step))
        again = _run_figures([await _generate(orch, p, 0, ORACLE, sizes.new_tokens) for p in prompts[:1]])
    finally:
        await orch.close()
    drift = again["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": sizes.new_tokens,
            "target_only": base, "target_only_again_tokens_per_s": again["tokens_per_s"],
            # the machine's drift over the stage (target-only again, first prompt, at the end): far from 1
            # means the speedups, all against the first target-only run, are not to be trusted
            "target_only_drift": round(drift, 3), "runs": runs}


def _alpha_figures(alpha, k, spec, truth, base, step_ms, verify_over_step) -> dict:
    figures = _run_figures(spec)
    c = figures["draft_token_ms"] / step_ms if step_ms else 0.0
    speedup = figures["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
    bound = theoretical_speedup(alpha, k, c)
    expected = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    verify_cost = verify_over_step.get(str(k + 1))
    return {
        "alpha": alpha, "k": k, **figures,
        "expected_tokens_per_round": round(expected, 3),
        "acceptance_rate": round(figures["accepted"] / figures["drafted"], 4) if figures["drafted"] else 0.0,
        "cost_ratio_c": round(c, 4),
        "speedup": round(speedup, 3),
        "leviathan_bound": round(bound, 3),
        "efficiency_vs_bound": round(speedup / bound, 3) if bound else 0.0,
        # the bound again with verification costing what it measured, t(k+1)/t(1), instead of one step
        "bound_with_measured_verify": round(expected / (k * c + verify_cost), 3) if verify_cost else None,
        "overhead_over_step": round(figures["overhead_ms_per_round"] / step_ms, 4) if step_ms else 0.0,
        "equal_to_target_only": _identical(spec, truth),
    }


async def greedy_equality(target: str, tokenizer: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """The same prompts target-only, one at a time and all at once (batched verification): do tokens flip?"""
    orch = await Orchestrator.connect(OrchestratorConfig(target, "", tokenizer=tokenizer, max_concurrent=256))
    try:
        solo = [await _generate(orch, p, 0, ORACLE, new_tokens) for p in prompts]
        together = await asyncio.gather(*(_generate(orch, p, 0, ORACLE, new_tokens) for p in prompts))
    finally:
        await orch.close()
    reference = [ids for ids, _ in solo]
    same = _identical(together, reference)
    flipped = sum(a != b for (ids, _), ref in zip(together, reference) for a, b in zip(ids, ref))
    return {"prompts": len(prompts), "new_tokens": new_tokens, **same, "tokens_differing": flipped,
            "mean_batch_size": round(statistics.mean(s.mean_batch_size for _, s in together), 2)}


# -- in this process, on the device ------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, gigabytes: float = 2.0, reps: int = 10) -> dict:
    """Device-to-device copy, bytes read plus written per second (METHOD.md's ceiling)."""
    src = torch.rand(int(gigabytes * 2**30 / 4), device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_bytes": moved, "bandwidth_gb_s": round(moved / seconds / 1e9, 1)}


def sync_audit(model, width: int = 5, sessions: int = 4) -> dict:
    """Host synchronisations per forward of the engine's two paths (CUDA's sync debug mode counts them)."""
    from specsplit.lmkit.kvcache import SessionCache
    from specsplit.target_service.batched_forward import Step, forward_batch

    vocab = int(model.config.vocab_size)
    prompts = random_prompts(sessions, 64, vocab, seed=3)
    caches = [SessionCache(model) for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        cache.logits(prompt, [])
    blocks = random_prompts(sessions, width - 1, vocab, seed=4)

    def counted(fn) -> tuple[int, list[str]]:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        return len(syncs), [f"{place} x{n}" for place, n in where.most_common(8)]

    solo, solo_where = counted(lambda: caches[0].logits([*prompts[0], 7], blocks[0]))
    steps = [Step(c, *c.plan([*p, 7], b), width) for c, p, b in zip(caches[1:], prompts[1:], blocks[1:])]
    batched, batched_where = counted(lambda: forward_batch(model, steps))
    return {"layers": int(model.config.num_hidden_layers), "syncs_per_solo_forward": solo,
            "syncs_per_batched_forward": batched, "solo_sync_sites": solo_where, "batched_sync_sites": batched_where}


# the target's forward: transformers', the decoder step eager and compiled, the static step captured as CUDA
# graphs (uncaptured off CUDA) with eager or compiled per-token functions
STEP_KINDS = ("stock", "eager", "inductor", "cuda-graphs", "inductor+cuda-graphs")


def step_kinds(model, sizes: Sizes, vocab: int, kinds: tuple[str, ...] = STEP_KINDS) -> dict:
    """The target's forward each way the engine can run it, through the session cache the engine uses: ms per
    verify forward by width (context ``sizes.prompt_len``), a greedy decode, and how many of its tokens a
    verify of several at once flips (a near-tie in bf16) or another kind's decode differs on.

    ``stock``: transformers' forward over a ``DynamicCache`` (what a CUDA target runs today); ``eager``: the
    decoder step over KV buffers; ``inductor``: that step compiled (``--compile inductor``); ``cuda-graphs``:
    the static step of ``lmkit.graph_step`` captured per width bucket (run uncaptured off CUDA);
    ``inductor+cuda-graphs``: the same with compiled per-token functions. Each kind that fails is recorded
    with its error and the others still run."""
    from specsplit.lmkit import decoder_step, graph_step, packed_rows
    from specsplit.lmkit.kvcache import SessionCache

    prompt = random_prompts(1, sizes.prompt_len, vocab, seed=5)[0]
    block = random_prompts(1, max(sizes.widths), vocab, seed=6)[0]
    widths = [w for w in (1, 2, 4, 5, 8, 16) if w <= max(sizes.widths)]
    decode_len, verify_width = 2 * max(sizes.widths) + 1, 4
    out: dict = {"context_tokens": len(prompt), "decode_tokens": decode_len - 1, "verify_width": verify_width}
    reference: list[int] | None = None
    for kind in kinds:
        began = time.perf_counter()
        try:
            if kind.endswith("cuda-graphs"):
                device = next(model.parameters()).device
                static = graph_step.GraphStep(
                    model, slots=1, capacity=len(prompt) + 2 * decode_len + max(sizes.widths), max_width=max(sizes.widths),
                    graphs=device.type == "cuda", compile_fn=decoder_step.compiler("inductor") if "inductor" in kind else None)
                setup_s = time.perf_counter() - began
                cache = graph_step.GraphSessionCache(model, static, graph_step.Slots(1))  # what the engine holds
            elif kind != "stock":
                if not packed_rows.installed(model) and not packed_rows.install(model):
                    raise ValueError("the packed-rows forward cannot run this model")
                packed_rows.use_step(model, decoder_step.DecoderStep(
                    model, decoder_step.compiler(kind) if kind != "eager" else None))
                if kind != "eager":
                    packed_rows.warm_up(model)
            if not kind.endswith("cuda-graphs"):
                setup_s = time.perf_counter() - began
                cache = SessionCache(model)
            cache.logits(prompt, [])
            timed = {}
            for width in widths:
                for _ in range(sizes.warmup):
                    cache.logits(prompt, block[: width - 1])
                samples = []
                for _ in range(sizes.reps):
                    start = time.perf_counter()
                    cache.logits(prompt, block[: width - 1])  # logits come back to the host: the device is done
                    samples.append((time.perf_counter() - start) * 1e3)
                timed[str(width)] = _ms(samples)
            tokens, margins = list(prompt), []
            for _ in range(decode_len):
                logits = cache.logits(tokens, [])[-1]
                top = logits.topk(2).values
                margins.append(float((top[0] - top[1]) / logits.std()))
                tokens.append(int(logits.argmax()))
            decoded = tokens[len(prompt):]
            flips = 0
            for first in range(0, decode_len - verify_width, verify_width):
                rows = cache.logits([*prompt, *decoded[: first + 1]], decoded[first + 1 : first + verify_width])
                flips += sum(int(a) != b for a, b in zip(rows.argmax(-1).tolist(), decoded[first + 1 : first + verify_width + 1]))
            reference = decoded if reference is None else reference
            differ = next((i for i, (a, b) in enumerate(zip(decoded, reference)) if a != b), None)
            out[kind] = {"setup_s": round(setup_s, 1), "verify_ms": timed,
                         "verify_over_step": {w: round(ms / timed["1"], 3) for w, ms in timed.items()},
                         "argmax_margin_over_std": {"min": round(min(margins), 3), "median": round(statistics.median(margins), 3)},
                         "verify_flips": flips, "first_token_differing_from_first_kind": differ}
        except Exception as exc:  # noqa: BLE001 - a kind that cannot run is a figure of this stage
            out[kind] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if "1" in out.get("stock", {}).get("verify_ms", {}):
        for kind in kinds[1:]:
            if "verify_ms" in out.get(kind, {}):
                out[kind]["step_speedup_vs_stock"] = {w: round(out["stock"]["verify_ms"][w] / ms, 3)
                                                      for w, ms in out[kind]["verify_ms"].items()}
    return out


def static_contexts(model, sizes: Sizes, vocab: int, block_size: int = 16) -> dict:
    """The static step (``lmkit.graph_step``, captured on CUDA) for one session holding each of ``sizes.contexts``
    positions, in a step whose sessions may hold the longest: ms per verify of w tokens reading the span of blocks
    the session holds, and the same step forced to read every block a session may hold (what a step over
    fixed-capacity slots reads), so t(1) against the context shows whether the cost follows the tokens held."""
    import torch

    from specsplit.lmkit import graph_step

    device = next(model.parameters()).device
    widths = [w for w in (1, 4, 16) if w <= max(sizes.widths)]
    longest = max(sizes.contexts)
    began = time.perf_counter()
    step = graph_step.GraphStep(model, slots=1, capacity=longest + max(widths), max_width=max(widths),
                                graphs=device.type == "cuda", block_size=block_size,
                                min_read=min(512, min(sizes.contexts)))
    out: dict = {"setup_s": round(time.perf_counter() - began, 1), "block_size": block_size,
                 "spans_blocks": list(step.spans), "graphs": len(step.graphs),
                 "kv_gb": round(sum(t.numel() * t.element_size() for t in (*step.keys, *step.values)) / 1e9, 3),
                 "contexts": []}
    prompt = random_prompts(1, longest, vocab, seed=7)[0]
    block = random_prompts(1, max(widths), vocab, seed=8)[0]

    def once(context: int, width: int, full: bool) -> float:
        if full:  # every block a session may hold, as fixed slots read
            step.span_for = lambda end: step.spans[-1]
        try:
            start = time.perf_counter()
            float(step.forward(0, context, block[:width])[-1, 0])  # a value on the host: the device is done
            return (time.perf_counter() - start) * 1e3
        finally:
            step.__dict__.pop("span_for", None)

    def timed(context: int, width: int) -> tuple[float, float]:
        """(reading the span held, reading every block): the two measured in turn, rep by rep."""
        for _ in range(sizes.warmup):
            once(context, width, False)
            once(context, width, True)
        held, full = [], []
        for _ in range(sizes.reps):
            held.append(once(context, width, False))
            full.append(once(context, width, True))
        return _ms(held), _ms(full)

    filled = 0
    for context in sizes.contexts:
        for first in range(filled, context, max(widths)):
            step.forward(0, first, prompt[first : min(first + max(widths), context)])
        filled = context
        times = {str(w): timed(context, w) for w in widths}
        row = {"context": context, "span_blocks": step.span_for(context + max(widths)),
               "verify_ms": {w: t[0] for w, t in times.items()},
               "verify_ms_full_span": {w: t[1] for w, t in times.items()}}
        row["full_span_over_held"] = round(row["verify_ms_full_span"]["1"] / row["verify_ms"]["1"], 3)
        out["contexts"].append(row)
    del step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def leviathan_curve(k: int, c: float, points: int = 21) -> list[tuple[float, float]]:
    return [(a / (points - 1), theoretical_speedup(a / (points - 1), k, c)) for a in range(points)]
