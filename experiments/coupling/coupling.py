"""Acceptance of rejection sampling against Gumbel-max coupling, on the same prompts, paths and drafters.

For each prompt the target samples its own continuation (the committed path); at every position n,
with context = prompt + path[:n], the target's p_n and each drafter's q_n (or the n-gram drafter's
proposal x_n) give the chance that a drafted token at n is accepted:

* DRAFT_PROBS (the model drafter sends q): sum min(p, q), exactly;
* TOKEN_ONLY (it samples x ~ q and sends x): sum p q, exactly; for an n-gram proposal x, p(x);
* COUPLED: P(argmax(log q + G) == argmax(log p + G)) over Gumbel noise G, estimated with
  ``--noise-draws`` draws a position (for an n-gram proposal it is p(x): the estimate checks it).

Per-drafted-token rates at a block's first position, on the same positions for every mode, so they
compare like with like. ``python experiments/coupling/coupling.py --json experiments/coupling/coupling.json``
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.draft_service.ngram import NgramConfig, NgramDrafter
from specsplit.draft_service.self_draft import QuantizeMode, layerskip_view, quantized_view
from specsplit.lmkit import models
from specsplit.lmkit.sampling import SamplingParams, logits_to_probs


@dataclass(frozen=True)
class Setting:
    name: str
    sampling: SamplingParams


SETTINGS = (
    Setting("T=0.7,top_p=0.95", SamplingParams(temperature=0.7, top_p=0.95)),
    Setting("T=1.0", SamplingParams(temperature=1.0)),
)


@torch.inference_mode()
def sample_path(model, prompt_ids: list[int], sampling: SamplingParams, new_tokens: int, seed: int) -> list[int]:
    """The target's own sampled continuation (plain sampling with torch's generator; any path of p will do)."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    cache = DynamicCache(config=model.config)
    feed = torch.tensor([ids])
    for _ in range(new_tokens):
        out = model(input_ids=feed, cache=cache, use_cache=True)
        p = logits_to_probs(out.logits[0, -1:], sampling)[0]
        token = int(torch.multinomial(p, 1, generator=generator))
        ids.append(token)
        feed = torch.tensor([[token]])
    return ids[len(prompt_ids):]


@torch.inference_mode()
def path_probs(model, prompt_ids: list[int], path: list[int], sampling: SamplingParams) -> torch.Tensor:
    """[len(path), vocab]: row n is the model's distribution for path[n] given prompt + path[:n]."""
    ids = torch.tensor([prompt_ids + path[:-1]])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :]  # [len(path), vocab]
    return logits_to_probs(logits, sampling)


def coupled_match(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator) -> float:
    """P(argmax(log q + G) == argmax(log p + G)) by Monte Carlo over Gumbel noise G; p, q: [vocab]."""
    support = ((p > 0) | (q > 0)).nonzero().flatten()
    log_p, log_q = p[support].log(), q[support].log()
    noise = -torch.log(torch.empty(draws, support.numel()).exponential_(generator=generator))
    return float(((log_p + noise).argmax(dim=1) == (log_q + noise).argmax(dim=1)).double().mean())


def coupled_point(p: torch.Tensor, x: int, draws: int, generator: torch.Generator) -> float:
    """P(argmax(log p + G) == x) by Monte Carlo (it is p(x))."""
    support = (p > 0).nonzero().flatten()
    noise = -torch.log(torch.empty(draws, support.numel()).exponential_(generator=generator))
    return float((support[(p[support].log() + noise).argmax(dim=1)] == x).double().mean())


def measure_model(p_rows: torch.Tensor, q_rows: torch.Tensor, draws: int, generator) -> dict[str, float]:
    """Mean acceptance per mode over the positions (rows) of one or more paths."""
    token_only = float((p_rows * q_rows).sum(dim=1).mean())
    draft_probs = float(torch.minimum(p_rows, q_rows).sum(dim=1).mean())
    coupled = sum(coupled_match(p, q, draws, generator) for p, q in zip(p_rows, q_rows)) / len(p_rows)
    return {"TOKEN_ONLY": token_only, "DRAFT_PROBS": draft_probs, "COUPLED": coupled, "positions": len(p_rows)}


def measure_ngram(prompt_ids, path, p_rows, draws: int, generator) -> dict[str, float]:
    """Positions where prompt lookup proposes a token: its acceptance under TOKEN_ONLY and COUPLED."""
    token_only, coupled = [], []
    drafter = NgramDrafter(NgramConfig(2, 4), prompt_ids)
    for n, token in enumerate(path):
        proposal = drafter.propose(1).tokens
        if proposal:
            x = proposal[0]
            token_only.append(float(p_rows[n, x]))
            coupled.append(coupled_point(p_rows[n], x, draws, generator))
        drafter.extend([token])
    return {"proposals": len(token_only), "positions": len(path), "TOKEN_ONLY": token_only, "COUPLED": coupled}


def tiny_pair(vocab: int):
    """A tiny random target and a tiny random draft on the same vocabulary (the test suite's kind of models)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(seed: int, layers: int):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             tie_word_embeddings=True)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(8.0)
        return model

    return build(1, 2), build(2, 1)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    tokenizer = models.load_tokenizer(models.DEFAULT_MODEL)
    target = models.load_model(models.ModelSpec(models.DEFAULT_MODEL))
    drafters = {
        "quantized-int8": quantized_view(target, QuantizeMode.INT8),
        f"layerskip-{args.layerskip_layers}": layerskip_view(target, args.layerskip_layers),
    }
    tiny_target, tiny_draft = tiny_pair(int(target.config.vocab_size))
    prompts = DEMO_PROMPTS[: args.prompts]
    generator = torch.Generator().manual_seed(0)
    results = {}
    for setting in SETTINGS:
        rows: dict[str, list[dict]] = {}
        for i, prompt in enumerate(prompts):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            path = sample_path(target, ids, setting.sampling, args.new_tokens, seed=i)
            p_rows = path_probs(target, ids, path, setting.sampling)
            for name, drafter in drafters.items():
                q_rows = path_probs(drafter, ids, path, setting.sampling)
                rows.setdefault(name, []).append(measure_model(p_rows, q_rows, args.noise_draws, generator))
            rows.setdefault("ngram", []).append(measure_ngram(ids, path, p_rows, args.noise_draws, generator))
            tiny_path = sample_path(tiny_target, ids, setting.sampling, args.new_tokens, seed=i)
            tiny_p = path_probs(tiny_target, ids, tiny_path, setting.sampling)
            tiny_q = path_probs(tiny_draft, ids, tiny_path, setting.sampling)
            rows.setdefault("tiny-random-pair", []).append(measure_model(tiny_p, tiny_q, args.noise_draws, generator))
        results[setting.name] = {name: summarise(name, per_prompt) for name, per_prompt in rows.items()}
    return results


def summarise(name: str, per_prompt: list[dict]) -> dict:
    """Position-weighted means over the prompts."""
    if name == "ngram":
        token_only = [v for r in per_prompt for v in r["TOKEN_ONLY"]]
        coupled = [v for r in per_prompt for v in r["COUPLED"]]
        return {
            "proposals": len(token_only),
            "positions": sum(r["positions"] for r in per_prompt),
            "TOKEN_ONLY": sum(token_only) / max(len(token_only), 1),
            "COUPLED": sum(coupled) / max(len(coupled), 1),
        }
    positions = sum(r["positions"] for r in per_prompt)
    out = {"positions": positions}
    for mode in ("TOKEN_ONLY", "DRAFT_PROBS", "COUPLED"):
        out[mode] = sum(r[mode] * r["positions"] for r in per_prompt) / positions
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--prompts", type=int, default=8, help="first N demo prompts (mixed grounded/open)")
    parser.add_argument("--new-tokens", type=int, default=48, help="length of each sampled path")
    parser.add_argument("--noise-draws", type=int, default=128, help="Gumbel draws per position (coupled estimate)")
    parser.add_argument("--layerskip-layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(args)
    report = {
        "what": "per-drafted-token acceptance at the first position of a block, on the target's own sampled paths",
        "args": vars(args),
        "host": platform.node(),
        "torch": torch.__version__,
        "elapsed_s": round(time.perf_counter() - start, 1),
        "results": results,
        "mc_standard_error_bound": 0.5 / math.sqrt(args.noise_draws),
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    for setting, by_drafter in results.items():
        for name, figures in by_drafter.items():
            cells = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
            print(f"{setting:18s} {name:18s} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
