"""Derive a draft from the target by keeping its first L layers (plus final norm and LM head).

    python -m specsplit.bench.derive_draft --layers 4 --out /tmp/smollm2-l4

Writes an ordinary checkpoint folder that ``specsplit serve-draft --model``
loads. Untrained, such a draft agrees with the target rarely (see docs/drafters.md,
"Choosing the default drafter"); it exists to measure the model-drafter path
on real weights.
"""

from __future__ import annotations

import argparse

import torch

from specsplit.lmkit import models


def derive(target_ref: str, layers: int, out: str) -> None:
    model = models.load_model(models.ModelSpec(target_ref))
    total = model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers must be in [1, {total}], got {layers}")
    model.model.layers = torch.nn.ModuleList(model.model.layers[:layers])
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    models.load_tokenizer(target_ref).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=models.DEFAULT_MODEL)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    derive(args.target, args.layers, args.out)
    print(f"wrote a {args.layers}-layer draft of {args.target} to {args.out}")


if __name__ == "__main__":
    main()
