"""Fault-tolerant links from one generation to its draft and target sessions.

Services hold caches, never truth: the orchestrator's committed tokens are the
truth, so a lost session is rebuilt by opening a new one with them.

* ``DraftLink``: a draft that fails, stalls past its deadline or is
  unreachable is dropped for the round (the target decodes on its own, k = 0)
  and re-attached, re-prefilled from the committed tokens, once it answers
  again. Speculation is an optimisation; its loss never fails a generation.
* ``TargetLink``: a target that restarts or drops the session is re-opened
  from the committed tokens and the same block is verified again; only a
  target that stays down past its deadline fails the generation (UNAVAILABLE).

A failed round commits nothing, so no token is lost, duplicated or retracted.

Deadlines use ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11
``wait_for`` can swallow a cancellation that lands as its call completes, and
a cancelled generation would run on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc

from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.wire import join_features
from orchestrator.peers import DraftStream, PeerError, ServiceClient, TargetStream

log = logging.getLogger(__name__)

# Codes after which a new session may succeed (restart, eviction, a stall). RESOURCE_EXHAUSTED goes to the client.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


@dataclass(frozen=True)
class LinkPolicy:
    draft_timeout_s: float = 5.0  # one propose; past it the draft is dropped for now
    draft_retry_s: float = 1.0  # wait between re-attach attempts
    target_timeout_s: float = 120.0  # one verify (a long prompt's prefill on a CPU is slow)
    target_deadline_s: float = 30.0  # how long a target may stay down before the client hears UNAVAILABLE
    target_retry_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("draft_timeout_s", "draft_retry_s", "target_timeout_s", "target_deadline_s", "target_retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")


def _new_id() -> str:
    return uuid.uuid4().hex


class _SessionLink:
    """One generation's session on a service: its stream (None while there is none) and how to open one."""

    def __init__(self, client: ServiceClient, open_msg: Callable[[str, Sequence[int]], object],
                 policy: LinkPolicy) -> None:
        self._client = client
        self._open_msg = open_msg  # (session id, committed tokens) -> the service's open message
        self._policy = policy
        self._stream = None

    async def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()


class TargetLink(_SessionLink):
    def __init__(self, client: ServiceClient, open_msg: Callable[[str, Sequence[int]], pb.TargetOpen],
                 policy: LinkPolicy) -> None:
        super().__init__(client, open_msg, policy)
        self._stream: TargetStream | None = None
        self._opened = 0
        self._verified = 0  # verifications on the current session
        self.last_prefilled = False  # the last verify ran on a fresh session: its time includes a prefill

    @property
    def reopens(self) -> int:
        """Sessions opened after the first (target restarts or evictions survived)."""
        return max(self._opened - 1, 0)

    async def open(self, committed: Sequence[int]) -> None:
        stream = TargetStream(self._client.stub.Session())
        try:
            async with asyncio.timeout(self._policy.target_timeout_s):
                await stream.open(self._open_msg(_new_id(), committed))
        except BaseException:
            stream.abort()
            raise
        self._stream = stream
        self._opened += 1
        self._verified = 0

    async def try_open(self, committed: Sequence[int]) -> bool:
        """Open the session now; False when the target is briefly unavailable (the first verify retries)."""
        try:
            await self.open(committed)
        except (PeerError, asyncio.TimeoutError) as exc:
            if isinstance(exc, PeerError) and exc.code not in _RETRYABLE:
                raise
            return False
        return True

    async def verify(self, committed: Sequence[int], tokens: Sequence[int], probs) -> pb.VerifyResult:
        """Verify a block at len(committed), re-opening the session until the deadline if the target fails."""
        deadline = time.monotonic() + self._policy.target_deadline_s
        while True:
            try:
                if self._stream is None:
                    await self.open(committed)
                call = self._stream.verify(len(committed), tokens, probs)
                async with asyncio.timeout(self._policy.target_timeout_s):
                    result = await call
                self._verified += 1
                self.last_prefilled = self._verified == 1  # a session's first block carries its prefill
                return result
            except (PeerError, asyncio.TimeoutError) as exc:
                if isinstance(exc, PeerError) and exc.code not in _RETRYABLE:
                    raise
                self.abort()
                if time.monotonic() > deadline:
                    reason = exc.details if isinstance(exc, PeerError) else "timed out"
                    raise PeerError(
                        "target", grpc.StatusCode.UNAVAILABLE,
                        f"the target at {self._client.address} stayed unavailable for "
                        f"{self._policy.target_deadline_s:.0f} s ({reason})",
                    ) from None
                log.warning("target failed (%s); re-opening the session from %d committed tokens", exc, len(committed))
                await asyncio.sleep(self._policy.target_retry_s)

    def abort(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.abort()


class DraftLink(_SessionLink):
    def __init__(self, client: ServiceClient, open_msg: Callable[[str, Sequence[int]], pb.DraftOpen],
                 policy: LinkPolicy) -> None:
        super().__init__(client, open_msg, policy)
        self._stream: DraftStream | None = None
        self._synced = 0  # the draft holds committed[:_synced]
        self._down_since: float | None = None
        self._proposed = 0  # proposals on the current session
        self.last_prefilled = False  # the last plain propose ran on a fresh session: its time includes a prefill
        self.fallback_rounds = 0  # rounds decoded without a draft because it was down
        self.reattached = 0
        self._features: pb.HiddenFeatures | None = None  # the target's features not yet forwarded (feature drafters)

    @property
    def up(self) -> bool:
        return self._stream is not None

    async def open(self, committed: Sequence[int]) -> bool:
        stream = DraftStream(self._client.stub.Session())
        try:
            async with asyncio.timeout(self._policy.draft_timeout_s):
                await stream.open(self._open_msg(_new_id(), committed))
        except (PeerError, asyncio.TimeoutError) as exc:
            stream.abort()
            self._mark_down(exc)
            return False
        self._stream, self._synced, self._down_since = stream, len(committed), None
        self._proposed = 0
        return True

    def add_features(self, features: pb.HiddenFeatures) -> None:
        """Hold the target's features of committed positions until the next proposal carries them."""
        self._features = join_features(self._features, features)

    async def propose(self, committed: Sequence[int], k: int, free_k: int = 0) -> pb.DraftBlock | None:
        """A block of up to k tokens (a free drafter: up to free_k), or None when the draft is down (this
        round decodes without it)."""
        block = await self._propose(committed, (), k, free_k)
        if block is None:
            self.fallback_rounds += 1
        else:
            self.last_prefilled = self._proposed == 1  # a model drafter reads the whole context on its first
        return block

    async def propose_ahead(self, committed: Sequence[int], block: Sequence[int], k: int,
                            free_k: int = 0) -> pb.DraftBlock | None:
        """Draft past ``block`` as if the target will accept it whole: up to k + 1 tokens (a free drafter:
        free_k + 1), the first being the guess for the target's bonus token. Runs while the target verifies
        ``block``.

        The draft treats ``block`` as committed for now; the next propose starts
        at the last truly committed position, so it rolls all of this back.
        """
        if self._stream is None:  # re-attaching is the next plain propose's job
            return None
        return await self._propose(committed, block, k + 1, free_k + 1 if free_k else 0)

    async def _propose(self, committed: Sequence[int], assumed: Sequence[int], k: int,
                       free_k: int) -> pb.DraftBlock | None:
        if self._stream is None and not await self._try_reattach(committed):
            return None
        synced = len(committed)  # read now: a proposal drafted ahead runs while ``committed`` grows
        features, self._features = self._features, None  # a new session starts from whichever features come next
        try:
            call = self._stream.propose(self._synced, [*committed[self._synced :], *assumed], k, free_k, features)
            async with asyncio.timeout(self._policy.draft_timeout_s):
                block = await call
        except (PeerError, asyncio.TimeoutError) as exc:
            stream, self._stream = self._stream, None
            stream.abort()
            self._mark_down(exc)
            return None
        self._synced = synced  # ``assumed`` is not committed: it is re-sent or rolled back next time
        self._proposed += 1
        return block

    async def _try_reattach(self, committed: Sequence[int]) -> bool:
        if self._down_since is not None and time.monotonic() - self._down_since < self._policy.draft_retry_s:
            return False
        if await self.open(committed):
            self.reattached += 1
            log.info("draft re-attached at position %d", len(committed))
            return True
        return False

    def _mark_down(self, exc: BaseException) -> None:
        if self._down_since is None:
            log.warning("draft unavailable (%s); continuing with target-only decoding", exc)
        self._down_since = time.monotonic()
