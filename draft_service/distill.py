"""``specsplit distill``: train a layer-skip exit adapter for a target by distillation (``--eagle``: an EAGLE head;
``--medusa``: Medusa heads).

The draft is the target's own first L layers, then a small ``ExitAdapter`` (h + W·rmsnorm(h)), then
the target's final norm and LM head, all frozen but W. Training minimises KL(p_target ‖ q_draft) per
position (Hinton et al. 2015, "Distilling the knowledge in a neural network"; the early-exit set-up
follows LayerSkip, Elhoushi et al. 2024) on windows of a local text corpus; one target forward per
step gives both p_target and the layer-L hidden state. Writes ``--out``: ``checkpoint.pt`` every
``--save-every`` steps (a rerun resumes from it), the adapter folder that ``serve-draft --model
TARGET --layerskip-adapter OUT`` loads, and ``distill_report.json`` (greedy agreement with the
target on held-out text, before and after).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specsplit.draft_service import eagle_distill, medusa_distill, self_draft
from specsplit.draft_service.corpus import read_corpus
from specsplit.lmkit import models

CHECKPOINT = "checkpoint.pt"
REPORT = "distill_report.json"


@dataclass(frozen=True)
class DistillConfig:
    """One distillation run; validated here, built from flags in ``config_from_args``."""

    target: str
    layers: int
    out: str
    corpus: tuple[str, ...] = ()  # files or folders of .txt/.md/.rst/.py; empty = pydoc_data.topics
    steps: int = 300
    batch: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    held_out: float = 0.1  # fraction of the token stream kept for the agreement report
    eval_windows: int = 16
    save_every: int = 50
    max_corpus_tokens: int = 400_000
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("layers", "steps", "batch", "seq_len", "eval_windows", "save_every", "max_corpus_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        if not 0 < self.held_out < 0.5:
            raise ValueError(f"--held-out must be in (0, 0.5), got {self.held_out}")
        if not self.out:
            raise ValueError("--out is required: the folder to write checkpoints and the adapter to")

    def resumable_fields(self) -> dict:
        """What must match for a checkpoint to be resumed (steps may grow)."""
        fields = asdict(self)
        for name in ("steps", "save_every", "eval_windows", "out"):
            fields.pop(name)
        fields["corpus"] = list(fields["corpus"])
        return fields


def token_stream(tokenizer, text: str, limit: int) -> torch.Tensor:  # [n] int64
    ids = tokenizer(text[: limit * 8], add_special_tokens=False)["input_ids"]  # ~4 chars/token: 8 is ample
    return torch.tensor(ids[:limit], dtype=torch.long)


def split(stream: torch.Tensor, held_out: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(stream) * (1 - held_out))
    train, test = stream[:cut], stream[cut:]
    if len(train) <= seq_len or len(test) <= seq_len:
        raise ValueError(
            f"the corpus gives {len(stream)} tokens, too few for --seq-len {seq_len} with --held-out {held_out}; "
            "pass more text or a shorter --seq-len"
        )
    return train, test


def windows(stream: torch.Tensor, count: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (count,), generator=generator)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # [count, seq_len]


def draft_and_target_logits(model, adapter, layers: int, ids: torch.Tensor):
    """(draft logits with grad into the adapter, target logits), both [batch, seq, vocab].

    ``hidden_states[layers]`` is the output of decoder layer ``layers`` (index 0
    is the embedding), the input the layer-skip draft's exit sees.
    """
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[layers]
    draft = model.lm_head(model.model.norm(adapter(hidden)))
    return draft, out.logits


def kl_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_target ‖ q_draft)."""
    vocab = draft_logits.shape[-1]
    return F.kl_div(
        F.log_softmax(draft_logits.reshape(-1, vocab), -1),
        F.log_softmax(target_logits.reshape(-1, vocab), -1),
        log_target=True,
        reduction="batchmean",
    )


@torch.no_grad()
def evaluate(model, adapter, layers: int, test: torch.Tensor, config: DistillConfig) -> dict:
    """Greedy next-token agreement and KL of the draft with the target on held-out windows."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    ids = windows(test, config.eval_windows, config.seq_len, generator)
    agree, total, kl = 0, 0, 0.0
    for row in ids.split(4):
        draft, target = draft_and_target_logits(model, adapter, layers, row)
        agree += int((draft.argmax(-1) == target.argmax(-1)).sum())
        total += row.numel()
        kl += float(kl_loss(draft, target)) * row.numel()
    return {"greedy_agreement": round(agree / total, 4), "kl": round(kl / total, 4), "positions": total}


def _progress(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="distill", unit="step", file=sys.stderr, dynamic_ncols=True)


def _load_checkpoint(path: Path, config: DistillConfig, adapter, optimizer) -> int:
    if not path.is_file():
        return 0
    state = eagle_distill.load_checkpoint_state(path)
    if state["config"] != config.resumable_fields():
        raise ValueError(
            f"{path} was written by a run with other settings ({state['config']}); "
            "use another --out or the same settings to resume"
        )
    adapter.load_state_dict(state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _save_checkpoint(path: Path, config: DistillConfig, adapter, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"config": config.resumable_fields(), "adapter": adapter.state_dict(),
             "optimizer": optimizer.state_dict(), "step": step}
    torch.save(state, tmp)
    tmp.replace(path)  # a kill mid-write leaves the previous checkpoint intact


def distill(config: DistillConfig, log=print) -> dict:
    """Train (or resume), write the adapter folder and the report; return the report."""
    text = read_corpus(config.corpus)  # a bad --corpus fails before the model loads
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model = models.load_model(models.ModelSpec(config.target))
    for p in model.parameters():
        p.requires_grad_(False)
    total_layers = self_draft.layer_count(model)
    if not 1 <= config.layers < total_layers:
        raise ValueError(f"--layers must be in [1, {total_layers - 1}] for {config.target}, got {config.layers}")
    tokenizer = models.load_tokenizer(config.target)
    stream = token_stream(tokenizer, text, config.max_corpus_tokens)
    train, test = split(stream, config.held_out, config.seq_len)
    log(f"corpus: {len(train)} training tokens, {len(test)} held out; target {config.target}, "
        f"{config.layers} of {total_layers} layers")

    torch.manual_seed(config.seed)
    adapter = self_draft.ExitAdapter(model.config.hidden_size, getattr(model.config, "rms_norm_eps", 1e-5))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=config.lr, weight_decay=0.0)
    before = evaluate(model, self_draft.ExitAdapter(model.config.hidden_size), config.layers, test, config)
    start = _load_checkpoint(out / CHECKPOINT, config, adapter, optimizer)
    if start:
        log(f"resuming from {out / CHECKPOINT} at step {start}")
    started = time.perf_counter()
    with _progress(config.steps, min(start, config.steps)) as bar:
        for step in range(start, config.steps):
            # Each step's batch depends only on (seed, step): a resumed run sees what it would have.
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
            draft, target = draft_and_target_logits(
                model, adapter, config.layers, windows(train, config.batch, config.seq_len, generator)
            )
            loss = kl_loss(draft, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bar.set_postfix(kl=f"{loss.item():.3f}")
            bar.update(1)
            if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
                _save_checkpoint(out / CHECKPOINT, config, adapter, optimizer, step + 1)
    after = evaluate(model, adapter, config.layers, test, config)
    meta = self_draft.AdapterMeta(
        config.layers, int(model.config.hidden_size), config.target, models.vocab_fingerprint(tokenizer)
    )
    self_draft.save_adapter(out, adapter, meta)
    report = {
        "target": config.target, "layers": config.layers, "steps": config.steps, "resumed_at": start,
        "train_tokens_seen": (config.steps - start) * config.batch * config.seq_len,
        "train_s": round(time.perf_counter() - started, 1),
        "held_out_before": before, "held_out_after": after,
        "adapter_bytes": (out / self_draft.ADAPTER_WEIGHTS).stat().st_size,
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out greedy agreement with the target: {before['greedy_agreement']:.3f} untrained -> "
        f"{after['greedy_agreement']:.3f} trained (KL {before['kl']:.3f} -> {after['kl']:.3f})")
    log(f"wrote {out}: serve it with `specsplit serve-draft --model {config.target} --layerskip-adapter {out}`")
    return report


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specsplit distill", description=__doc__.splitlines()[0])
    d = DistillConfig
    parser.add_argument(
        "--eagle", action="store_true",
        help="train an EAGLE-3 head (draft_service/eagle_distill.py) instead of a layer-skip exit adapter",
    )
    parser.add_argument("--target", default=models.DEFAULT_MODEL, help="target model reference")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers the draft keeps")
    parser.add_argument("--out", required=True, help="folder for checkpoints, the adapter and the report")
    parser.add_argument("--corpus", nargs="*", default=[], help="text files/folders; default: pydoc_data.topics")
    # Each mode has its own defaults for these (None: the mode's).
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {d.steps}; --eagle: its own)")
    parser.add_argument("--batch", type=int, default=None, help=f"sequences per step (default {d.batch})")
    parser.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {d.seq_len})")
    parser.add_argument("--lr", type=float, default=None, help=f"learning rate (default {d.lr})")
    parser.add_argument("--held-out", type=float, default=d.held_out, help="fraction of tokens kept for the report")
    parser.add_argument("--eval-windows", type=int, default=d.eval_windows, help="held-out windows in the report")
    parser.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    parser.add_argument("--max-corpus-tokens", type=int, default=d.max_corpus_tokens)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--medusa", action="store_true",
        help="train Medusa heads (draft_service/medusa_distill.py) instead of a layer-skip exit adapter",
    )
    eagle_distill.add_flags(parser)
    medusa_distill.add_flags(parser)
    return parser


def _given(args, name: str, default):
    value = getattr(args, name)
    return default if value is None else value


def config_from_args(args) -> DistillConfig:
    d = DistillConfig
    return DistillConfig(
        target=args.target, layers=args.layers, out=args.out, corpus=tuple(args.corpus),
        steps=_given(args, "steps", d.steps), batch=_given(args, "batch", d.batch),
        seq_len=_given(args, "seq_len", d.seq_len), lr=_given(args, "lr", d.lr), held_out=args.held_out,
        eval_windows=args.eval_windows, save_every=args.save_every,
        max_corpus_tokens=args.max_corpus_tokens, seed=args.seed,
    )


def run(args) -> int:
    # ValueError on bad flags, before loading anything
    if args.eagle and args.medusa:
        raise ValueError("--eagle and --medusa train different drafters; pick one")
    if args.medusa:
        config = medusa_distill.config_from_args(args)
    else:
        config = eagle_distill.config_from_args(args) if args.eagle else config_from_args(args)
    models.configure_torch_threads(args.threads)
    if args.medusa:
        medusa_distill.distill_medusa(config)
    elif args.eagle:
        eagle_distill.distill_eagle(config)
    else:
        distill(config)
    return 0
