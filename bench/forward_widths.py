"""What a target forward costs by its width: one token against two and more, on a real KV cache.

The round model (``orchestrator.rate``) prices a block of k by the forward over
k + 1 tokens. On a CPU a one-token forward runs matrix-vector products and a
wider one matrix-matrix products, so t(x) is not one line through x = 1. This
times the bundled SmolLM2 target's forward at each width after a prompt of
``--context`` tokens (the cache cropped back after each), widths interleaved,
and reports medians:

    python -m bench.forward_widths --json bench/results/forward-widths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.sampling_profile import header
from lmkit import models

WIDTHS = (1, 2, 3, 5, 9)


@torch.inference_mode()
def measure(args) -> dict[int, list[float]]:
    torch.set_num_threads(args.threads)
    model = models.load_model(models.ModelSpec(models.DEFAULT_MODEL))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (1, args.context), generator=generator)
    cache = model(prompt, use_cache=True).past_key_values

    def forward(width: int) -> float:
        ids = torch.randint(100, 20000, (1, width), generator=generator)
        start = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True)
        seconds = time.perf_counter() - start
        cache.crop(-width)
        return seconds

    for width in WIDTHS:  # warm-up
        forward(width)
    samples: dict[int, list[float]] = {w: [] for w in WIDTHS}
    for _ in range(args.repeats):
        for width in WIDTHS:
            samples[width].append(forward(width))
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    samples = measure(args)
    median = {w: statistics.median(v) for w, v in samples.items()}
    report = {
        **header("seconds of one SmolLM2 forward over `width` new tokens after `context` cached ones (median)", args),
        "median_s": {str(w): round(s, 5) for w, s in median.items()},
        "vs_one_token": {str(w): round(s / median[1], 3) for w, s in median.items()},
        "samples_s": {str(w): [round(s, 5) for s in v] for w, v in samples.items()},
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["median_s"]), json.dumps(report["vs_one_token"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
