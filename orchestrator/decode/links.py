"""Fault-tolerant links from one generation to its draft and target sessions.

Services hold caches, never truth: a lost session is rebuilt from the
orchestrator's committed tokens. ``DraftLink``: a block late past its round's
deadline (the wait the loop gives each request) is not waited for and is
dropped when it comes; a draft that fails, stalls or is unreachable is
re-attached in the background, re-prefilled; losing it never fails a generation. ``TargetLink``: a target that
restarts or drops the session is re-opened and the same block verified again;
only one down past its deadline fails the generation (UNAVAILABLE). A failed
round commits nothing, so no token is lost, duplicated or retracted.

A verify is bounded by ``timeouts.Timeouts`` (one timer for all of a link's
verifies), an open by ``asyncio.timeout``; never ``asyncio.wait_for``: on
Python 3.11 it can swallow a cancellation that lands as its call completes. A
proposal is sent at once and not awaited: the next request finds it stalled.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc

from specsplit.lmkit import errors
from specsplit.lmkit.wire import join_features
from specsplit.orchestrator.decode.peers import (
    RETRYABLE,
    DraftStream,
    OwnStream,
    PeerError,
    Pool,
    ServiceClient,
    TargetStream,
)
from specsplit.orchestrator.decode.policy.measure import RttEstimator
from specsplit.orchestrator.decode.replies import DraftedBlock, DraftReplyCost, VerifiedBlock, drafted_of, verified_of
from specsplit.orchestrator.decode.timeouts import Timeouts
from specsplit.v1 import specsplit_pb2 as pb

log = logging.getLogger(__name__)

_HELD_SUCCESSORS = 16  # the target's successor reports a draft link holds for the next proposal, the latest kept

@dataclass(frozen=True)
class LinkPolicy:
    draft_timeout_s: float = 5.0  # one propose; past it the draft is dropped for now
    draft_deadline_s: float = 0.0  # how long a round waits for a draft block; 0: from the link's RTT and costs
    draft_retry_s: float = 1.0  # wait between re-attach attempts
    target_timeout_s: float = 120.0  # one verify (a long prompt's prefill on a CPU is slow)
    target_deadline_s: float = 30.0  # how long a target may stay down before the client hears UNAVAILABLE
    target_retry_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("draft_timeout_s", "draft_retry_s", "target_timeout_s", "target_deadline_s", "target_retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.draft_deadline_s < 0:
            raise ValueError("--draft-deadline-s must be >= 0 (0: adaptive)")


def _new_id() -> str:
    return uuid.uuid4().hex


class _SessionLink:
    """One generation's session on a service: its stream (None while there is none) and how to open one, on the
    replica of the service's pool that ``Pool.place`` picks at each open."""

    def __init__(self, pool: Pool, open_msg: Callable[[str, Sequence[int]], object],
                 policy: LinkPolicy, shared: bool = False) -> None:
        self._pool = pool
        self._open_msg = open_msg  # (session id, committed tokens) -> the service's open message
        self._policy = policy
        self._shared = shared  # on the client's shared Sessions stream (where it has one)
        self._stream = None

    async def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()

    def _transport(self, request_type, peer: str, session_id: str, prefer: str = "", exclude=()):
        """A new session's calls, on a replica of the pool (``prefer``: the one holding that session, a fork's
        source; never one of ``exclude``): on the replica's shared stream where this link uses it, else on a
        stream of its own."""

        def on(replica: ServiceClient):
            mux = replica.mux if self._shared else None
            return mux.session() if mux is not None else OwnStream(replica.stub.Session(), request_type, peer)

        return self._pool.place(session_id, on, prefer, exclude)

    async def _open_somewhere(self, message, request_type, peer: str, stream_type, timeout_s: float):
        """``message`` (an open) on a replica of the pool: one that refuses it for room (RESOURCE_EXHAUSTED: its
        KV budget or session limit is taken, by other orchestrators' sessions too) passes it to the next live
        replica not yet asked; the last refusal is raised once every one has refused. Returns the open stream."""
        tried: list[ServiceClient] = []
        while True:
            placed = self._transport(request_type, peer, message.session_id, message.fork_from, tried)
            stream = stream_type(placed)
            try:
                async with asyncio.timeout(timeout_s):
                    await self._pool.recheck(placed.replica, timeout_s)  # a replica that came back: its build
                    await stream.open(message)
                return stream
            except errors.FailedPrecondition:
                stream.abort()
                tried.append(placed.replica)
                if not self._pool.untried(tried):
                    raise
            except PeerError as exc:
                stream.abort()
                tried.append(placed.replica)
                if exc.code is grpc.StatusCode.UNIMPLEMENTED:
                    # another build answers at the address, restarted since the check before the open (the channel
                    # had not noticed yet): its Info says which, as FailedPrecondition
                    placed.replica.failed_at = time.monotonic()
                    try:
                        await self._pool.recheck(placed.replica, timeout_s)
                    except errors.FailedPrecondition:
                        if not self._pool.untried(tried):
                            raise
                        continue
                if exc.code is not grpc.StatusCode.RESOURCE_EXHAUSTED or not self._pool.untried(tried):
                    raise
                log.info("the %s replica at %s has no room (%s); opening the session on another",
                         peer, placed.replica.address, exc.details)
                message.fork_from = ""  # the source's cache is on the replica that refused: compute the prompt
            except BaseException:  # a timeout, or cancelled with the open on the way: no session may stay behind
                stream.abort()
                raise


class TargetLink(_SessionLink):
    def __init__(self, pool: Pool, open_msg: Callable[[str, Sequence[int]], pb.TargetOpen],
                 policy: LinkPolicy, rtt: RttEstimator | None = None, shared: bool = False) -> None:
        super().__init__(pool, open_msg, policy, shared)
        self._verifies = Timeouts(policy.target_timeout_s)  # a verify unanswered this long: the target has stalled
        self._stream: TargetStream | None = None
        self._opened = 0
        self._rtt = rtt if rtt is not None else RttEstimator()  # this target's link, shared by its sessions
        self._verified = 0  # verifications on the current session
        self.last_prefilled = False  # the last verify ran on a fresh session: its time includes a prefill
        self.last_wall_s = 0.0  # the last verify's wall time here, send to result
        self.session_id = ""  # the open session's id on the target ("" while none is open)
        self.fork_from = ""  # a session whose prompt cache a new session of this link copies (TargetOpen.fork_from)
        # The target's scores of the prompt (TargetOpen.prompt_logprobs), from the first session's first result
        self.prompt_logprobs: list[pb.TokenLogprob] = []

    @property
    def reopens(self) -> int:
        """Sessions opened after the first (target restarts or evictions survived)."""
        return max(self._opened - 1, 0)

    async def open(self, committed: Sequence[int]) -> None:
        message = self._open_msg(_new_id(), committed)
        message.fork_from = self.fork_from
        stream = await self._open_somewhere(message, pb.TargetRequest, "target", TargetStream,
                                            self._policy.target_timeout_s)
        self._stream = stream
        self.session_id = message.session_id
        self._opened += 1
        self._verified = 0

    async def close(self) -> None:
        self._verifies.close()
        await super().close()

    async def try_open(self, committed: Sequence[int]) -> bool:
        """Open the session now; False when the target is briefly unavailable (the first verify retries)."""
        try:
            await self.open(committed)
        except (PeerError, asyncio.TimeoutError) as exc:
            if isinstance(exc, PeerError) and exc.code not in RETRYABLE:
                raise
            return False
        return True

    async def verify(
        self, committed: Sequence[int], tokens: Sequence[int], probs, parents: Sequence[int] = (),
        allowed: bytes | None = None,
    ) -> VerifiedBlock:
        """Verify a block at len(committed), re-opening the session until the deadline if the target fails.

        ``parents``: the block is a token tree (empty: a chain); ``allowed``: a grammar's mask of its positions
        and the one after them (``grammar.Masked.bits``).
        """
        deadline = time.monotonic() + self._policy.target_deadline_s
        mask = pb.TokenMask(rows=len(tokens) + 1, bits=allowed) if allowed is not None else None
        while True:
            try:
                if self._stream is None:
                    await self.open(committed)
                call = self._stream.verify(len(committed), tokens, probs, parents, mask)
                start = time.perf_counter()
                with self._verifies.bound():
                    result = await call
                self.last_wall_s = time.perf_counter() - start
                self._rtt.observe(self.last_wall_s - (result.timing.service_us or result.timing.compute_us) / 1e6)
                self._verified += 1
                self.last_prefilled = self._verified == 1  # a session's first block carries its prefill
                if result.prompt_logprobs and not self.prompt_logprobs:  # a re-opened session's scores come again
                    self.prompt_logprobs = list(result.prompt_logprobs)
                return verified_of(result)
            except (PeerError, asyncio.TimeoutError) as exc:
                if isinstance(exc, PeerError) and exc.code not in RETRYABLE:
                    raise
                self.abort()
                if time.monotonic() > deadline:
                    reason = exc.details if isinstance(exc, PeerError) else "timed out"
                    raise PeerError(
                        "target", grpc.StatusCode.UNAVAILABLE,
                        f"the target at {self._pool.address} stayed unavailable for "
                        f"{self._policy.target_deadline_s:.0f} s ({reason})",
                    ) from None
                log.warning("target failed (%s); re-opening the session from %d committed tokens", exc, len(committed))
                await asyncio.sleep(self._policy.target_retry_s)

    def abort(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.abort()
        self.session_id = ""


@dataclass
class DraftCall:
    """A proposal on its way: the reply, the loop time by which a round waits for it, where its block starts."""

    reply: asyncio.Future  # of its DraftedBlock, None when it failed (a re-attaching open's: None)
    deadline: float  # loop.time(); past it the round goes on without this block
    position: int  # committed + assumed tokens it continues: the reply's block must start here
    sent: float  # loop.time() when it was sent; unanswered ``draft_timeout_s`` later, the draft has stalled
    answered: float = 0.0  # time.perf_counter() when its answer came (0: not yet, or never)


class DraftLink(_SessionLink):
    """The draft session of one generation: requests in order on one stream, each with a deadline.

    A request is sent at once, no task of its own: the draft serves a session's
    requests in the order sent (on a stream of the session's own, the next is
    written once the one before is answered). A reply that misses its deadline
    is not waited for: the round goes on without it (the target steps alone),
    it is dropped when it comes, and until then the link takes no new request.
    A request unanswered after ``draft_timeout_s`` drops the stream (seen at
    the next request); re-attaching runs in the background. No round ever waits for
    the draft past a request's deadline. The link asks no one how long to wait
    and tells no one what a reply cost: the loop passes each request's wait and
    takes every reply's cost (``take_costs``), late ones included.
    """

    def __init__(self, pool: Pool, open_msg: Callable[[str, Sequence[int]], pb.DraftOpen],
                 policy: LinkPolicy, shared: bool = False) -> None:
        super().__init__(pool, open_msg, policy, shared)
        self._stream: DraftStream | None = None
        self._costs: list[DraftReplyCost] = []  # replies' costs the loop has not taken yet
        self._synced = 0  # the draft holds committed[:_synced]
        self._down_since: float | None = None
        self._tail: DraftCall | None = None  # the last request sent (or the re-attaching open)
        self._pending: set[asyncio.Future] = set()  # replies on their way, and a re-attaching open
        self._cold = True  # the first proposal after an open waits for the draft's read of the context
        self._opened_at = 0.0  # when the draft session opened (event-loop time), and its read of the context began
        self.fallback_rounds = 0  # rounds decoded without a draft because it was down
        self.busy_rounds = 0  # rounds decoded without a draft because a late reply was still due
        self.late_blocks = 0  # replies that missed their deadline (dropped when they came)
        self.compute_s = 0.0  # drafting time of every reply, used or not
        self.wall_s = 0.0  # every reply's wall time here, request to reply (with overlap, mostly hidden)
        self.service_s = 0.0  # ... and the draft's time on it, receipt to answer
        self.warm_s = 0.0  # ... of the replies that were not a session's first (those read the context too)
        self.warm_tokens = 0  # tokens of those replies, used or not (with ``warm_s``: the time a token costs)
        self.reattached = 0
        self._features: pb.HiddenFeatures | None = None  # the target's features not yet forwarded (feature drafters)
        # The target's successors not yet forwarded (recycling drafters), the latest few while the draft is away.
        self._successors: collections.deque[pb.Successors] = collections.deque(maxlen=_HELD_SUCCESSORS)
        self.session_id = ""  # the last session opened on the draft
        self.fork_from = ""  # a draft session whose context cache a new session copies (DraftOpen.fork_from)

    @property
    def up(self) -> bool:
        return self._stream is not None

    @property
    def busy(self) -> bool:
        return self._tail is not None and not self._tail.reply.done()

    @property
    def cold(self) -> bool:
        """The next request is the session's first since its open: its reply waits for the draft's read."""
        return self._cold

    def since_open_s(self) -> float:
        """How long ago the draft session opened (and began reading the context)."""
        return asyncio.get_running_loop().time() - self._opened_at

    def take_costs(self) -> list[DraftReplyCost]:
        """What the replies that came since the last call cost, in the order they came."""
        costs, self._costs = self._costs, []
        return costs

    async def open(self, committed: Sequence[int]) -> bool:
        message = self._open_msg(_new_id(), committed)
        message.fork_from = self.fork_from
        try:
            stream = await self._open_somewhere(message, pb.DraftRequest, "draft", DraftStream,
                                                self._policy.draft_timeout_s)
        except (PeerError, asyncio.TimeoutError) as exc:
            self._mark_down(exc)
            return False
        self._stream, self._synced, self._down_since, self._cold = stream, len(committed), None, True
        self.session_id = message.session_id
        self._opened_at = asyncio.get_running_loop().time()  # the draft starts reading the context now
        return True

    def add_features(self, features: pb.HiddenFeatures) -> None:
        """Hold the target's features of committed positions until the next proposal carries them."""
        self._features = join_features(self._features, features)

    def add_successors(self, successors: pb.Successors) -> None:
        """Hold the target's successors of verified positions until the next proposal carries them."""
        self._successors.append(successors)

    def send(
        self, committed: Sequence[int], assumed: Sequence[int], k: int, free_k: int = 0, max_branches: int = 1,
        wait_s: float = 0.0,
    ) -> DraftCall | None:
        """Ask for up to k tokens (a free drafter: up to free_k; a token tree of up to ``max_branches``
        continuations when > 1) continuing ``committed`` + ``assumed`` (tokens not committed yet: a block in
        verification, drafted past as if its outcome were ``assumed``), waited for ``wait_s`` once the request
        before it is answered. None when the draft cannot take a request now (down, or a late reply still due):
        this round goes on without it."""
        loop = asyncio.get_running_loop()
        now, before = loop.time(), self._tail if self.busy else None
        if before is not None and self._stream is not None and now > before.sent + self._policy.draft_timeout_s:
            self._drop(self._stream, asyncio.TimeoutError(f"no draft reply in {self._policy.draft_timeout_s:g} s"))
        if self._stream is None:
            self._reattach_later(committed)
            self.fallback_rounds += 1
            return None
        if before is not None and now > before.deadline:
            self.busy_rounds += 1
            return None
        cold, self._cold = self._cold, False
        position = len(committed) + len(assumed)  # where the block starts; the draft read all before it at the open
        features, self._features = self._features, None  # a new session starts from whichever features come next
        successors = list(self._successors)
        self._successors.clear()
        stream, start = self._stream, time.perf_counter()
        asked = stream.propose(
            self._synced, [*committed[self._synced :], *assumed], k, free_k, max_branches, features, successors
        )
        # The draft will hold the committed tokens once it has answered; a failure drops the session with the
        # stream, and a re-attach opens a new one from what is committed then.
        self._synced = len(committed)
        reply = loop.create_future()
        self._pending.add(reply)
        reply.add_done_callback(self._pending.discard)
        read = position if cold else None
        call = DraftCall(reply, max(now, before.deadline if before else now) + wait_s, position, now)
        asked.add_done_callback(functools.partial(self._replied, call=call, before=before, stream=stream, start=start,
                                                  read=read))
        self._tail = call
        return self._tail

    async def receive(self, call: DraftCall) -> DraftedBlock | None:
        """The call's block if it comes by its deadline and starts where it must; else None (late, failed, stale)."""
        if not call.reply.done():  # (a reply already in is taken without a pass of the event loop)
            remaining = call.deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait({call.reply}, timeout=max(remaining, 0.0))
            if not done:
                self.late_blocks += 1
                return None
        block = call.reply.result()
        if block is None or block.position != call.position:
            return None
        return block

    def _track(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _replied(self, answer: asyncio.Future, call: DraftCall, before: DraftCall | None, stream, start: float,
                 read: int | None) -> None:
        """A proposal's answer came (or failed): its block and what it cost, into the call's reply. ``before``: the
        request sent before it, where that was still on its way; ``read``: the session's first since its open,
        after this many tokens (the draft read them first)."""
        reply = call.reply
        if reply.done():
            return  # the link closed meanwhile
        if answer.cancelled() or answer.exception() is not None:
            if stream is self._stream:
                self._drop(stream, answer.exception() if not answer.cancelled() else PeerError(
                    "draft", grpc.StatusCode.CANCELLED, "the proposal was cancelled"))
            reply.set_result(None)
            return
        try:
            block = drafted_of(answer.result())
        except Exception as exc:  # noqa: BLE001 - a malformed reply: the round that takes it raises
            reply.set_exception(exc)
            return
        # The draft serves a session's requests in order: one sent behind another waited there for that one's
        # answer, so its wall time is no sample of the link's round trip (the stats count it from that answer).
        call.answered = time.perf_counter()
        since = start if before is None else max(start, before.answered)
        compute_s, wall_s = block.compute_s, call.answered - since
        self.compute_s += compute_s
        self.wall_s += wall_s
        self.service_s += block.service_s
        cost = None
        if read is not None:  # the draft read the context first: the time that took (a service without the read: all)
            cost = (read, block.read_s or compute_s)
        else:
            self.warm_s += compute_s
            self.warm_tokens += len(block.tokens)
        self._costs.append(DraftReplyCost(block, None if before is not None else wall_s, cost))
        reply.set_result(block)

    def _drop(self, stream, exc: BaseException) -> None:
        """The draft failed or stalled on ``stream``: drop it; the next request re-attaches (``_reattach_later``)."""
        self._stream = None
        stream.abort()
        self._mark_down(exc)

    def _reattach_later(self, committed: Sequence[int]) -> None:
        """Re-open the session in the background, at most once per ``draft_retry_s``."""
        if self.busy:
            return
        if self._down_since is not None and time.monotonic() - self._down_since < self._policy.draft_retry_s:
            return
        task = self._track(self._reattach(list(committed)))
        now = asyncio.get_running_loop().time()
        self._tail = DraftCall(task, now + self._policy.draft_timeout_s, -1, now)

    async def _reattach(self, committed: list[int]) -> None:
        if await self.open(committed):
            self.reattached += 1
            log.info("draft re-attached at position %d", len(committed))

    def _mark_down(self, exc: BaseException) -> None:
        if self._down_since is None:
            log.warning("draft unavailable (%s); continuing with target-only decoding", exc)
        self._down_since = time.monotonic()

    async def close(self) -> None:
        """End the session; requests still on their way are cancelled and the stream dropped."""
        if self._pending:
            pending = list(self._pending)
            for waiting in pending:
                waiting.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if self._stream is not None:
                stream, self._stream = self._stream, None
                stream.abort()
        await super().close()


class _NoDraft:
    """The draft link of a session without a draft: it is never up, takes no request and counts nothing."""

    up = cold = False
    session_id = fork_from = ""
    fallback_rounds = busy_rounds = late_blocks = reattached = warm_tokens = 0
    compute_s = warm_s = wall_s = service_s = 0.0

    def send(self, *args, **kwargs) -> None:
        return None

    def since_open_s(self) -> float:
        return 0.0

    def take_costs(self) -> list:
        return []

    def add_features(self, features: pb.HiddenFeatures) -> None:
        pass

    def add_successors(self, successors: pb.Successors) -> None:
        pass

    async def close(self) -> None:
        pass


NO_DRAFT = _NoDraft()
