"""What a verify pass of width w costs the target: t(w)/t(1), stock forward against the fast one.

    python experiments/verify_width/verify_width.py --json experiments/verify_width/verify-width.json [--threads 2,1]

One process, one checkpoint loaded twice: ``stock`` as transformers runs it (``DynamicCache``, MKL
linears, SDPA with repeated keys/values, a padded gather for batches), ``fast`` as the target runs
it (``TargetEngine(fast_forward=True)``: oneDNN-packed linears, ``KVBuffer``, packed rows). Widths,
variants and repeats are interleaved, so drift on a shared machine hits both alike; figures are
medians. Parts: ``solo`` (a session with a warm cache of C tokens feeds its last token plus a block
of w - 1, for C in ``--contexts``); ``batched`` (B sessions in one forward, equal widths, and one
wide row among narrow ones); ``breakdown`` (where the stock forward's time goes at each width:
torch profiler self time by kind of op, Python as wall time minus op time); ``agreement`` (the
share of positions where both variants' argmax agree).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from specsplit.lmkit import models, packed_rows
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.packed_linear import pack_linears
from specsplit.target_service.batched_forward import Step, forward_batch

WIDTHS = range(1, 10)
VOCAB = 49152


def _context(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _warm(model, context: list[int]) -> SessionCache:
    cache = SessionCache(model)
    cache.logits(context, [])
    return cache


def solo(variants: dict, contexts: list[int], repeats: int) -> tuple[dict, dict]:
    """Median ms per (variant, context, width), and argmax agreement of fast with stock."""
    times = {(v, c, w): [] for v in variants for c in contexts for w in WIDTHS}
    agree, total = 0, 0
    for c in contexts:
        context = _context(c, c)
        caches = {v: _warm(model, context) for v, model in variants.items()}
        for rep in range(repeats + 1):
            for w in WIDTHS:
                block = _context(w - 1, 1000 * rep + w)
                outs = {}
                for v, cache in caches.items():
                    seconds, outs[v] = _timed(partial(cache.logits, context, block))
                    if rep:  # the first pass warms every shape
                        times[(v, c, w)].append(seconds)
                agree += int((outs["stock"].argmax(-1) == outs["fast"].argmax(-1)).sum())
                total += w
    medians = {v: {str(c): {str(w): 1e3 * statistics.median(times[(v, c, w)]) for w in WIDTHS} for c in contexts}
               for v in variants}
    return medians, {"positions": total, "argmax_equal": agree}


def batched(variants: dict, context_len: int, repeats: int) -> dict:
    """Median ms of one forward over B sessions per layout, and per token."""
    layouts = {"4 x 1": [1] * 4, "4 x 5": [5] * 4, "8 x 1": [1] * 8, "8 x 5": [5] * 8, "7 x 1 + 1 x 9": [1] * 7 + [9]}
    times = {(v, name): [] for v in variants for name in layouts}
    for rep in range(repeats + 1):
        for name, widths in layouts.items():
            contexts = [_context(context_len + 7 * i, 50 + i) for i in range(len(widths))]
            blocks = [_context(w - 1, 2000 + i) for i, w in enumerate(widths)]
            for v, model in variants.items():
                caches = [_warm(model, c) for c in contexts]
                steps = [Step(cache, *cache.plan(c, b), len(b) + 1) for cache, c, b in zip(caches, contexts, blocks)]
                seconds, _ = _timed(partial(forward_batch, model, steps))
                if rep:
                    times[(v, name)].append(seconds)
    return {v: {name: 1e3 * statistics.median(times[(v, name)]) for name in layouts} for v in variants}


_KINDS = {
    "linear": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"),
    "kv copies": ("aten::cat", "aten::copy_", "aten::index_select"),
}


def breakdown(model, context_len: int, widths=(1, 2, 5, 9), calls: int = 5) -> dict:
    """Per width: ms per forward by kind of op (self CPU time) and the rest of the wall time (Python)."""
    from torch.profiler import ProfilerActivity, profile

    context = _context(context_len, 7)
    cache = _warm(model, context)
    out = {}
    for w in widths:
        block = _context(w - 1, 77)
        cache.logits(context, block)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(calls):
                cache.logits(context, block)
            wall = (time.perf_counter() - start) / calls
        by_kind = {kind: 0.0 for kind in (*_KINDS, "other ops")}
        for event in prof.key_averages():
            kind = next((k for k, names in _KINDS.items() if event.key in names), "other ops")
            by_kind[kind] += event.self_cpu_time_total / 1e3 / calls
        ops = sum(by_kind.values())
        by_kind = {k: round(v, 2) for k, v in by_kind.items()}
        by_kind["python and the rest"] = round(1e3 * wall - ops, 2)
        by_kind["wall"] = round(1e3 * wall, 2)
        out[str(w)] = by_kind
    return out


def ratios(medians: dict) -> dict:
    return {v: {c: {w: round(t / per_width["1"], 3) for w, t in per_width.items()} for c, per_width in per_ctx.items()}
            for v, per_ctx in medians.items()}


def run(args) -> dict:
    stock = models.load_model(models.ModelSpec(args.model))
    fast = copy.deepcopy(stock)
    pack_linears(fast)
    if not packed_rows.install(fast):
        raise SystemExit(f"{args.model} cannot run the packed-rows forward")
    variants = {"stock": stock, "fast": fast}
    contexts = [int(c) for c in args.contexts.split(",")]
    report = {
        "benchmark": "verify_width",
        "model": args.model,
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "repeats": args.repeats,
        "runs": {},
    }
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        medians, agreement = solo(variants, contexts, args.repeats)
        report["runs"][str(threads)] = {
            "threads": threads,
            "solo_ms": medians,
            "solo_ratio_to_width_1": ratios(medians),
            "agreement": agreement,
            "batched_ms": batched(variants, args.batch_context, args.repeats),
            "breakdown_ms": {v: breakdown(model, contexts[-1]) for v, model in variants.items()},
        }
        print(json.dumps({"threads": threads, "ratio": report["runs"][str(threads)]["solo_ratio_to_width_1"]}), flush=True)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python experiments/verify_width/verify_width.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the report here")
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--threads", default="2,1", help="torch threads, one run each")
    parser.add_argument("--contexts", default="128,512", help="cached tokens before the verified block")
    parser.add_argument("--batch-context", type=int, default=256, help="cached tokens per session in the batched runs")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    report = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
