"""A bench-only drafter whose acceptance rate is a knob, at the real draft model's cost.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", §3) model a drafter by one number α: each draft token is accepted
with probability α, independently, so a round of k tokens commits
E = (1 - α^(k+1)) / (1 - α) tokens. Under greedy decoding this drafter makes α
exact: it knows the target's greedy continuation of each prompt (from a JSON file
named by ``SPECSPLIT_ORACLE_FILE``, read when a session opens) and drafts that
continuation's token with probability α, a different token otherwise. Every
drafted token still costs one forward of the draft service's own model. Once a
session leaves the known continuation (a numerical flip) it drafts random tokens.

``python -m specsplit.bench.oracle_drafter [serve-draft flags]`` serves it beside the
built-in drafters, as ``tests/services/plugin_drafter.py`` does.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from specsplit.draft_service.drafter import Proposal
from specsplit.draft_service.model_drafter import ModelDrafter
from specsplit.draft_service.registry import DrafterEntry, DraftRequestContext, register
from specsplit.lmkit import errors
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.sampling import SamplingParams

ORACLE = DrafterKind(95, "ORACLE")
ORACLE_FILE_ENV = "SPECSPLIT_ORACLE_FILE"


@dataclass(frozen=True)
class Oracle:
    """α and the target's greedy continuation of each prompt."""

    alpha: float = 0.0
    continuations: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def write(self, path: Path) -> None:
        prompts = [list(p) for p in self.continuations]
        payload = {"alpha": self.alpha, "seed": self.seed, "prompts": prompts,
                   "continuations": list(self.continuations.values())}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(path)  # a session opening meanwhile reads the old file or the new one, whole

    @classmethod
    def read(cls, path: Path) -> Oracle:
        payload = json.loads(path.read_text())
        pairs = zip(payload["prompts"], payload["continuations"])
        return cls(float(payload["alpha"]), {tuple(p): list(c) for p, c in pairs}, int(payload["seed"]))


class OracleDrafter(ModelDrafter):
    """The model drafter (its cache, context and rollback) with each token chosen by the oracle."""

    def __init__(self, model, prompt: Sequence[int], oracle: Oracle, vocab_size: int,
                 new_cache: Callable[[object], SessionCache] = SessionCache) -> None:
        super().__init__(model, prompt, SamplingParams(), return_probs=False, new_cache=new_cache)
        self._prompt_len = len(prompt)
        self._truth = oracle.continuations.get(tuple(prompt), [])
        self._alpha = oracle.alpha
        self._vocab = vocab_size
        self._rng = random.Random(oracle.seed * 1_000_003 + zlib.crc32(repr(list(prompt)).encode()))

    def propose(self, k: int) -> Proposal:
        output = self._tokens[self._prompt_len :]
        on_script = output == self._truth[: len(output)]
        drafted: list[int] = []
        for i in range(k):
            self._cache.logits([*self._tokens, *drafted], [])  # the draft model's step; its own choice is unused
            index = len(output) + i
            truth = self._truth[index] if on_script and index < len(self._truth) else None
            drafted.append(self._choose(truth))
        return Proposal(tokens=drafted)

    def _choose(self, truth: int | None) -> int:
        """``truth`` with probability α, else another token (any token when the truth is unknown)."""
        draw = self._rng.random()
        if truth is None:
            return self._rng.randrange(self._vocab)
        if draw < self._alpha:
            return truth
        return (truth + 1 + self._rng.randrange(self._vocab - 1)) % self._vocab


def _build(c: DraftRequestContext) -> OracleDrafter:
    if not c.sampling.greedy:
        raise errors.InvalidArgument("the ORACLE drafter knows greedy continuations only; use temperature 0")
    path = os.environ.get(ORACLE_FILE_ENV, "")
    if not path or not Path(path).is_file():
        raise errors.FailedPrecondition(f"the ORACLE drafter reads ${ORACLE_FILE_ENV}, which names no file ({path!r})")
    return OracleDrafter(c.model, c.prompt, Oracle.read(Path(path)), int(c.model.config.vocab_size), c.new_cache)


register(DrafterEntry(ORACLE, _build, needs_model=True,
                      enable_hint="run `python -m specsplit.bench.oracle_drafter --model DRAFT` with $SPECSPLIT_ORACLE_FILE set"))

if __name__ == "__main__":
    from specsplit.draft_service.server import main

    main()
