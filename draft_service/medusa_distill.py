"""``specsplit distill --medusa``: train Medusa heads for a frozen target, locally, from the target itself.

Self-distillation, as Medusa recommends for a target whose training data is not at hand: the data are
the target's final hidden states over a local corpus and over its own greedy answers to a prompt pool
(``specsplit.draft_service.eagle_data``, the same pipeline EAGLE's heads train on), and head i learns the
target's own greedy choice i + 1 positions later (cross-entropy against the target's argmax, which is
what greedy verification accepts). The heads share the target's LM head, frozen, so only their residual
blocks train: ~1.3 MB per head for SmolLM2.

Each phase resumes: data chunks are files under ``OUT/data``, training checkpoints ``OUT/checkpoint.pt``
every ``--save-every`` steps, and ``--max-minutes`` stops a run checkpointed (rerun the same command to
go on; other settings are refused). The heads are written in the Medusa-1 layout
(``serve-draft --model TARGET --medusa-head OUT``), with ``OUT/draft_vocab.safetensors`` (the tokens the
target chose in the training data, most frequent first: the heads' reduced vocabulary) and
``OUT/distill_report.json``: top-1 agreement per head and the mean accepted length of a chain of the heads'
first choices on held-out answers, before and after training and over the reduced vocabulary, and how much
of the target's held-out choices the reduced vocabulary's sizes hold.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specsplit.draft_service import eagle_data, eagle_distill, medusa
from specsplit.lmkit import models

CHECKPOINT = "checkpoint.pt"
REPORT = "distill_report.json"


@dataclass(frozen=True)
class MedusaDistillConfig:
    target: str
    out: str
    corpus: tuple[str, ...] = ()  # files/folders; empty = pydoc_data, the stdlib sources, the Python docs
    corpus_tokens: int = 40_000
    prompts: int = 160  # chat prompts the target answers (greedy)
    answer_tokens: int = 160
    held_out_prompts: int = 24
    heads: int = 3
    layers: int = 1  # residual blocks per head
    steps: int = 1200
    batch: int = 128  # positions per step
    lr: float = 2e-3
    save_every: int = 100
    gen_batch: int = 32
    seq_len: int = 256  # corpus window
    chunk_prompts: int = 64
    seed: int = 0
    max_minutes: float = 0.0  # stop training after this long, checkpointed; 0 = no limit
    device: str = "cpu"  # where the target runs (its answers, its hidden states) and the heads train: cpu, cuda[:N]

    def __post_init__(self) -> None:
        for name in ("corpus_tokens", "prompts", "answer_tokens", "held_out_prompts", "heads", "steps", "batch",
                     "save_every", "gen_batch", "seq_len", "chunk_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.layers < 1:
            raise ValueError(f"--medusa-layers must be >= 1, got {self.layers}")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        if self.max_minutes < 0:
            raise ValueError(f"--max-minutes must be >= 0 (0 = no limit), got {self.max_minutes}")
        if not self.out:
            raise ValueError("--out is required: the folder to write data, checkpoints and the heads to")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"--medusa-device must be cpu or cuda[:N], got {self.device!r}")

    def data_fields(self) -> dict:
        keep = ("target", "corpus", "corpus_tokens", "answer_tokens", "held_out_prompts", "chunk_prompts", "seq_len",
                "seed")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k in keep}

    def train_fields(self) -> dict:
        keep = ("heads", "layers", "steps", "batch", "lr", "seed")
        return {k: v for k, v in asdict(self).items() if k in keep}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _data(config: MedusaDistillConfig, model, tokenizer) -> tuple[eagle_data.Segments, eagle_data.Segments]:
    """(training segments, held-out answers): made once, one file per chunk under OUT/data (EAGLE's data phase,
    keeping no feature layers: the heads read the final hidden state, which every chunk holds). The whole corpus
    trains; the held-out part is answers to prompts never trained on."""
    data = eagle_distill.DataFolder(config, model, tokenizer, ())

    def corpus() -> eagle_data.Segments:
        documents = eagle_data.corpus_documents(config.corpus)
        windows = eagle_data.corpus_sequences(tokenizer, documents, config.seq_len, config.corpus_tokens, config.seed)
        return eagle_data.extract(model, windows, [0] * len(windows), (), "corpus hidden states")

    pool = eagle_data.prompt_pool(config.prompts + config.held_out_prompts, config.seed)
    held = eagle_data.Segments.join(data.answers(pool[: config.held_out_prompts], "held-out", 0.0))
    train = eagle_data.Segments.join([data.chunk("corpus", corpus),
                                      *data.answers(pool[config.held_out_prompts :], "greedy", 0.0)])
    return train, held


def training_rows(segments: eagle_data.Segments, heads: int, answers_only: bool = False) -> torch.Tensor:
    """Positions j whose label for every head exists in their own sequence (j + heads < its end); ``answers_only``:
    from the first position of the target's answer on."""
    rows = []
    for start, end, answer in zip(segments.starts[:-1].tolist(), segments.starts[1:].tolist(),
                                  segments.answer_from.tolist()):
        first = start + (answer if answers_only else 0)
        if end - heads > first:
            rows.append(torch.arange(first, end - heads))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def _loss(heads: medusa.MedusaHeads, segments: eagle_data.Segments, rows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of head i at position j against the target's greedy choice at j + 1 + i, summed over heads
    with Medusa's decaying weights 0.8^i."""
    device = heads.parameter_like().device  # the data stays on the CPU; each batch goes to the heads
    hidden = segments.final[rows].float().to(device)
    total = hidden.new_zeros(())
    for i in range(heads.config.num_heads):
        logits = heads.logits(hidden, i, 1)[0]
        total = total + 0.8**i * F.cross_entropy(logits.float(), segments.argmax[rows + 1 + i].to(device))
    return total


@torch.inference_mode()
def agreement(heads: medusa.MedusaHeads, held: eagle_data.Segments, batch: int = 512) -> dict:
    """On held-out answers (their positions from the first answer token on): each head's top-1 agreement with the
    target's greedy choice, and the mean accepted length of a chain of the heads' first choices."""
    rows = training_rows(held, heads.config.num_heads, answers_only=True)
    n = heads.config.num_heads
    hits = torch.zeros(n)
    accepted = 0.0
    device = heads.parameter_like().device
    for chunk in rows.split(batch):
        # [heads, rows]: over the draft vocabulary
        guesses = heads.best(held.final[chunk].float().to(device), 0, n, 1)[0][..., 0].cpu()
        right = torch.stack([guesses[i] == held.argmax[chunk + 1 + i] for i in range(n)])  # [heads, rows]
        hits += right.sum(1)
        accepted += float(right.int().cumprod(0).sum())
    count = max(len(rows), 1)
    return {"positions": len(rows), "top1_per_head": [round(float(h) / count, 4) for h in hits],
            "mean_accepted_length": round(accepted / count, 4)}


def ranked_vocab(segments: eagle_data.Segments) -> torch.Tensor:
    """The tokens the target chose (its greedy next token at every position), most frequent first; ties by id."""
    counts = torch.bincount(segments.argmax)
    order = torch.argsort(counts, descending=True, stable=True)  # stable: equal counts stay in id order
    return order[counts[order] > 0]


def vocab_coverage(ids: torch.Tensor, held: eagle_data.Segments, sizes=(512, 1024, 2048, 4096, 8192)) -> dict:
    """The share of the target's choices on held-out answers that the ``size`` most frequent training tokens hold."""
    rows = training_rows(held, 0, answers_only=True)
    chosen = held.argmax[rows]
    return {str(size): round(float(torch.isin(chosen, ids[:size]).float().mean()), 4) for size in sizes}


def _lr(config: MedusaDistillConfig, step: int) -> float:
    warm = max(config.steps // 20, 1)
    if step < warm:
        return config.lr * (step + 1) / warm
    return config.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(config.steps - warm, 1)))


def _resume(path: Path, config: MedusaDistillConfig, heads, optimizer) -> int:
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["settings"] != json.loads(json.dumps(config.train_fields())):
        raise ValueError(f"{path} was made with other settings ({state['settings']}); use another --out")
    heads.load_state_dict(state["heads"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _checkpoint(path: Path, config: MedusaDistillConfig, heads, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    trainable = {k: v for k, v in heads.state_dict().items() if k.startswith("blocks.")}
    torch.save({"settings": config.train_fields(), "heads": trainable, "optimizer": optimizer.state_dict(),
                "step": step}, tmp)
    tmp.replace(path)


def distill_medusa(config: MedusaDistillConfig) -> dict:
    """Make (or load) the data, train (or resume), write the heads and the report; return the report."""
    from tqdm import tqdm

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--medusa-device {config.device}: torch finds no CUDA device here; train with --medusa-device "
                         "cpu, or on a machine with a GPU")
    started = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    # float32 on any device: the heads learn from the hidden states and choices the served fp32 target has
    model = models.load_model(models.ModelSpec(config.target, config.device, "float32")).requires_grad_(False)
    tokenizer = models.load_tokenizer(config.target)
    train, held = _data(config, model, tokenizer)
    data_s = round(time.perf_counter() - started, 1)
    rows = training_rows(train, config.heads)
    _log(f"data: {len(rows)} training positions, {held.count} held-out answers ({data_s} s)")
    heads = medusa.new_heads(model, config.heads, config.layers, config.target)
    before = agreement(heads, held)
    trainable = [p for name, p in heads.named_parameters() if name.startswith("blocks.")]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
    step = _resume(out / CHECKPOINT, config, heads, optimizer)
    began, resumed_at = time.perf_counter(), step
    with tqdm(total=config.steps, initial=step, desc="medusa heads", unit="step", file=sys.stderr) as bar:
        while step < config.steps:
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)  # resumable batches
            batch = rows[torch.randint(len(rows), (config.batch,), generator=generator)]
            for group in optimizer.param_groups:
                group["lr"] = _lr(config, step)
            loss = _loss(heads, train, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
            if step % config.save_every == 0 or step == config.steps:
                _checkpoint(out / CHECKPOINT, config, heads, optimizer, step)
            if config.max_minutes and time.perf_counter() - began > config.max_minutes * 60 and step < config.steps:
                _checkpoint(out / CHECKPOINT, config, heads, optimizer, step)
                _log(f"stopped after --max-minutes {config.max_minutes:g} at step {step} of {config.steps}; rerun the "
                     "same command to continue")
                return {"stopped_at": step}
    heads.eval()
    after = agreement(heads, held)
    medusa.save_heads(heads, out)
    vocab = ranked_vocab(train)
    medusa.save_draft_vocab(vocab, out)
    heads.restrict(vocab[: medusa.DEFAULT_DRAFT_VOCAB])
    reduced = agreement(heads, held)
    report = {
        "target": config.target, "heads": config.heads, "layers": config.layers, "settings": config.train_fields(),
        "training_positions": len(rows), "data_s": data_s, "resumed_at": resumed_at,
        "train_s": round(time.perf_counter() - began, 1),
        "held_out_untrained": before, "held_out": after,
        "draft_vocab": {"ranked": len(vocab), "held_out_coverage": vocab_coverage(vocab, held),
                        f"held_out_over_{medusa.DEFAULT_DRAFT_VOCAB}": reduced},
        "heads_bytes": (out / medusa.WEIGHTS[0]).stat().st_size,
        "total_s": round(time.perf_counter() - started, 1),
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    _log(f"held-out answers: top-1 per head {before['top1_per_head']} untrained -> {after['top1_per_head']}; mean "
         f"accepted length {before['mean_accepted_length']} -> {after['mean_accepted_length']}")
    _log(f"over the {medusa.DEFAULT_DRAFT_VOCAB} most frequent tokens (--medusa-vocab): top-1 per head "
         f"{reduced['top1_per_head']}, mean accepted length {reduced['mean_accepted_length']}")
    _log(f"wrote {out}: serve it with `specsplit serve-draft --model {config.target} --medusa-head {out}`")
    return report


def add_flags(parser) -> None:
    """The ``--medusa`` flags of ``specsplit distill`` (``--target``, ``--out``, ``--corpus``, ``--steps``, ``--batch``,
    ``--lr``, ``--save-every``, ``--seed``, ``--max-minutes`` and the data flags of ``--eagle`` apply too)."""
    d = MedusaDistillConfig
    g = parser.add_argument_group("--medusa: Medusa heads (the shared flags above apply too)")
    g.add_argument("--medusa-heads", type=int, default=d.heads, help="heads: later positions guessed at once")
    g.add_argument("--medusa-layers", type=int, default=d.layers, help="residual blocks per head")
    g.add_argument("--medusa-prompts", type=int, default=d.prompts, help="chat prompts the target answers (greedy)")
    g.add_argument("--medusa-held-out-prompts", type=int, default=d.held_out_prompts,
                   help="answers kept for the report")
    g.add_argument("--medusa-answer-tokens", type=int, default=d.answer_tokens, help="longest answer generated")
    g.add_argument("--medusa-corpus-tokens", type=int, default=d.corpus_tokens, help="corpus positions to run the target on")
    g.add_argument("--medusa-device", default=d.device,
                   help="where the target answers and reads the data (in float32) and the heads train: cpu or cuda[:N]")


def config_from_args(args) -> MedusaDistillConfig:
    d = MedusaDistillConfig

    def given(name: str, default):
        value = getattr(args, name, None)
        return default if value is None else value

    return MedusaDistillConfig(
        target=args.target, out=args.out, corpus=tuple(args.corpus), heads=args.medusa_heads, layers=args.medusa_layers,
        steps=given("steps", d.steps), batch=given("batch", d.batch), lr=given("lr", d.lr),
        save_every=args.save_every, seed=args.seed, max_minutes=args.max_minutes, prompts=args.medusa_prompts,
        held_out_prompts=args.medusa_held_out_prompts, answer_tokens=args.medusa_answer_tokens,
        corpus_tokens=args.medusa_corpus_tokens, seq_len=given("seq_len", d.seq_len), gen_batch=args.gen_batch,
        device=args.medusa_device,
    )
