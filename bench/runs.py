"""What every ``specsplit bench`` run shares: the services' flags, the HF anchor model, the JSON header."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from specsplit.bench import demo, traffic
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind


def service_args(args) -> tuple[list[str], list[str]]:
    target_args, draft_args = demo.service_args(args)
    if args.target_cpus:
        target_args += ["--cpus", args.target_cpus]
    if args.draft_cpus:
        draft_args += ["--cpus", args.draft_cpus]
    return target_args, draft_args


def settings_of(args) -> traffic.Settings:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    return traffic.Settings(
        drafter=DrafterKind[args.drafter.upper()], k=args.k, adaptive=not args.fixed_k, overlap=not args.no_overlap,
        max_new_tokens=args.max_new_tokens, lookups=tuple(int(n) for n in args.hf_lookup.split(",") if n.strip()),
        hf=not args.no_hf, repeats=args.repeats,
    )


def load_anchor_model(args):
    """The target's weights in this process for the HF anchors, with the target's thread count."""
    torch.set_num_threads(args.target_threads)
    return models.load_model(models.ModelSpec(args.model, args.device, args.dtype))


def header(args) -> dict:
    return {
        "target": args.model,
        "drafter": args.drafter,
        "draft_model": args.draft_model or None,
        "self_draft_flags": demo.self_draft_flags(args) if not args.draft_model else [],
        "chain": [k.name.lower() for k in demo.chain_members(args)],
        "prompt_set": args.prompt_set,
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "ngram": [args.ngram_min, args.ngram_max],
        "adaptive_k": not args.fixed_k,
        "overlap": not args.no_overlap,
        "tp": args.tp,
        "target_threads": args.target_threads,
        "draft_threads": args.draft_threads,
        "target_cpus": args.target_cpus or "unpinned",
        "draft_cpus": args.draft_cpus or "unpinned",
        "hf_anchors": "in the bench process, the target's threads, interleaved with the services' runs",
        "machine": machine(),
    }


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}


def write(report: dict, path: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
