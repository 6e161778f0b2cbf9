"""Run under ``torchrun`` (gloo, CPU) by ``tests/services/test_tp_step.py``: each model folder given, loaded sharded
over the group and whole, runs the same steps through the fast forward on both (the decoder step over this rank's
shard, and over the whole model); rank 0 writes, per model, what runs the shard and the largest logit and feature
differences and whether every argmax agrees.

    torchrun --nproc-per-node 2 tests/tp_step.py OUT.json MODEL_DIR...
"""

from __future__ import annotations

import json
import sys

import torch

from specsplit.lmkit import forward, models
from specsplit.lmkit.kvcache import SessionCache
from specsplit.target_service import tp
from specsplit.target_service.batched_forward import Step, forward_batch


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compare(folder: str) -> dict:
    sharded = models.load_model(models.ModelSpec(folder), tensor_parallel=True)
    whole = models.load_model(models.ModelSpec(folder))
    kinds = [forward.install(sharded, "off", sharded=True), forward.install(whole, "off")]
    vocab = int(whole.config.vocab_size)
    layers = (0, int(whole.config.num_hidden_layers))
    worst, features, argmax = 0.0, 0.0, True

    def check(a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal worst, argmax
        worst = max(worst, float((a - b).abs().max()))
        argmax &= torch.equal(a.argmax(-1), b.argmax(-1))

    caches = [[SessionCache(m) for _ in range(2)] for m in (sharded, whole)]
    for shard_cache, whole_cache in zip(*caches):
        shard_cache.feature_layers = whole_cache.feature_layers = layers
    prompts = [_ids(21, 1, vocab), _ids(7, 2, vocab)]
    for i in range(2):  # prefills, one session a forward
        check(caches[0][i].logits(prompts[i], []), caches[1][i].logits(prompts[i], []))
        features = max(features, float((caches[0][i].features - caches[1][i].features).abs().max()))
    for round_ in range(3):  # blocks of both sessions in one packed forward; a rejected tail rolled back
        outs = []
        for model, cache_pair in zip((sharded, whole), caches):
            steps = [Step(cache, *cache.plan([*prompts[i], *_ids(2, 10 + round_, vocab)], _ids(3, 20 + i, vocab)), 4)
                     for i, cache in enumerate(cache_pair)]
            outs.append(forward_batch(model, steps))
        for a, b in zip(*outs):
            check(a, b)
        prompts = [[*p, *_ids(2, 10 + round_, vocab), *_ids(1, 20 + i, vocab)] for i, p in enumerate(prompts)]
    return {"forward": kinds[0], "max_logit_difference": worst, "max_feature_difference": features,
            "argmax_equal": argmax}


def main() -> None:
    out, folders = sys.argv[1], sys.argv[2:]
    rank, _ = tp.init_process_group("cpu", 120)
    report = {folder: compare(folder) for folder in folders}
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)
    tp.leave_group()


if __name__ == "__main__":
    main()
