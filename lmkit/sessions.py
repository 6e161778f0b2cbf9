"""Per-service session bookkeeping shared by the draft and the target: limits, the live table, id checks.

Thread-safe: the event loop opens and closes sessions while the compute
thread runs rounds.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

from specsplit.lmkit import errors

S = TypeVar("S")


@dataclass(frozen=True)
class SessionLimits:
    max_block: int = 32  # draft tokens per round
    max_sessions: int = 64  # live sessions
    max_sessions_per_caller: int = 0  # live sessions of one caller (lmkit.auth); 0: max_sessions
    kv_budget_tokens: int = 0  # positions every live session may reserve together (the target's KV budget); 0: none
    kv_budget_bytes: int = 0  # bytes of KV every live session may reserve together (the draft's KV budget); 0: none

    def __post_init__(self) -> None:
        if not 0 <= self.max_block <= 1024:
            raise ValueError(f"--max-block must be in [0, 1024], got {self.max_block}")
        if self.max_sessions < 1:
            raise ValueError(f"--max-sessions must be >= 1, got {self.max_sessions}")
        if self.max_sessions_per_caller < 0:
            raise ValueError(f"--max-sessions-per-caller must be >= 0 (0: --max-sessions), got "
                             f"{self.max_sessions_per_caller}")
        if self.kv_budget_tokens < 0:
            raise ValueError(f"--kv-budget-bytes must be >= 0 (0: no budget), got {self.kv_budget_tokens} tokens")
        if self.kv_budget_bytes < 0:
            raise ValueError(f"--kv-budget-bytes must be >= 0 (0: no budget), got {self.kv_budget_bytes}")
        if self.kv_budget_tokens and self.kv_budget_bytes:
            raise ValueError("a service's KV budget is in positions (the target) or in bytes (the draft), not both")


DEFAULT_PREFILL_CHUNK = 512  # either service's --prefill-chunk unless told otherwise
PREFILL_AUTO = "auto"  # serve-target --prefill-chunk auto: chunks sized by the step's measured cost


def check_prefill_chunk(prefill_chunk: int | str, auto: bool = False) -> None:
    """``--prefill-chunk`` (either service's) is a token count or 0, or ``auto`` where ``auto`` (ValueError
    otherwise)."""
    if auto and prefill_chunk == PREFILL_AUTO:
        return
    if isinstance(prefill_chunk, str) or prefill_chunk < 0:
        choices = "auto or an int >= 0" if auto else "an int >= 0"
        raise ValueError(f"--prefill-chunk must be {choices} (0: a prompt's prefill is one forward), "
                         f"got {prefill_chunk!r}")


def prefill_chunk_flag(value: str) -> int | str:
    """argparse's reading of ``--prefill-chunk``: ``auto`` or a token count (checked by ``check_prefill_chunk``)."""
    if value == PREFILL_AUTO:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a token count, got {value!r}") from None


def check_tokens(tokens: Sequence[int], vocab_size: int | None, what: str) -> None:
    """Every id must index the vocabulary (any id >= 0 when the vocabulary is unknown)."""
    for i, t in enumerate(tokens):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise errors.InvalidArgument(f"{what}[{i}] = {t} is outside the vocabulary {bound}")


def check_open(session_id: str, tokens: Sequence[int], max_context: int, model: str) -> None:
    """What every session open must satisfy, whatever the service."""
    if not session_id:
        raise errors.InvalidArgument("session_id is empty; choose a unique id per generation (e.g. a UUID)")
    if not tokens:
        raise errors.InvalidArgument("the prompt is empty; send at least one token")
    if max_context and len(tokens) >= max_context:
        raise errors.InvalidArgument(
            f"the prompt has {len(tokens)} tokens but the {model}'s context is {max_context}; "
            f"shorten it to at most {max_context - 1}"
        )


def reservation(reserve_tokens: int, max_context: int, prompt_tokens: int) -> int:
    """The positions a session reserves at its open: what it asked for (0: the whole context), within the context
    (0: none known, a model-free draft), and at least its prompt and one more."""
    most = max_context or reserve_tokens
    return max(min(reserve_tokens or most, most), prompt_tokens + 1)


class SessionTable(Generic[S]):
    """Live sessions by id, bounded in all and per caller, with counters for Stats.

    The KV budget: each session reserves the positions it may ever hold at its open. On the target every
    position costs the same (``kv_budget_tokens``, in positions); on the draft a position costs what the
    session's drafter keeps for it (``kv_budget_bytes``; a model-free drafter keeps nothing)."""

    def __init__(self, limits: SessionLimits, service: str) -> None:
        self.limits = limits
        self._service = service
        self._sessions: dict[str, S] = {}
        self._callers: dict[str, str] = {}  # session id -> its caller
        self._held: dict[str, int] = {}  # caller -> live sessions
        self._reserved: dict[str, int] = {}  # session id -> the positions it reserved (its open's reserve)
        self._charged: dict[str, int] = {}  # session id -> what they cost the KV budget (positions or bytes)
        self._reserved_total = 0
        self._lock = threading.Lock()
        self._opened = 0
        self._rounds = 0

    def add(self, session_id: str, session: S, caller: str = "", reserve: int = 0, position_bytes: int = 0) -> S:
        """Add a live session reserving ``reserve`` positions; on a budget in bytes each costs ``position_bytes``."""
        with self._lock:
            if session_id in self._sessions:
                raise errors.AlreadyExists(f"session {session_id!r} is already open; use a new id")
            if len(self._sessions) >= self.limits.max_sessions:
                raise errors.ResourceExhausted(
                    f"the {self._service} holds its maximum of {self.limits.max_sessions} sessions; retry later"
                )
            quota = self.limits.max_sessions_per_caller
            if quota and self._held.get(caller, 0) >= quota:
                raise errors.ResourceExhausted(
                    f"caller {caller!r} holds its maximum of {quota} sessions on the {self._service} "
                    "(--max-sessions-per-caller); close one or retry later"
                )
            charge = reserve * position_bytes if self._budget()[1] == "bytes" else reserve
            self._check_budget(reserve, charge, position_bytes)
            self._sessions[session_id] = session
            self._callers[session_id] = caller
            self._reserved[session_id] = reserve
            self._charged[session_id] = charge
            self._reserved_total += charge
            self._held[caller] = self._held.get(caller, 0) + 1
            self._opened += 1
        return session

    def _budget(self) -> tuple[int, str]:
        """The KV budget and its unit: bytes on the draft, positions on the target; 0: none."""
        if self.limits.kv_budget_bytes:
            return self.limits.kv_budget_bytes, "bytes"
        return self.limits.kv_budget_tokens, "positions"

    def _check_budget(self, reserve: int, charge: int, position_bytes: int) -> None:
        budget, unit = self._budget()
        if not budget or self._reserved_total + charge <= budget:
            return
        free = budget - self._reserved_total
        if unit == "bytes":
            asks = (f"{reserve} positions (prompt + most new tokens + one block) of {position_bytes} bytes each: ask "
                    f"for at most {free // max(position_bytes, 1)} positions in all")
        else:
            asks = f"{reserve} (prompt + most new tokens + one block): ask for at most {free} in all"
        raise errors.ResourceExhausted(
            f"the {self._service}'s KV budget holds {budget} {unit} and {free} are free; this session reserves {asks}, "
            "or retry later"
        )

    def reserved(self, session_id: str) -> int:
        """The positions a live session reserved at its open (0: none, or no such session)."""
        with self._lock:
            return self._reserved.get(session_id, 0)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def remove(self, session_id: str) -> S | None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._reserved.pop(session_id)
                self._reserved_total -= self._charged.pop(session_id)
                caller = self._callers.pop(session_id)
                self._held[caller] -= 1
                if not self._held[caller]:
                    del self._held[caller]
            return session

    def get(self, session_id: str) -> S:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise errors.NotFound(f"no live session {session_id!r}; sessions end with their stream")
        return session

    def find(self, session_id: str, caller: str) -> S | None:
        """The live session ``session_id`` if ``caller`` opened it, else None."""
        with self._lock:
            if self._callers.get(session_id) != caller:
                return None
            return self._sessions.get(session_id)

    def count_round(self) -> None:
        with self._lock:
            self._rounds += 1

    def budget(self) -> tuple[int, int, str]:
        """(reserved, the KV budget, its unit): positions on the target, bytes on the draft; a budget of 0: none."""
        with self._lock:
            return self._reserved_total, *self._budget()

    def stats(self) -> tuple[int, int, int]:
        """(active sessions, sessions opened, rounds served)."""
        with self._lock:
            return len(self._sessions), self._opened, self._rounds
