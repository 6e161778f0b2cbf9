"""The draft engine: one drafter per session, driven round by round. No grpc here."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

from draft_service.drafter import DraftBlock, Drafter, DrafterKind
from draft_service.ngram import NgramConfig
from draft_service.registry import DRAFTERS, DraftRequestContext
from lmkit import errors
from lmkit.sampling import SamplingParams, make_generator


@dataclass(frozen=True)
class DraftLimits:
    max_block: int = 32
    max_sessions: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.max_block <= 1024:
            raise ValueError(f"--max-block must be in [0, 1024], got {self.max_block}")
        if self.max_sessions < 1:
            raise ValueError(f"--max-sessions must be >= 1, got {self.max_sessions}")


@dataclass
class DraftSession:
    session_id: str
    kind: DrafterKind
    drafter: Drafter
    rounds: int = 0


@dataclass(frozen=True)
class Proposed:
    block: DraftBlock
    compute_s: float


def check_tokens(tokens: Sequence[int], vocab_size: int | None, what: str) -> None:
    for i, t in enumerate(tokens):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise errors.InvalidArgument(f"{what}[{i}] = {t} is outside the vocabulary {bound}")


class DraftEngine:
    """Holds an optional draft model and the live sessions."""

    def __init__(self, model=None, *, model_id: str = "", vocab_fingerprint: str = "", limits: DraftLimits) -> None:
        self.model = model
        self.model_id = model_id or "(model-free)"
        self.vocab_fingerprint = vocab_fingerprint if model is not None else ""
        self.vocab_size = int(model.config.vocab_size) if model is not None else None
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) if model is not None else 0
        self.limits = limits
        self._sessions: dict[str, DraftSession] = {}
        self._lock = threading.Lock()
        self._opened = 0
        self._rounds = 0

    @property
    def drafters(self) -> list[DrafterKind]:
        return [kind for kind, entry in DRAFTERS.items() if self.model is not None or not entry.needs_model]

    def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        sampling: SamplingParams,
        kind: DrafterKind,
        return_probs: bool,
        ngram: NgramConfig,
    ) -> DraftSession:
        if not session_id:
            raise errors.InvalidArgument("session_id is empty; choose a unique id per generation (e.g. a UUID)")
        if not tokens:
            raise errors.InvalidArgument("the prompt is empty; send at least one token")
        if self.max_context and len(tokens) >= self.max_context:
            raise errors.InvalidArgument(
                f"the prompt has {len(tokens)} tokens but the draft model's context is {self.max_context}"
            )
        check_tokens(tokens, self.vocab_size, "tokens")
        if kind not in self.drafters:
            raise errors.FailedPrecondition(
                f"drafter {kind.name} is not available here (this service runs {[d.name for d in self.drafters]}); "
                "start serve-draft with --model to enable the model drafter"
            )
        entry = DRAFTERS[kind]
        if return_probs and not entry.has_probs:
            raise errors.InvalidArgument(f"drafter {kind.name} has no draft probabilities; use token-only verification")
        generator = None if sampling.greedy else make_generator(sampling.seed, "draft")
        context = DraftRequestContext(list(tokens), sampling, generator, return_probs, ngram, self.model)
        session = DraftSession(session_id, kind, entry.build(context))
        with self._lock:
            if session_id in self._sessions:
                raise errors.AlreadyExists(f"session {session_id!r} is already open; use a new id")
            if len(self._sessions) >= self.limits.max_sessions:
                raise errors.ResourceExhausted(f"the draft holds its maximum of {self.limits.max_sessions} sessions")
            self._sessions[session_id] = session
            self._opened += 1
        return session

    def propose(self, session: DraftSession, position: int, tokens: Sequence[int], k: int) -> Proposed:
        """Take the committed tokens from ``position`` on, then draft up to ``k``."""
        held = session.drafter.position
        if position > held:
            raise errors.FailedPrecondition(
                f"propose at position {position} but session {session.session_id!r} holds {held} tokens; "
                f"resend the committed tokens from position {held}"
            )
        if k > self.limits.max_block:
            raise errors.InvalidArgument(f"k = {k} is larger than this draft's max block {self.limits.max_block}")
        if position + len(tokens) == 0:
            raise errors.InvalidArgument("propose would leave the context empty; send the committed tokens")
        check_tokens(tokens, self.vocab_size, "tokens")
        start = time.perf_counter()
        session.drafter.commit(position, tokens)
        block = session.drafter.propose(k)
        session.rounds += 1
        with self._lock:
            self._rounds += 1
        return Proposed(block, time.perf_counter() - start)

    def close(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            session.drafter.close()

    def get(self, session_id: str) -> DraftSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise errors.NotFound(f"no live session {session_id!r}; sessions end with their stream")
        return session

    def stats(self) -> tuple[int, int, int]:
        with self._lock:
            return len(self._sessions), self._opened, self._rounds
