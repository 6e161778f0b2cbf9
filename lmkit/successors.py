"""The target's most likely successors of the tokens it verified: what token recycling drafts from.

Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling"): every verifying forward ranks the whole vocabulary after each
position it computes, draft tokens that are then rejected included; the few best ids after a token
are good guesses of what follows that token next time. The target returns them (``Successors``), the
orchestrator forwards them to the draft, and the draft keeps them in a table token -> successors.
Pure: no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MAX_SUCCESSORS = 16  # TargetOpen.successors_k: ids per position at most


@dataclass(frozen=True)
class Successors:
    """Per position of a verified block: the token there, and the ``k`` ids the target ranks highest after it."""

    k: int
    tokens: tuple[int, ...]  # [n]: the last context token, then each draft token (a tree's nodes in order)
    ids: tuple[int, ...]  # [n * k], position after position, best first

    def __post_init__(self) -> None:
        if self.k < 1 and self.tokens:
            raise ValueError(f"successors need k >= 1, got {self.k}")
        if len(self.ids) != len(self.tokens) * self.k:
            raise ValueError(f"{len(self.ids)} successor ids for {len(self.tokens)} tokens of k = {self.k}; "
                             "expected one row of k per token")

    def rows(self) -> Sequence[tuple[int, tuple[int, ...]]]:
        """(token, its successors) per position."""
        k = self.k
        return [(token, self.ids[i * k : (i + 1) * k]) for i, token in enumerate(self.tokens)]


def check_successors_k(k: int) -> None:
    if not 0 <= k <= MAX_SUCCESSORS:
        raise ValueError(f"successors_k must be in [0, {MAX_SUCCESSORS}], got {k}")
