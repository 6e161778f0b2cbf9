"""Which drafter serves which ``DrafterKind``: one entry per drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from specsplit.draft_service.chain import ChainDrafter
from specsplit.draft_service.drafter import Drafter
from specsplit.draft_service.eagle import EagleDrafter
from specsplit.draft_service.medusa import MedusaDrafter
from specsplit.draft_service.model_drafter import ModelDrafter
from specsplit.draft_service.ngram import NgramConfig, NgramDrafter
from specsplit.draft_service.recycling import SUCCESSORS_K, RecyclingDrafter, SuccessorTable
from specsplit.lmkit.kinds import DrafterKind, DrafterTraits
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.sampling import SamplingParams


@dataclass(frozen=True)
class DraftRequestContext:
    """Everything a drafter may need to start a session."""

    prompt: Sequence[int]
    sampling: SamplingParams
    return_probs: bool
    ngram: NgramConfig
    model: object | None  # the draft service's model, None when it runs none
    # Models derived from it at start-up, by the kind that runs them (LAYERSKIP, QUANTIZED).
    derived: Mapping[DrafterKind, object] = field(default_factory=dict)
    chain: tuple[DrafterKind, ...] = ()  # the members, in order, when the kind is CHAIN
    coupled: bool = False  # COUPLED verification: sample by Gumbel-max with the target's noise
    successors: SuccessorTable | None = None  # the caller's shared table of the target's successors (RECYCLING)
    new_cache: Callable[[object], SessionCache] = SessionCache  # a session's cache over one of the models above


@dataclass(frozen=True)
class DrafterEntry:
    kind: DrafterKind
    build: Callable[[DraftRequestContext], Drafter]
    needs_model: bool = False  # must share the target's vocabulary (runs --model or a view of it)
    has_probs: bool = False  # can return the distributions its tokens were sampled from
    derived: bool = False  # runs a model derived from --model at start-up (needs its flag)
    enable_hint: str = ""  # how to start serve-draft so that it serves this drafter
    free: bool = False  # its proposals cost ~nothing (its Drafter class says ``free = True`` too)
    # Drafts from the target's hidden features; its derived model says which (feature_layers, feature_width).
    needs_features: bool = False
    successors_k: int = 0  # drafts from the target's best successors of verified positions, this many per position
    cheap: bool = False  # runs no model and proposes in microseconds: served on the event loop, as free drafters are

    def traits(self, derived: object | None = None) -> DrafterTraits:
        """What it can do; a feature drafter's layers and width come from its derived model."""
        if not self.needs_features:
            return DrafterTraits(self.kind, self.has_probs, self.needs_model, self.free,
                                 successors_k=self.successors_k)
        return DrafterTraits(
            self.kind, self.has_probs, self.needs_model, self.free, needs_features=True,
            feature_layers=tuple(derived.feature_layers), feature_width=int(derived.feature_width),
        )


def _model_drafter(model, c: DraftRequestContext) -> ModelDrafter:
    return ModelDrafter(model, c.prompt, c.sampling, c.return_probs, c.coupled, c.new_cache)


def _chain(c: DraftRequestContext) -> ChainDrafter:
    return ChainDrafter([(kind, DRAFTERS[kind].build(c)) for kind in c.chain])


def register(entry: DrafterEntry) -> DrafterEntry:
    """Serve a drafter: one entry per kind (a drafter module outside this file registers itself the same way)."""
    if entry.kind in DRAFTERS:
        raise ValueError(f"drafter {entry.kind.name} is already registered")
    DRAFTERS[entry.kind] = entry
    return entry


DRAFTERS: dict[DrafterKind, DrafterEntry] = {}
register(DrafterEntry(DrafterKind.MODEL, lambda c: _model_drafter(c.model, c), needs_model=True, has_probs=True,
                      enable_hint="start serve-draft with --model to enable the model drafter"))
register(DrafterEntry(DrafterKind.NGRAM, lambda c: NgramDrafter(c.ngram, c.prompt), free=NgramDrafter.free))
register(DrafterEntry(DrafterKind.LAYERSKIP, lambda c: _model_drafter(c.derived[DrafterKind.LAYERSKIP], c),
                      needs_model=True, has_probs=True, derived=True,
                      enable_hint="start serve-draft with --model TARGET --layerskip-layers L to enable it"))
register(DrafterEntry(DrafterKind.QUANTIZED, lambda c: _model_drafter(c.derived[DrafterKind.QUANTIZED], c),
                      needs_model=True, has_probs=True, derived=True,
                      enable_hint="start serve-draft with --model TARGET --quantize int8 to enable it"))
register(DrafterEntry(DrafterKind.CHAIN, _chain))
register(DrafterEntry(
    DrafterKind.EAGLE,
    lambda c: EagleDrafter(c.derived[DrafterKind.EAGLE], c.prompt, c.sampling, c.return_probs, c.coupled),
    needs_model=True, has_probs=True, derived=True, needs_features=True,
    enable_hint="start serve-draft with --model TARGET --eagle-head DIR (or the bundled head's name) to enable it",
))
register(DrafterEntry(DrafterKind.RECYCLING, lambda c: RecyclingDrafter(c.prompt, c.successors),
                      successors_k=SUCCESSORS_K, cheap=True))
register(DrafterEntry(
    DrafterKind.MEDUSA, lambda c: MedusaDrafter(c.derived[DrafterKind.MEDUSA], c.prompt),
    needs_model=True, derived=True, needs_features=True,
    enable_hint="start serve-draft with --model TARGET --medusa-head DIR to enable it",
))
