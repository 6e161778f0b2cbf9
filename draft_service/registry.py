"""Which drafter serves which ``DrafterKind``: one entry per drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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


@dataclass(frozen=True)
class DrafterEntry:
    build: Callable[[DraftRequestContext], Drafter]
    needs_model: bool  # must share the target's vocabulary
    has_probs: bool  # can return the distributions its tokens were sampled from


DRAFTERS: dict[DrafterKind, DrafterEntry] = {
    DrafterKind.MODEL: DrafterEntry(
        lambda c: ModelDrafter(c.model, c.prompt, c.sampling, c.generator, c.return_probs), True, True
    ),
    DrafterKind.NGRAM: DrafterEntry(lambda c: NgramDrafter(c.ngram, c.prompt), False, False),
}
