"""The target engine: per-session KV caches and one-pass verification of draft blocks.

No grpc here: the servicer converts protos to these calls and maps
``lmkit.errors`` to status codes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lmkit import errors
from lmkit.kvcache import SessionCache
from lmkit.sampling import SamplingParams, logits_to_probs, make_generator
from lmkit.sessions import SessionLimits, SessionTable, check_open, check_tokens
from target_service import rejection
from target_service.rejection import VerificationMode


@dataclass
class TargetSession:
    session_id: str
    tokens: list[int]  # committed: prompt + output, the orchestrator's truth mirrored
    sampling: SamplingParams
    mode: VerificationMode
    cache: SessionCache
    generator: torch.Generator | None
    rounds: int = 0


@dataclass(frozen=True)
class Verified:
    accepted: int
    next_token: int
    compute_s: float


def check_mode(mode: VerificationMode, sampling: SamplingParams) -> None:
    if mode is VerificationMode.GREEDY and not sampling.greedy:
        raise errors.InvalidArgument(
            f"VERIFICATION_MODE_GREEDY needs temperature 0, got {sampling.temperature}; "
            "use TOKEN_ONLY or DRAFT_PROBS for sampling"
        )
    if mode is not VerificationMode.GREEDY and sampling.greedy:
        raise errors.InvalidArgument(f"{mode.name} samples and needs temperature > 0; use GREEDY for temperature 0")


class TargetEngine:
    """Holds the target model and its sessions; all model work runs on one thread."""

    def __init__(
        self,
        model,
        *,
        model_id: str,
        vocab_fingerprint: str,
        limits: SessionLimits,
        new_cache: Callable[[], SessionCache] | None = None,  # tensor parallel: caches mirrored on every rank
        tp_degree: int = 1,
    ) -> None:
        self.model = model
        self.model_id = model_id
        self.vocab_fingerprint = vocab_fingerprint
        self.limits = limits
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.sessions: SessionTable[TargetSession] = SessionTable(limits, "target")
        self._new_cache = new_cache or (lambda: SessionCache(model))
        self.tp_degree = tp_degree

    # -- sessions -----------------------------------------------------------
    def open(self, session_id: str, tokens: Sequence[int], sampling: SamplingParams, mode: VerificationMode):
        check_open(session_id, tokens, self.max_context, "model")
        check_tokens(tokens, self.vocab_size, "tokens")
        check_mode(mode, sampling)
        generator = None if sampling.greedy else make_generator(sampling.seed, "target")
        session = TargetSession(session_id, list(tokens), sampling, mode, self._new_cache(), generator)
        return self.sessions.add(session_id, session)

    def close(self, session_id: str) -> None:
        session = self.sessions.remove(session_id)
        if session is not None:
            session.cache.release()

    # -- verification -------------------------------------------------------
    def verify(
        self,
        session: TargetSession,
        position: int,
        draft_tokens: Sequence[int],  # [k]
        draft_probs: torch.Tensor | None,  # [k, vocab] in DRAFT_PROBS mode, else None
    ) -> Verified:
        """Run the block through the target in one forward pass and commit accepted + 1 tokens."""
        self._check_block(session, position, draft_tokens, draft_probs)
        start = time.perf_counter()
        logits = session.cache.logits(session.tokens, draft_tokens)  # [k+1, vocab]
        result = self._decide(session, logits, draft_tokens, draft_probs)
        session.tokens.extend(draft_tokens[: result.accepted])
        session.tokens.append(result.next_token)
        session.rounds += 1
        self.sessions.count_round()
        return Verified(result.accepted, result.next_token, time.perf_counter() - start)

    def _check_block(self, session, position, draft_tokens, draft_probs) -> None:
        committed = len(session.tokens)
        if position != committed:
            raise errors.FailedPrecondition(
                f"block starts at position {position} but session {session.session_id!r} has {committed} "
                f"committed tokens; send blocks at position {committed}"
            )
        k = len(draft_tokens)
        if k > self.limits.max_block:
            raise errors.InvalidArgument(f"block has {k} draft tokens; this target accepts at most {self.limits.max_block}")
        if committed + k + 1 > self.max_context:
            room = max(self.max_context - committed - 1, 0)
            raise errors.InvalidArgument(
                f"block of {k} tokens at position {committed} overflows the model's context of "
                f"{self.max_context}; send at most {room} draft tokens"
            )
        check_tokens(draft_tokens, self.vocab_size, "draft_tokens")
        if session.mode is VerificationMode.DRAFT_PROBS:
            if draft_probs is None and k > 0:
                raise errors.InvalidArgument("DRAFT_PROBS mode needs draft_probs with one row per draft token")
            if draft_probs is not None and tuple(draft_probs.shape) != (k, self.vocab_size):
                raise errors.InvalidArgument(
                    f"draft_probs has shape {tuple(draft_probs.shape)}; expected ({k}, {self.vocab_size})"
                )
        elif draft_probs is not None:
            raise errors.InvalidArgument(
                f"draft_probs sent in {session.mode.name} mode; open the session with DRAFT_PROBS to use them"
            )

    @staticmethod
    def _decide(session, logits, draft_tokens, draft_probs) -> rejection.VerifyResult:
        tokens = torch.tensor(list(draft_tokens), dtype=torch.long)
        if session.mode is VerificationMode.GREEDY:
            return rejection.verify_greedy(logits, tokens)
        target_probs = logits_to_probs(logits, session.sampling)
        if session.mode is VerificationMode.TOKEN_ONLY or not draft_tokens:
            return rejection.verify_token_only(target_probs, tokens, session.generator)
        return rejection.verify_draft_probs(target_probs, draft_probs, tokens, session.generator)
