"""``specsplit distill --eagle``: train an EAGLE-3 head for a target, locally, from the target itself.

Three phases, each resumable (a rerun with the same ``--out`` picks up where the last one stopped;
other settings are refused): the data, the target's features over a local corpus and over its own
answers to a prompt pool (``specsplit.draft_service.eagle_data``); training with training-time test
(``specsplit.draft_service.eagle_train``), checkpointed; and the report on held-out answers, with
the head itself in the EAGLE-3 layout (``OUT/config.json``, ``OUT/model.safetensors``), which
``serve-draft --model TARGET --eagle-head OUT`` serves. Phases in detail: ``distill_eagle``.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specsplit.draft_service import eagle_data, eagle_head, eagle_train
from specsplit.lmkit import models

CHECKPOINT = "checkpoint.pt"
REPORT = "distill_report.json"


@dataclass(frozen=True)
class EagleDistillConfig:
    """One head-training run; validated here, built from flags in ``config_from_args``."""

    target: str
    out: str
    corpus: tuple[str, ...] = ()  # files/folders; empty = pydoc_data, the stdlib sources, the Python docs
    corpus_tokens: int = 120_000
    prompts: int = 768  # chat prompts the target answers (each greedy; a share of them sampled as well)
    sampled_share: float = 0.5
    temperature: float = 0.8
    answer_tokens: int = 192
    held_out_prompts: int = 48
    draft_vocab: int = 4096  # with the target's layer shape this keeps the fp16 head under 16 MB for SmolLM2
    steps: int = 1200
    batch: int = 8
    seq_len: int = 256
    ttt_steps: int = 3
    loss_share: float = 0.5  # share of rows the loss reads each step (the LM head is most of a step's cost)
    lr: float = 6e-4
    save_every: int = 100
    gen_batch: int = 32
    chunk_prompts: int = 128  # prompts per data file (the unit of resumption while generating)
    seed: int = 0
    max_minutes: float = 0.0  # stop training after this long, checkpointed (rerun to continue); 0 = no limit

    def __post_init__(self) -> None:
        for name in ("corpus_tokens", "prompts", "answer_tokens", "held_out_prompts", "draft_vocab", "steps", "batch",
                     "seq_len", "ttt_steps", "save_every", "gen_batch", "chunk_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.loss_share <= 1:
            raise ValueError(f"--loss-share must be in (0, 1], got {self.loss_share}")
        if not 0 <= self.sampled_share <= 1:
            raise ValueError(f"--sampled-share must be in [0, 1], got {self.sampled_share}")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        if self.max_minutes < 0:
            raise ValueError(f"--max-minutes must be >= 0 (0 = no limit), got {self.max_minutes}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not self.out:
            raise ValueError("--out is required: the folder to write data, checkpoints and the head to")

    def data_fields(self) -> dict:
        """What the data files depend on (more --prompts, or a larger --sampled-share, only adds files)."""
        keep = ("target", "corpus", "corpus_tokens", "temperature", "answer_tokens", "held_out_prompts",
                "chunk_prompts", "seed")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k in keep}

    def train_fields(self) -> dict:
        """What a checkpoint depends on."""
        keep = ("prompts", "sampled_share", "draft_vocab", "batch", "seq_len", "ttt_steps", "loss_share", "lr")
        return {**self.data_fields(), **{k: v for k, v in asdict(self).items() if k in keep}}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class DataFolder:
    """The data phase: chunks written under OUT/data, each loaded back when it exists; the settings they were made
    with in OUT/data/settings.json, and other settings refused. ``config`` is a distill config with the data
    fields (EAGLE's, or Medusa's: ``medusa_distill``); ``layers``: the target's hidden states kept as features."""

    def __init__(self, config, model, tokenizer, layers: tuple[int, ...]) -> None:
        self.config, self.model, self.tokenizer, self.layers = config, model, tokenizer, layers
        self.folder = Path(config.out) / "data"
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest = self.folder / "settings.json"
        wanted = json.loads(json.dumps({**config.data_fields(), "layers": list(layers)}))  # as the file holds it
        if manifest.is_file() and json.loads(manifest.read_text()) != wanted:
            raise ValueError(f"{self.folder} holds data made with other settings ({manifest}); use another --out")
        manifest.write_text(json.dumps(wanted, indent=2) + "\n")
        self.eos = models.eos_ids(config.target, tokenizer)

    def chunk(self, name: str, make) -> eagle_data.Segments:
        path = self.folder / f"{name}.pt"
        if path.is_file():
            return eagle_data.Segments.load(path)
        segments = make()
        segments.save(path)
        return segments

    def corpus(self) -> tuple[eagle_data.Segments, eagle_data.Segments]:
        """(training windows, held-out windows) of the corpus."""
        def make():
            documents = eagle_data.corpus_documents(self.config.corpus)
            windows = eagle_data.corpus_sequences(
                self.tokenizer, documents, self.config.seq_len, self.config.corpus_tokens, self.config.seed
            )
            return eagle_data.extract(self.model, windows, [0] * len(windows), self.layers, "corpus features")

        segments = self.chunk("corpus", make)
        held = max(segments.count // 20, 1)
        return segments.subset(range(held, segments.count)), segments.subset(range(held))

    def answers(self, prompts: list[str], name: str, temperature: float) -> list[eagle_data.Segments]:
        parts = []
        step = self.config.chunk_prompts
        for i in range(0, len(prompts), step):
            group = [eagle_data.encode_chat(self.tokenizer, p) for p in prompts[i : i + step]]

            def make(group=group, i=i):
                answers = eagle_data.generate_answers(
                    self.model, self.tokenizer, group, self.config.answer_tokens, self.config.gen_batch, temperature,
                    self.config.seed + i, self.eos,
                )
                sequences = [p + a for p, a in zip(group, answers)]
                return eagle_data.extract(self.model, sequences, [len(p) for p in group], self.layers, f"{name} features")

            parts.append(self.chunk(f"{name}-{i // step:03d}-{len(group):03d}", make))
        return parts


def _checkpoint(path: Path, config: EagleDistillConfig, head, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"config": config.train_fields(), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, tmp)
    tmp.replace(path)


def load_checkpoint_state(path: Path) -> dict:
    """A training checkpoint's state, unpickling tensors and plain values only (``weights_only``): a file that
    holds anything else (code to run) is refused, so resuming from a tampered --out cannot run it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path} holds more than tensors and plain values ({str(exc).splitlines()[0]}); refusing to unpickle "
            "it: delete it to start over, or use another --out"
        ) from None


def _resume(path: Path, config: EagleDistillConfig, head, optimizer) -> int:
    if not path.is_file():
        return 0
    state = load_checkpoint_state(path)
    if state["config"] != config.train_fields():
        raise ValueError(f"{path} was written by a run with other settings; use another --out or the same settings")
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _lr(config: EagleDistillConfig, step: int) -> float:
    """Linear warm-up over 5 % of the steps, then cosine to a tenth."""
    warm = max(config.steps // 20, 1)
    if step < warm:
        return config.lr * (step + 1) / warm
    progress = (step - warm) / max(config.steps - warm, 1)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _train(config: EagleDistillConfig, head, train: eagle_data.Segments, target_rows: torch.Tensor) -> dict:
    out = Path(config.out)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    start = _resume(out / CHECKPOINT, config, head, optimizer)
    if start:
        _log(f"resuming from {out / CHECKPOINT} at step {start}")
    from tqdm import tqdm

    started = time.perf_counter()
    recent: list[list[float]] = []
    with tqdm(total=config.steps, initial=min(start, config.steps), desc="train", unit="step", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for step in range(start, config.steps):
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)  # a resumed run sees the same batches
            batch = eagle_train.windows(
                train, eagle_train.sample_windows(train, config.batch, config.seq_len, generator), config.seq_len
            )
            for group in optimizer.param_groups:
                group["lr"] = _lr(config, step)
            loss, agreement = eagle_train.ttt_loss(
                head, batch, config.ttt_steps, target_rows, config.loss_share, generator
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            recent = (recent + [agreement])[-50:]
            mean = [sum(a[s] for a in recent) / len(recent) for s in range(config.ttt_steps)]
            bar.set_postfix(loss=f"{loss.item():.3f}", agree="/".join(f"{a:.2f}" for a in mean))
            bar.update(1)
            out_of_time = config.max_minutes and time.perf_counter() - started > 60 * config.max_minutes
            if (step + 1) % config.save_every == 0 or step + 1 == config.steps or out_of_time:
                _checkpoint(out / CHECKPOINT, config, head, optimizer, step + 1)
            if out_of_time and step + 1 < config.steps:
                return {"stopped_at": step + 1}
    return {"resumed_at": start, "train_s": round(time.perf_counter() - started, 1),
            "final_train_agreement_per_step": [round(a, 4) for a in mean] if recent else []}


def distill_eagle(config: EagleDistillConfig) -> dict:
    """Make the data (or load it), train (or resume), write the head and the report; return the report.

    Data: the target's features over a local corpus and over its own greedy and sampled answers to a
    prompt pool, generated in batches, one file per chunk under ``OUT/data/``. Training: a checkpoint
    every ``--save-every`` steps (``OUT/checkpoint.pt``); ``--max-minutes`` stops after that long,
    checkpointed, so a shared machine can train in slices. Report (``OUT/distill_report.json``): top-1
    agreement, acceptance per depth and tokens per round at k = 1..4 on held-out answers (prompts never
    trained on), and top-1 agreement on held-out corpus text.
    """
    started = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model = models.load_model(models.ModelSpec(config.target)).requires_grad_(False)
    tokenizer = models.load_tokenizer(config.target)
    layers = eagle_head.eagle3_layers(int(model.config.num_hidden_layers))
    pool = eagle_data.prompt_pool(config.prompts + config.held_out_prompts, config.seed)
    held_prompts, train_prompts = pool[: config.held_out_prompts], pool[config.held_out_prompts :]
    data = DataFolder(config, model, tokenizer, layers)
    corpus_train, corpus_held = data.corpus()
    greedy = data.answers(train_prompts, "greedy", 0.0)
    sampled = data.answers(train_prompts[: int(len(train_prompts) * config.sampled_share)], "sampled",
                           config.temperature)
    held = eagle_data.Segments.join(data.answers(held_prompts, "held-out", 0.0))
    train = eagle_data.Segments.join([corpus_train, *greedy, *sampled])
    data_s = round(time.perf_counter() - started, 1)
    _log(f"data: {int(train.starts[-1])} training positions ({int(corpus_train.starts[-1])} corpus, "
         f"{sum(int(s.starts[-1]) for s in greedy + sampled)} in the target's answers); "
         f"{held.count} held-out answers")

    draft_ids, coverage = eagle_train.draft_vocabulary(train, config.draft_vocab, int(model.config.vocab_size))
    head = eagle_train.new_head(model, layers, draft_ids, config.seed)
    target_rows = model.get_output_embeddings().weight[draft_ids].float()  # [Vd, H]
    training = _train(config, head, train, target_rows)
    if "stopped_at" in training:
        _log(f"stopped after --max-minutes {config.max_minutes:g} at step {training['stopped_at']} of "
             f"{config.steps}; rerun the same command to continue")
        return training
    head.eval()
    before = eagle_train.acceptance(eagle_train.new_head(model, layers, draft_ids, config.seed), held)
    report = {
        "target": config.target,
        "feature_layers": list(layers),
        "draft_vocab": config.draft_vocab,
        "draft_vocab_coverage_of_target_choices": round(coverage, 4),
        "training_positions": int(train.starts[-1]),
        "corpus_positions": int(corpus_train.starts[-1]),
        "answer_positions": sum(int(s.starts[-1]) for s in greedy + sampled),
        "steps": config.steps,
        "settings": config.train_fields(),
        "data_s": data_s,
        **training,
        "held_out_answers_untrained": before,
        "held_out_answers": eagle_train.acceptance(head, held),
        "held_out_corpus": eagle_train.acceptance(head, corpus_held, depth=1, answers_only=False),
    }
    extra = {"target": config.target, "vocab_fingerprint": models.vocab_fingerprint(tokenizer),
             "held_out_answers": report["held_out_answers"]}
    eagle_head.save_head(out, head, extra)
    report["head_bytes"] = (out / eagle_head.WEIGHTS).stat().st_size
    report["total_s"] = round(time.perf_counter() - started, 1)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    h = report["held_out_answers"]
    _log(f"held-out answers: top-1 agreement {before['top1_agreement']:.3f} untrained -> {h['top1_agreement']:.3f}; "
         f"alpha at k=1..4 {h['alpha_at_k']}; tokens per round {h['tokens_per_round_at_k']}")
    _log(f"wrote {out}: serve it with `specsplit serve-draft --model {config.target} --eagle-head {out}`")
    return report


def add_flags(parser) -> None:
    """The ``--eagle`` flags of ``specsplit distill`` (``--target``, ``--out``, ``--corpus``, ``--seed`` are shared)."""
    d = EagleDistillConfig
    g = parser.add_argument_group("--eagle: an EAGLE-3 head (the flags above that fit apply too)")
    g.add_argument("--corpus-tokens", type=int, default=d.corpus_tokens, help="corpus positions to run the target on")
    g.add_argument("--prompts", type=int, default=d.prompts, help="chat prompts the target answers (greedy)")
    g.add_argument("--sampled-share", type=float, default=d.sampled_share, help="share of them also answered sampled")
    g.add_argument("--temperature", type=float, default=d.temperature, help="temperature of the sampled answers")
    g.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="longest answer generated")
    g.add_argument("--held-out-prompts", type=int, default=d.held_out_prompts, help="answers kept for the report")
    g.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="size of the head's draft vocabulary")
    g.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="unrolled steps of training-time test")
    g.add_argument("--loss-share", type=float, default=d.loss_share, help="share of rows the loss reads per step")
    g.add_argument("--gen-batch", type=int, default=d.gen_batch, help="prompts per generation batch")
    g.add_argument("--max-minutes", type=float, default=d.max_minutes,
                   help="stop training after this long, checkpointed; rerun to continue (0 = no limit)")


def config_from_args(args) -> EagleDistillConfig:
    d = EagleDistillConfig

    def given(name: str):
        value = getattr(args, name)
        return getattr(d, name) if value is None else value

    return EagleDistillConfig(
        target=args.target, out=args.out, corpus=tuple(args.corpus), corpus_tokens=args.corpus_tokens,
        prompts=args.prompts, sampled_share=args.sampled_share, temperature=args.temperature,
        answer_tokens=args.answer_tokens, held_out_prompts=args.held_out_prompts, draft_vocab=args.draft_vocab,
        steps=given("steps"), batch=given("batch"), seq_len=given("seq_len"), ttt_steps=args.ttt_steps,
        loss_share=args.loss_share,
        lr=given("lr"), save_every=args.save_every, gen_batch=args.gen_batch, seed=args.seed,
        max_minutes=args.max_minutes,
    )
