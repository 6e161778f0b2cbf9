"""Medusa heads: light heads on the target's last hidden state, each guessing a later token, drafted as one tree.

Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): head i reads the target's final hidden state h_j at committed position j (after its final norm:
what its own LM head reads) and predicts the token at j + 2 + i, through ``num_layers`` residual blocks
x + SiLU(W x + b) and an LM head. There is no autoregression: one shot of every head gives a candidate list
per later position, and the draft is the tree of their best combinations (``token_tree.grow_best_first``,
scored by the heads' probabilities), verified by the target in one forward.

The target sends h_j as its hidden features of layer ``num_layers`` (``TargetOpen.feature_layers``; index L of
the hidden states is the final norm's output) for every position it commits; the drafter keeps the last.
The newest committed token (the target's correction or bonus) has no feature yet, so the heads read the
position before it: head 0 guesses the token after it. When features lag further (a block drafted ahead
of its verification), the first heads are skipped.

Checkpoints are in the Medusa-1 layout, so released heads load as they are: a folder with ``config.json``
(``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``) and ``medusa_lm_head.safetensors``
(or ``.pt``) holding ``{head}.{layer}.linear.weight``/``.bias`` per residual block and
``{head}.{num_layers}.weight`` [vocab, hidden] per LM head. Heads without their own LM head (the original
Medusa's, and specsplit's small ones) use the target's.

A head's LM head is nearly all of a proposal's cost (SmolLM2: 49,152 rows against a hidden size of 576), and
most of those rows are tokens a draft never gets right. So the heads may draft over a reduced vocabulary, as
FR-Spec (Zhao et al. 2025) does for EAGLE: only the rows of the ``vocab`` tokens the target writes most often,
from ``draft_vocab.safetensors`` (``ids``: token ids, most frequent first, as ``specsplit distill --medusa``
counts them in the target's own outputs; specsplit's addition to the layout, optional). The tree is grown from
those candidates' probabilities, renormalised over the reduced vocabulary; the target still verifies every
token against its whole vocabulary, so the output is unchanged, only fewer rare tokens are drafted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specsplit.draft_service.drafter import ContextDrafter, Proposal
from specsplit.lmkit import token_tree
from specsplit.lmkit.features import FeatureBlock

WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
CONFIG = "config.json"
DRAFT_VOCAB = "draft_vocab.safetensors"  # ``ids``: the target's tokens, most frequent first
DEFAULT_DRAFT_VOCAB = 4096  # rows of the reduced LM head (a twelfth of SmolLM2's vocabulary)
BUNDLED_DIR = Path(__file__).resolve().parent / "heads"
# Heads shipped with specsplit, by the target reference they were trained for (``make medusa-heads``).
BUNDLED = {"smollm2-135m": BUNDLED_DIR / "medusa-smollm2-135m"}
TOP_PER_HEAD = 8  # candidates per head a tree may use


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int  # residual blocks per head
    base_model: str = ""  # what the heads were trained on (base_model_name_or_path)

    def to_json(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "base_model_name_or_path": self.base_model, "architectures": ["MedusaModel"]}


def resolve_heads(ref: str | Path) -> Path:
    """A heads folder, or the bundled heads of the target ``ref`` names."""
    if str(ref) in BUNDLED:
        return BUNDLED[str(ref)]
    return Path(ref).expanduser()


def read_config(folder: str | Path) -> MedusaConfig:
    """The heads' config; ValueError naming what is missing."""
    path = resolve_heads(folder) / CONFIG
    if not path.is_file():
        raise ValueError(f"{folder} is not a Medusa head folder: it has no {CONFIG}")
    raw = json.loads(path.read_text())
    try:
        config = MedusaConfig(int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1)),
                              str(raw.get("base_model_name_or_path", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a Medusa config (medusa_num_heads, medusa_num_layers): {exc}") from None
    if config.num_heads < 1 or config.num_layers < 0:
        raise ValueError(f"{path}: medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
    return config


class MedusaHeads(torch.nn.Module):
    """The heads of one target; ``logits(hidden, first, count)`` runs heads first .. first + count - 1."""

    def __init__(self, config: MedusaConfig, hidden_size: int, num_target_layers: int,
                 lm_head: torch.nn.Module, vocab_size: int, like: torch.Tensor, own_lm_heads: bool = False,
                 tied_embedding: torch.Tensor | None = None) -> None:
        """``lm_head``: the target's (a module: packed or not); ``like``: a tensor of the target's device and dtype;
        ``tied_embedding``: the target's input embedding where its LM head is tied to it."""
        super().__init__()
        self.config = config
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size) for _ in range(config.num_layers))
            for _ in range(config.num_heads)
        )
        self.lm_heads = torch.nn.ModuleList(
            torch.nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(config.num_heads)
        ) if own_lm_heads else None
        # The target's LM head and a tensor like its weights (lists: not submodules of the heads, not saved).
        self._target_lm_head = [lm_head]
        self._like = [like]
        self._tied_embedding: list[torch.Tensor | None] = [tied_embedding]
        self.feature_layers = (num_target_layers,)  # the target's final hidden state, after its norm
        self.feature_width = hidden_size
        self.draft_ids: torch.Tensor | None = None  # the reduced vocabulary's token ids; None: the whole one
        self._reduced: list[torch.Tensor] = []  # per head, its LM head's rows of draft_ids

    def restrict(self, ids: torch.Tensor | None) -> None:
        """Draft over the tokens ``ids`` only (their LM-head rows, copied once); None: the whole vocabulary."""
        if ids is None:
            self.draft_ids, self._reduced = None, []
            return
        weights = [self._lm_weight(i) for i in range(self.config.num_heads)]
        vocab = weights[0].shape[0]
        if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"a draft vocabulary is a non-empty list of token ids below {vocab}")
        self.draft_ids = ids.to(device=weights[0].device, dtype=torch.long)
        with torch.no_grad():
            self._reduced = [weight[self.draft_ids].clone() for weight in weights]

    def _lm_weight(self, i: int) -> torch.Tensor:
        """Head i's LM-head weight [vocab, hidden]: its own, or the target's (whose module may hold it packed
        for oneDNN: then the tied input embedding's, which is the same matrix)."""
        if self.lm_heads is not None:
            return self.lm_heads[i].weight
        weight = getattr(self._target_lm_head[0], "weight", None)
        if weight is None and self._tied_embedding[0] is not None:
            weight = self._tied_embedding[0]
        if weight is None:
            raise ValueError("the target's LM head holds no plain weight (packed, untied): draft over the whole "
                             "vocabulary (--medusa-vocab 0)")
        return weight

    def _lm_head(self, i: int) -> torch.nn.Module:
        return self.lm_heads[i] if self.lm_heads is not None else self._target_lm_head[0]

    def parameter_like(self) -> torch.Tensor:
        """A tensor of the heads' device and dtype (the target's)."""
        return self._like[0]

    def head_output(self, i: int, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        for block in self.blocks[i]:
            hidden = hidden + F.silu(block(hidden))
        return hidden

    def logits(self, hidden: torch.Tensor, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Heads first .. first + count - 1 on ``hidden`` [..., hidden]: [count, ..., vocab] over the whole
        vocabulary (training, the report)."""
        heads = range(first, self.config.num_heads if count is None else min(first + count, self.config.num_heads))
        return torch.stack([self._lm_head(i)(self.head_output(i, hidden)) for i in heads])

    def best(self, hidden: torch.Tensor, first: int, count: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Heads first .. first + count - 1 on ``hidden`` [hidden]: each one's ``top`` (token ids [count, top],
        probabilities [count, top]), over the reduced vocabulary when one is set."""
        heads = range(first, min(first + count, self.config.num_heads))
        if self.draft_ids is None:
            logits = self.logits(hidden, first, len(heads))
        else:
            logits = torch.stack([F.linear(self.head_output(i, hidden), self._reduced[i]) for i in heads])
        probs, ids = logits.float().softmax(-1).topk(min(top, logits.shape[-1]), dim=-1)
        return (ids if self.draft_ids is None else self.draft_ids[ids]), probs

    def state(self) -> dict[str, torch.Tensor]:
        """The Medusa-1 tensor names and values."""
        tensors = {}
        for i, blocks in enumerate(self.blocks):
            for j, block in enumerate(blocks):
                tensors[f"{i}.{j}.linear.weight"] = block.weight
                tensors[f"{i}.{j}.linear.bias"] = block.bias
            if self.lm_heads is not None:
                tensors[f"{i}.{self.config.num_layers}.weight"] = self.lm_heads[i].weight
        return {name: t.detach().contiguous().cpu() for name, t in tensors.items()}


def new_heads(target, num_heads: int, num_layers: int = 1, base_model: str = "") -> MedusaHeads:
    """Untrained heads for ``target`` that share its LM head: every residual block zero, so each head
    starts as the target's own next-token guess (Medusa's initialisation)."""
    config = MedusaConfig(num_heads, num_layers, base_model)
    heads = MedusaHeads(config, int(target.config.hidden_size), int(target.config.num_hidden_layers),
                        target.get_output_embeddings(), int(target.config.vocab_size), next(target.parameters()))
    for blocks in heads.blocks:
        for block in blocks:
            torch.nn.init.zeros_(block.weight)
            torch.nn.init.zeros_(block.bias)
    return heads.to(next(target.parameters()).device)


def save_heads(heads: MedusaHeads, folder: str | Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(heads.config.to_json(), indent=1) + "\n")
    save_file(heads.state(), str(folder / WEIGHTS[0]))
    return folder


def read_draft_vocab(folder: str | Path, size: int) -> torch.Tensor | None:
    """The ``size`` most frequent ids of the folder's draft vocabulary (fewer when it ranks fewer); None when
    ``size`` is 0 or the folder has none."""
    path = resolve_heads(folder) / DRAFT_VOCAB
    if size < 0:
        raise ValueError(f"--medusa-vocab must be >= 0 (0: the whole vocabulary), got {size}")
    if not size or not path.is_file():
        return None
    from safetensors.torch import load_file

    ids = load_file(str(path)).get("ids")
    if ids is None or ids.ndim != 1:
        raise ValueError(f"{path} holds no 1-D tensor 'ids' (token ids, most frequent first)")
    return ids[:size].long()


def save_draft_vocab(ids: torch.Tensor, folder: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(folder) / DRAFT_VOCAB
    save_file({"ids": ids.to(torch.int64).contiguous()}, str(path))
    return path


def load_heads(folder: str | Path, target, target_name: str = "", draft_vocab: int = DEFAULT_DRAFT_VOCAB) -> MedusaHeads:
    """Heads from a Medusa-1 folder for ``target``, drafting over the folder's ``draft_vocab`` most frequent tokens
    where it ranks them (``draft_vocab.safetensors``; 0: the whole vocabulary); ValueError, naming both shapes,
    when they do not fit it."""
    folder = resolve_heads(folder)
    config = read_config(folder)
    tensors = _read_tensors(folder)
    hidden, vocab = int(target.config.hidden_size), int(target.config.vocab_size)
    own = f"0.{config.num_layers}.weight" in tensors
    expected = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            expected[f"{i}.{j}.linear.weight"] = (hidden, hidden)
            expected[f"{i}.{j}.linear.bias"] = (hidden,)
        if own:
            expected[f"{i}.{config.num_layers}.weight"] = (vocab, hidden)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"the Medusa heads in {folder} lack {missing[:4]}{' ...' if len(missing) > 4 else ''}: "
                         f"config.json says {config.num_heads} heads of {config.num_layers} blocks")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"the Medusa heads in {folder} (trained for {config.base_model or 'an unnamed model'}) have "
                f"{name} of shape {tuple(tensors[name].shape)}, but target {target_name or 'the target'} has hidden "
                f"size {hidden} and vocabulary {vocab} (expected {shape}): pass heads trained for this target"
            )
    heads = MedusaHeads(config, hidden, int(target.config.num_hidden_layers), target.get_output_embeddings(), vocab,
                        next(target.parameters()), own, _tied_embedding(target))
    parameter = next(target.parameters())
    heads.load_state_dict(_module_names(tensors, config, own), strict=True)
    heads = heads.to(device=parameter.device, dtype=parameter.dtype).eval()
    heads.restrict(read_draft_vocab(folder, draft_vocab))
    return heads


def _tied_embedding(target) -> torch.Tensor | None:
    tied = getattr(target.config, "tie_word_embeddings", False)
    return target.get_input_embeddings().weight if tied else None


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHTS:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)  # tensors only: nothing in it runs
    raise ValueError(f"{folder} has no Medusa weights ({' or '.join(WEIGHTS)})")


def _module_names(tensors: dict[str, torch.Tensor], config: MedusaConfig, own: bool) -> dict[str, torch.Tensor]:
    state = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            state[f"blocks.{i}.{j}.weight"] = tensors[f"{i}.{j}.linear.weight"]
            state[f"blocks.{i}.{j}.bias"] = tensors[f"{i}.{j}.linear.bias"]
        if own:
            state[f"lm_heads.{i}.weight"] = tensors[f"{i}.{config.num_layers}.weight"]
    return state


class MedusaDrafter(ContextDrafter):
    """Drafts a session's block from the target's last feature row with every head at once."""

    needs_features = True

    def __init__(self, heads: MedusaHeads, prompt: Sequence[int]) -> None:
        super().__init__(prompt)
        self._heads = heads
        self._last: tuple[int, torch.Tensor] | None = None  # (position, its final hidden state [hidden])
        self._ranked: tuple[int, dict[int, list[tuple[int, float]]]] | None = None  # (position, head -> its best)

    def rollback(self, position: int) -> None:
        super().rollback(position)
        if self._last is not None and self._last[0] >= position:
            self._last = None  # the features' own position went

    def add_features(self, block: FeatureBlock) -> None:
        if block.width != self._heads.feature_width:
            raise ValueError(f"features of width {block.width}; the heads read {self._heads.feature_width}")
        if block.end > len(self._tokens):
            raise ValueError(f"features up to position {block.end} are past the context ({len(self._tokens)} tokens)")
        if block.rows and (self._last is None or block.end - 1 >= self._last[0]):
            self._last = (block.end - 1, block.values[-1])

    def propose(self, k: int) -> Proposal:
        return self.propose_tree(k, 1, k)

    @torch.inference_mode()
    def propose_tree(self, k: int, max_branches: int, max_nodes: int) -> Proposal:
        """Up to ``k`` levels (one per head left), ``max_branches`` leaves and ``max_nodes`` nodes of the heads'
        best combinations."""
        if self._last is None or not k or not max_nodes:
            return Proposal(tokens=[])
        skipped = len(self._tokens) - 2 - self._last[0]  # heads whose position is already committed
        levels = min(k, self._heads.config.num_heads - skipped)
        if skipped < 0 or levels <= 0:
            return Proposal(tokens=[])
        ranked = self._ranked_from(skipped, levels, min(max_branches, TOP_PER_HEAD))
        tokens, parents = token_tree.grow_best_first(
            self._tokens[-1], lambda token, depth: ranked[depth], levels, max_branches, max_nodes
        )
        return Proposal(tokens=tokens, parents=None if token_tree.is_chain(parents) else parents)

    def _ranked_from(self, first: int, count: int, width: int) -> list[list[tuple[int, float]]]:
        """Heads first .. first + count - 1: each one's ``width`` best (token, probability), from the last feature.
        Each head runs once per feature row, and only when a proposal reaches its depth: a head's LM head is
        most of a proposal's cost, and adaptive K often asks for one or two tokens."""
        position, hidden = self._last
        if self._ranked is None or self._ranked[0] != position:
            self._ranked = (position, {})
        ranked = self._ranked[1]
        missing = [i for i in range(first, first + count) if i not in ranked]
        if missing:
            span = range(missing[0], missing[-1] + 1)
            ids, probs = self._heads.best(hidden.to(self._heads.parameter_like()), span.start, len(span), TOP_PER_HEAD)
            for i, head_ids, head_probs in zip(span, ids, probs):
                ranked[i] = list(zip(head_ids.tolist(), head_probs.tolist()))
        return [ranked[i][:width] for i in range(first, first + count)]
