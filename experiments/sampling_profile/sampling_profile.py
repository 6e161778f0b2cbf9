"""Where a sampled verification's decision time goes, against a greedy one of the same width.

A verification round is one target forward over w = k + 1 positions, then a decision over its
[w, vocab] logits; the forward costs the same greedy or sampled, the decision does not. On real
logits of the bundled SmolLM2 target this times each part of the decision: greedy argmax per row;
for sampling, temperature and top-k/top-p (``probs``), the verifier itself (``verify``), the random
draws (``draws``) and in DRAFT_PROBS mode the fp16 codec of q (``codec``); for TOKEN_ONLY,
DRAFT_PROBS and COUPLED at widths 2, 5 and 9, every block rejected at its first position
(``reject@0``) or accepted whole (``accept-all``), a lazy verifier's best and worst cases.
``--before REV`` also loads ``lmkit/sampling.py`` and ``target_service/rejection.py`` as they are at
git revision REV and times their decision path interleaved with the working tree's, repetition by
repetition (an A/B of a change to the verifier). Writes JSON:

    python experiments/sampling_profile/sampling_profile.py [--before REV] --json experiments/sampling_profile/sampling-profile.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable

import torch

from specsplit.lmkit import draws, models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.probs_codec import decode_probs, encode_probs, quantize_probs
from specsplit.lmkit.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]  # the checkout: --before reads its git history
SETTINGS = {
    "T=0.7,top_p=0.95": SamplingParams(temperature=0.7, top_p=0.95, seed=1),
    "T=1.0": SamplingParams(temperature=1.0, seed=1),
}
WIDTHS = (2, 5, 9)
MODES = (VerificationMode.TOKEN_ONLY, VerificationMode.DRAFT_PROBS, VerificationMode.COUPLED)


def load_at(rev: str, path: str, name: str) -> types.ModuleType:
    """The module at ``path`` as it was at git revision ``rev`` (its imports resolve to today's tree)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source.stdout, f"{rev}:{path}", "exec"), module.__dict__)  # noqa: S102 - our own history
    return module


def implementation(sampling_module, rejection_module) -> Callable:
    """The decision over one block's logits, as the target engine makes it with these two modules."""

    def decide(mode, params, position, logits, tokens, draft_probs):
        if mode is VerificationMode.COUPLED:
            noise = lambda i, ids: draws.gumbel(params.seed, draws.Stream.COUPLED, position + i, ids)  # noqa: E731
            if hasattr(sampling_module, "rows_when_reached"):  # the engine's path: rows made when reached
                row = sampling_module.rows_when_reached(logits, params)
                return rejection_module.verify_coupled_rows(row, tokens, logits.shape[1], noise)
            if hasattr(rejection_module, "verify_coupled_rows"):  # row by row
                row = lambda i: sampling_module.logits_to_probs(logits[i : i + 1], params)[0]  # noqa: E731
                return rejection_module.verify_coupled_rows(row, tokens, logits.shape[1], noise)
            return rejection_module.verify_coupled(sampling_module.logits_to_probs(logits, params), tokens, noise)
        uniforms = draws.uniforms(params.seed, draws.Stream.TARGET, range(position, position + len(tokens) + 1), 2)
        if hasattr(rejection_module, "verify_token_only_rows"):  # the engine's path: rows made when reached
            row = sampling_module.rows_when_reached(logits, params)
            if mode is VerificationMode.TOKEN_ONLY:
                return rejection_module.verify_token_only_rows(row, tokens, logits.shape[1], uniforms)
            return rejection_module.verify_draft_probs_rows(row, draft_probs, tokens, logits.shape[1], uniforms)
        target = sampling_module.logits_to_probs(logits, params)
        if mode is VerificationMode.TOKEN_ONLY:
            return rejection_module.verify_token_only(target, tokens, uniforms)
        return rejection_module.verify_draft_probs(target, draft_probs, tokens, uniforms)

    return decide


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def real_logits(model, tokenizer, width: int) -> torch.Tensor:
    """[width, vocab] logits of SmolLM2 at the end of a real prompt (float32)."""
    text = "Summarise in one sentence: The Rhine flows from the Swiss Alps to the North Sea, past Basel and Cologne."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -width:].float()


def blocks(logits: torch.Tensor, params: SamplingParams, current) -> dict[str, torch.Tensor]:
    """Draft blocks that the target rejects at once, or accepts whole (the tokens it would pick itself)."""
    probs = current.logits_to_probs(logits, params)
    top = probs.argmax(dim=-1)[:-1]  # accepted with the highest chance; in coupled mode usually all accepted
    least = torch.where(probs[:-1] > 0, probs[:-1], torch.inf).argmin(dim=-1)  # kept but unlikely: p(x) small
    zero = (probs[:-1] == 0).float().argmax(dim=-1)  # a token outside the support: rejected for sure
    return {"reject@0": torch.where(probs[:-1, zero[0]] == 0, zero, least), "accept-all": top}


def profile(args) -> dict:
    torch.set_num_threads(args.threads)
    tokenizer = models.load_tokenizer(models.DEFAULT_MODEL)
    model = models.load_model(models.ModelSpec(models.DEFAULT_MODEL))
    current_sampling = importlib.import_module("specsplit.lmkit.sampling")
    current = {"after": implementation(current_sampling, importlib.import_module("specsplit.target_service.rejection"))}
    if args.before:
        old_sampling = load_at(args.before, "lmkit/sampling.py", "before_sampling")
        old_rejection = load_at(args.before, "target_service/rejection.py", "before_rejection")
        current = {"before": implementation(old_sampling, old_rejection), **current}
    rows = []
    for width in WIDTHS:
        logits = real_logits(model, tokenizer, width)
        ids = torch.zeros(1, width, dtype=torch.long)
        forward_s = timed(lambda: model(ids), args.forward_repeats)  # noqa: B023 - used at once
        greedy_s = timed(lambda: logits.max(dim=-1), args.repeats)  # noqa: B023
        for setting, params in SETTINGS.items():
            q = quantize_probs(current_sampling.logits_to_probs(logits[:-1] + 0.3 * torch.randn_like(logits[:-1]),
                                                                params))
            codec_s = timed(lambda: decode_probs(encode_probs(q)), args.repeats)  # noqa: B023
            draws_s = timed(lambda: draws.uniforms(1, draws.Stream.TARGET, range(100, 100 + width), 2), args.repeats)  # noqa: B023
            for case, tokens in blocks(logits, params, current_sampling).items():
                for mode in MODES:
                    row = {"width": width, "setting": setting, "case": case, "mode": mode.name,
                           "forward_s": forward_s, "greedy_decide_s": greedy_s, "draws_s": draws_s,
                           "codec_s": codec_s if mode is VerificationMode.DRAFT_PROBS else 0.0}
                    probs_q = q if mode is VerificationMode.DRAFT_PROBS else None
                    for _ in range(args.rounds):  # interleaved: before, after, before, after, ...
                        for name, decide in current.items():
                            call = lambda d=decide: d(mode, params, 100, logits, tokens, probs_q)  # noqa: B023, E731
                            row.setdefault(f"{name}_decide_s", []).append(timed(call, args.repeats))
                    for name in current:
                        row[f"{name}_decide_s"] = statistics.median(row[f"{name}_decide_s"])
                    row["probs_s"] = timed(lambda: current_sampling.logits_to_probs(logits, params), args.repeats)  # noqa: B023
                    rows.append(row)
                    print(json.dumps({k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in row.items()}),
                          flush=True)
    return {"rows": rows, "sessions": across_sessions(model, tokenizer, args) if args.sessions else []}


def across_sessions(model, tokenizer, args) -> list[dict]:
    """Row 0 of n sessions' blocks (T 0.7, top-p 0.95, a seed each): one ``logits_to_probs`` call per session,
    as before, against ``first_rows`` (one call for all), interleaved."""
    from specsplit.lmkit.sampling import first_rows, logits_to_probs

    logits = real_logits(model, tokenizer, 32)  # [32, vocab]: 32 real rows stand for 32 sessions' rows 0
    figures = []
    for n in (int(v) for v in args.sessions.split(",")):
        blocks = [(logits[i : i + 1], SamplingParams(temperature=0.7, top_p=0.95, seed=i)) for i in range(n)]
        times: dict[str, list[float]] = {"separate_s": [], "together_s": []}
        for _ in range(args.rounds):
            times["separate_s"].append(timed(lambda b=blocks: [logits_to_probs(x[:1], p) for x, p in b], args.repeats))
            times["together_s"].append(timed(lambda b=blocks: first_rows(b), args.repeats))
        row = {"sessions": n, **{k: statistics.median(v) for k, v in times.items()}}
        figures.append(row)
        print(json.dumps({k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in row.items()}), flush=True)
    return figures


def header(what: str, args) -> dict:
    """What a profile's JSON starts with: what it holds, its flags, the commit, host and torch."""
    return {
        "what": what,
        "args": vars(args),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "host": platform.node(),
        "torch": torch.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--before", default="", help="git revision whose sampling/rejection modules to time as well")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15, help="calls per timing (median)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved before/after rounds per cell")
    parser.add_argument("--forward-repeats", type=int, default=5)
    parser.add_argument("--sessions", default="1,4,8,16,32",
                        help="row 0 of this many sessions' blocks, one call each vs one call for all ('' skips)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = {**header("seconds per verification decision (median), real SmolLM2 logits; forward_s for scale", args),
              **profile(args)}
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
