"""How often batched verification changes a greedy token, in bfloat16 and (as the control) float32.

A batched forward computes the same rows with other matmul shapes (more rows, padding to the longest
context), so a logit can differ in its last bits from the solo forward; where the two best logits are
that close, the argmax flips. The target engine runs in-process (``specsplit.target_service.engine``)
on the SmolLM2-135M target: for each dtype and block size k, every prompt's greedy continuation is
decoded alone (``TargetEngine.verify``) and ``--batch`` sessions at a time (``verify_batch``); with
k > 0 the draft tokens are the solo run's own continuation (an oracle drafter), so rows are k + 1
wide as in a speculative round. Sessions are compared up to their first divergence; the flip rate is
divergences / tokens compared. ``--paths default batch-invariant`` also decodes the batched sessions
on a ``batch_invariant=True`` target, interleaved, and reports both paths' batched tokens/s. Method
in full and findings: README.md.

    python experiments/bf16_flips/bf16_flips.py --json experiments/bf16_flips/bf16-flips.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Sequence

import torch

from specsplit.bench.prompts import SETS_DIR, chat_ids, load_prompt_set
from specsplit.lmkit import models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem


def first_divergence(solo: Sequence[int], batched: Sequence[int]) -> int | None:
    """The first index where the two outputs differ (a shorter one differs where it ends); None if equal."""
    for i, (a, b) in enumerate(zip(solo, batched)):
        if a != b:
            return i
    if len(solo) != len(batched):
        return min(len(solo), len(batched))
    return None


def compare(solo: Sequence[Sequence[int]], batched: Sequence[Sequence[int]]) -> dict:
    """Flip counts over sessions: each session's outputs are compared up to their first divergence."""
    if len(solo) != len(batched):
        raise ValueError(f"{len(solo)} solo outputs against {len(batched)} batched ones")
    divergences = [first_divergence(s, b) for s, b in zip(solo, batched)]
    compared = sum(len(s) if d is None else d + 1 for s, d in zip(solo, divergences))
    flips = sum(d is not None for d in divergences)
    return {
        "sessions": len(solo),
        "sessions_differing": flips,
        "first_divergence_positions": [d for d in divergences if d is not None],
        "tokens_compared": compared,
        "tokens_total": sum(len(s) for s in solo),
        "flip_rate_per_token": flips / compared if compared else 0.0,
    }


PATHS = {"default": False, "batch-invariant": True}  # --paths name: TargetEngine(batch_invariant=...)


def new_engine(model, batch_invariant: bool = False) -> TargetEngine:
    return TargetEngine(model, model_id="smollm2-135m", vocab_fingerprint="", limits=SessionLimits(max_block=8),
                        batch_invariant=batch_invariant)


def decode(engine: TargetEngine, prompts: Sequence[list[int]], new_tokens: int, k: int,
           oracle: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """Greedy continuations of ``prompts``, all verified together each round (one prompt: alone).

    Blocks are ``oracle``'s next k tokens (clipped to ``new_tokens``); k = 0 decodes one token a round.
    """
    sessions = [engine.open(f"s{i}", ids, SamplingParams(), VerificationMode.GREEDY) for i, ids in enumerate(prompts)]
    starts = [len(ids) for ids in prompts]
    for session in sessions:  # the prefill runs alone in the service too
        engine.verify(session, len(session.tokens), [], None)
    while True:
        items = []
        for i, (session, start) in enumerate(zip(sessions, starts)):
            done = len(session.tokens) - start
            if done >= new_tokens:
                continue
            room = min(k, new_tokens - done - 1)
            block = list(oracle[i][done : done + room]) if oracle is not None and room > 0 else []
            items.append(VerifyItem(session, len(session.tokens), block, None))
        if not items:
            break
        if len(items) == 1:
            engine.verify(items[0].session, items[0].position, items[0].draft_tokens, None)
        else:
            for result in engine.verify_batch(items):
                if isinstance(result, Exception):
                    raise result
    outputs = [session.tokens[start : start + new_tokens] for session, start in zip(sessions, starts)]
    for i in range(len(sessions)):
        engine.close(f"s{i}")
    return outputs


def run_dtype(model, prompts: list[list[int]], args) -> dict:
    engines = {path: new_engine(model, PATHS[path]) for path in args.paths}
    solo_engine = engines[args.paths[0]]  # alone, both paths run the same forward
    results = {}
    reference = [decode(solo_engine, [ids], args.new_tokens, 0, None)[0] for ids in prompts]  # solo, k = 0
    for k in args.blocks:
        start = time.perf_counter()
        solo = reference if k == 0 else [decode(solo_engine, [ids], args.new_tokens, k, [ref])[0]
                                         for ids, ref in zip(prompts, reference)]
        batched = {path: [] for path in args.paths}
        seconds = dict.fromkeys(args.paths, 0.0)
        for lo in range(0, len(prompts), args.batch):  # the paths take turns chunk by chunk
            chunk = slice(lo, lo + args.batch)
            for path in args.paths:
                began = time.perf_counter()
                batched[path] += decode(engines[path], prompts[chunk], args.new_tokens, k,
                                        reference[chunk] if k else None)
                seconds[path] += time.perf_counter() - began
        row = compare(solo, batched[args.paths[0]])
        if k:
            row["solo_vs_solo_k0"] = compare(reference, solo)  # block width alone changes a token?
        row["batched_tokens_per_s"] = round(len(prompts) * args.new_tokens / seconds[args.paths[0]], 1)
        for path in args.paths[1:]:
            row[path] = {**compare(solo, batched[path]),
                         "batched_tokens_per_s": round(len(prompts) * args.new_tokens / seconds[path], 1)}
        row["seconds"] = round(time.perf_counter() - start, 1)
        results[f"k={k}"] = row
        for path in args.paths:
            figures = row if path == args.paths[0] else row[path]
            print(f"  k={k} {path}: {figures['sessions_differing']}/{figures['sessions']} sessions differ, "
                  f"first divergences {figures['first_divergence_positions']}, "
                  f"{figures['tokens_compared']} tokens compared, flip rate {figures['flip_rate_per_token']:.4f}, "
                  f"batched {figures['batched_tokens_per_s']} tokens/s", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--prompts", type=int, default=16, help="first N prompts of the mixed set")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="keep each chat prompt's last N ids (the assistant header stays; prefills stay cheap)")
    parser.add_argument("--batch", type=int, default=8, help="sessions per shared forward")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 4], help="draft tokens per block (k)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", nargs="+", default=["default"], choices=list(PATHS),
                        help="target paths to decode the batched sessions on; the first one's figures are the row's")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = models.load_tokenizer(models.DEFAULT_MODEL)
    prompt_set = load_prompt_set(SETS_DIR / "mixed.jsonl")[: args.prompts]
    prompts = [chat_ids(tokenizer, p)[-args.prompt_tokens :] for p in prompt_set]
    results = {}
    started = time.perf_counter()
    with torch.inference_mode():
        for dtype in args.dtypes:  # the JSON is rewritten after each dtype
            print(f"{dtype}:", flush=True)
            # The same weights the target service loads with --dtype (the GGUF dequantised, then cast).
            model = models.load_model(models.ModelSpec(models.DEFAULT_MODEL, dtype="float32"))
            model = model.to(getattr(torch, dtype))
            results[dtype] = run_dtype(model, prompts, args)
            del model
            write_report(args, prompt_set, results, time.perf_counter() - started)
    return 0


def write_report(args, prompt_set, results: dict, seconds: float) -> None:
    report = {
        "bench": "bf16_flips",
        "model": models.DEFAULT_MODEL,
        "prompts": [p.name for p in prompt_set],
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "blocks": args.blocks,
        "paths": args.paths,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "note": "counts tokens; batched_tokens_per_s compares paths only within one run (cpu-exclusive)",
        "seconds": round(seconds, 1),
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
