"""Which drafter serves which ``DrafterKind``: one entry per drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from draft_service.chain import ChainDrafter
from draft_service.drafter import Drafter, DrafterKind
from draft_service.model_drafter import ModelDrafter
from draft_service.ngram import NgramConfig, NgramDrafter
from lmkit.sampling import SamplingParams


@dataclass(frozen=True)
class DraftRequestContext:
    """Everything a drafter may need to start a session."""

    prompt: Sequence[int]
    sampling: SamplingParams
    generator: torch.Generator | None
    return_probs: bool
    ngram: NgramConfig
    model: object | None  # the draft service's model, None when it runs none
    # Models derived from it at start-up, by the kind that runs them (LAYERSKIP, QUANTIZED).
    derived: Mapping[DrafterKind, object] = field(default_factory=dict)
    chain: tuple[DrafterKind, ...] = ()  # the members, in order, when the kind is CHAIN


@dataclass(frozen=True)
class DrafterEntry:
    build: Callable[[DraftRequestContext], Drafter]
    needs_model: bool  # must share the target's vocabulary
    has_probs: bool  # can return the distributions its tokens were sampled from
    derived: bool = False  # runs a model derived from --model at start-up (needs its flag)


def _model_drafter(model, c: DraftRequestContext) -> ModelDrafter:
    return ModelDrafter(model, c.prompt, c.sampling, c.generator, c.return_probs)


def _chain(c: DraftRequestContext) -> ChainDrafter:
    return ChainDrafter([(kind, DRAFTERS[kind].build(c)) for kind in c.chain])


DRAFTERS: dict[DrafterKind, DrafterEntry] = {
    DrafterKind.MODEL: DrafterEntry(lambda c: _model_drafter(c.model, c), True, True),
    DrafterKind.NGRAM: DrafterEntry(lambda c: NgramDrafter(c.ngram, c.prompt), False, False),
    DrafterKind.LAYERSKIP: DrafterEntry(lambda c: _model_drafter(c.derived[DrafterKind.LAYERSKIP], c), True, True, True),
    DrafterKind.QUANTIZED: DrafterEntry(lambda c: _model_drafter(c.derived[DrafterKind.QUANTIZED], c), True, True, True),
    DrafterKind.CHAIN: DrafterEntry(_chain, False, False),
}
