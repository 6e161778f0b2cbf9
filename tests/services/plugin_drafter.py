"""A drafter defined outside draft_service: one module and one registry entry, nothing else.

``python -m tests.services.plugin_drafter [serve-draft flags]`` runs a draft service
that serves it beside the built-in drafters (tests/services/test_drafter_registry.py).
The test process itself never imports this module, so its orchestrator can
know the kind only from the draft's ``Info``.
"""

from __future__ import annotations

from typing import Sequence

from specsplit.draft_service.drafter import Drafter, Proposal
from specsplit.draft_service.registry import DrafterEntry, register
from specsplit.lmkit.kinds import DrafterKind

REPEAT = DrafterKind(90, "REPEAT")


class RepeatDrafter(Drafter):
    """Proposes that the context goes on repeating its last two tokens (always k tokens)."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self._tokens = list(prompt)

    @property
    def position(self) -> int:
        return len(self._tokens)

    def rollback(self, position: int) -> None:
        del self._tokens[position:]

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def propose(self, k: int) -> Proposal:
        pair = self._tokens[-2:] if len(self._tokens) >= 2 else self._tokens[-1:] * 2
        return Proposal(tokens=[pair[i % 2] for i in range(k)])


register(DrafterEntry(REPEAT, lambda c: RepeatDrafter(c.prompt)))

if __name__ == "__main__":
    from specsplit.draft_service.server import main

    main()
