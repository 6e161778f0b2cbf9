"""gRPC servicer of the draft: protos in, engine calls on the compute thread, protos out."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from specsplit.draft_service.engine import DraftEngine
from specsplit.draft_service.ngram import NgramConfig
from specsplit.lmkit import errors, wire_version
from specsplit.lmkit.auth import current_caller
from specsplit.lmkit.grpc_server import ComputeThread, EngineServicer, abort_on_error
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.message_limits import draft_request_bytes
from specsplit.lmkit.session_mux import SessionMux
from specsplit.lmkit.wire import (
    features_from_proto,
    mode_from_proto,
    probs_to_proto,
    sampling_from_proto,
    successors_from_proto,
)
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def _log_failed_prepare(prepared: asyncio.Future) -> None:
    error = None if prepared.cancelled() else prepared.exception()
    if error is not None and not isinstance(error, errors.NotFound):  # NotFound: the session closed meanwhile
        log.warning("reading a session's context ahead of its first proposal failed: %s", error)


def drafter_from_proto(value: int, served: list[DrafterKind]) -> DrafterKind:
    try:
        return DrafterKind(value)
    except ValueError:
        names = ", ".join(f"{k.name} ({k.value})" for k in served)
        raise errors.InvalidArgument(f"drafter {value} is not a drafter kind; this service runs {names}") from None


def ngram_from_proto(msg: pb.DraftOpen, default: NgramConfig) -> NgramConfig:
    try:
        return NgramConfig(min_n=msg.ngram_min or default.min_n, max_n=msg.ngram_max or default.max_n)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


class DraftServicer(EngineServicer, pb_grpc.DraftServiceServicer):
    service_label = "draft"

    def __init__(self, compute: ComputeThread, ngram_default: NgramConfig, device: str = "cpu") -> None:
        super().__init__(compute)
        self.ngram_default = ngram_default
        self.device = device
        self._max_request_bytes = 0

    def attach(self, engine: DraftEngine) -> None:
        widths = [t.feature_width for t in engine.traits]
        self._max_request_bytes = draft_request_bytes(engine.max_context, engine.limits.max_block, max(widths, default=0))
        super().attach(engine)

    def max_request_bytes(self) -> int:
        return self._max_request_bytes

    def session_state(self, session) -> pb.SessionState:
        cached = getattr(session.drafter, "cached_tokens", 0)
        return pb.SessionState(session_id=session.session_id, position=session.drafter.position, cached_tokens=cached)

    async def Info(self, request, context):
        e = await self._require_engine(context)
        return pb.ModelInfo(
            model_id=e.model_id,
            vocab_size=e.vocab_size or 0,
            vocab_fingerprint=e.vocab_fingerprint,
            max_context=e.max_context,
            max_block=e.limits.max_block,
            drafters=[k.value for k in e.drafters],
            drafter_info=[
                pb.DrafterInfo(
                    kind=t.kind.value, name=t.kind.name, forward=e.forward_kinds.get(t.kind, ""),
                    has_probs=t.has_probs, needs_model=t.needs_model,
                    free=t.free, needs_features=t.needs_features, feature_layers=list(t.feature_layers),
                    feature_width=t.feature_width, successors_k=t.successors_k,
                )
                for t in e.traits
            ],
            tp_degree=1,
            device=self.device,
            token_trees=True,
            max_request_bytes=self._max_request_bytes,
            wire_version=wire_version.WIRE_VERSION,
            min_wire_version=wire_version.OLDEST_ORCHESTRATOR,
        )

    async def Stats(self, request, context):
        stats = await super().Stats(request, context)
        stats.shared_tokens = (await self._require_engine(context)).shared_tokens
        return stats

    async def Session(self, request_iterator, context):
        engine = await self._require_engine(context)
        session = None
        prepared = None  # the session's context read ahead of its first proposal, on the compute thread
        try:
            async for request in self.session_requests(context):
                kind = request.WhichOneof("kind")
                if session is None:
                    if kind != "open":
                        await context.abort(
                            grpc.StatusCode.FAILED_PRECONDITION, "the first message of a session must be `open`"
                        )
                    session = await abort_on_error(context, self._open(engine, request.open))
                    prepared = self._prepare(engine, session)
                    yield pb.DraftResponse(opened=self.session_state(session))
                elif kind == "propose":
                    block = await abort_on_error(context, self._propose(engine, session, request.propose, prepared))
                    prepared = None
                    yield pb.DraftResponse(block=block)
                else:
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"session {session.session_id!r} is already open; send `propose` messages",
                    )
        finally:
            if session is not None:
                engine.close(session.session_id)

    async def Sessions(self, request_iterator, context):
        engine = await self._require_engine(context)
        await SessionMux(context, _DraftCalls(self, engine), self.session_ttl_s).run()

    async def _open(self, engine: DraftEngine, msg: pb.DraftOpen):
        self.check_open()
        sampling = sampling_from_proto(msg.sampling)
        kind = drafter_from_proto(msg.drafter, engine.drafters)
        ngram = ngram_from_proto(msg, self.ngram_default)
        chain = [drafter_from_proto(value, engine.drafters) for value in msg.chain]
        coupled = msg.mode != pb.VERIFICATION_MODE_UNSPECIFIED and mode_from_proto(msg.mode) is VerificationMode.COUPLED
        return await self._run(
            engine.free(kind, chain), engine.open, msg.session_id, list(msg.tokens), sampling, kind, msg.return_probs,
            ngram, chain, coupled, msg.feature_width, current_caller(), msg.fork_from, msg.reserve_tokens,
        )

    async def _run(self, free: bool, fn, *args):
        """``fn(*args)``: at once for a free drafter's session, else on the compute thread."""
        return fn(*args) if free else await self.compute.run(fn, *args)

    def _prepare(self, engine: DraftEngine, session) -> asyncio.Future | None:
        """Read the new session's context on the compute thread while the orchestrator's first round runs
        elsewhere (the target's prefill, or target-only steps): the first proposal then drafts from a warm
        cache. A failure here only leaves the first proposal to read the context itself. A free drafter keeps
        no cache: nothing to read."""
        if session.free:
            return None
        prepared = asyncio.ensure_future(self._read(engine, session))
        prepared.add_done_callback(_log_failed_prepare)
        return prepared

    async def _read(self, engine: DraftEngine, session) -> float:
        """The session's context read a chunk a call (``DraftEngine.prepare``): other sessions' proposals queue on
        the compute thread between its chunks. Returns the compute seconds of every chunk."""
        spent, done = 0.0, False
        while not done:
            seconds, done = await self.compute.run(engine.prepare, session)
            spent += seconds
        return spent

    async def _propose(self, engine: DraftEngine, session, msg: pb.ProposeRequest,
                       prepared: asyncio.Future | None = None) -> pb.DraftBlock:
        received = time.perf_counter()
        read_s = 0.0  # the session's context read at the open (its first proposal's block reports it)
        if prepared is not None:
            if not prepared.done():
                await asyncio.wait({prepared})  # the compute thread runs it first in any case
            read_s = 0.0 if prepared.cancelled() or prepared.exception() else prepared.result()
        # spent on this session's context: compute, as the block's own (other sessions' between its chunks are not)
        waited = min(time.perf_counter() - received, read_s)
        proposed = await self._run(session.free, self._proposal, engine, session, msg)
        return self._block(msg, *proposed, received, waited, read_s)

    def propose_at_once(self, engine: DraftEngine, session, msg: pb.ProposeRequest) -> pb.DraftBlock:
        """A free drafter's proposal (no context read pending), made in the event loop as ``_propose`` would."""
        received = time.perf_counter()
        return self._block(msg, *self._proposal(engine, session, msg), received, 0.0, 0.0)

    @staticmethod
    def _proposal(engine: DraftEngine, session, msg: pb.ProposeRequest):
        """The engine's proposal and the encoding of its distributions (on the compute thread unless free)."""
        features = None
        if msg.HasField("features"):
            features = features_from_proto(msg.features, session.feature_width or msg.features.width)
        successors = [successors_from_proto(s) for s in msg.successors]
        done = engine.propose(
            session, msg.position, list(msg.tokens), msg.k, msg.free_k, msg.max_branches, features, successors
        )
        return done, probs_to_proto(done.proposal.probs) if done.proposal.probs is not None else None

    @staticmethod
    def _block(msg: pb.ProposeRequest, done, probs, received: float, waited: float, read_s: float) -> pb.DraftBlock:
        block = pb.DraftBlock(
            position=msg.position + len(msg.tokens),
            tokens=done.proposal.tokens,
            parents=done.proposal.parents or [],
            drafter=done.proposal.drafter.value if done.proposal.drafter is not None else 0,
        )
        if done.proposal.quality is not None:
            block.quality.CopyFrom(pb.MatchQuality(
                length=done.proposal.quality.length, occurrences=done.proposal.quality.occurrences))
        if probs is not None:
            block.probs.CopyFrom(probs)
        if done.proposal.second_guess is not None:
            block.second_guess.index, block.second_guess.token = done.proposal.second_guess
        block.timing.compute_us = int((done.compute_s + waited) * 1e6)
        block.timing.read_us = int(read_s * 1e6)
        block.timing.service_us = int((time.perf_counter() - received) * 1e6)
        return block


class _DraftSlot:
    """A draft session on a ``Sessions`` stream, and its context read still running (until its first propose)."""

    def __init__(self, session, prepared: asyncio.Future | None) -> None:
        self.session = session
        self.prepared = prepared


class _DraftCalls:
    """The draft's calls on a ``Sessions`` stream: the same open and propose as a session's own stream."""

    def __init__(self, servicer: DraftServicer, engine: DraftEngine) -> None:
        self._servicer = servicer
        self._engine = engine

    async def open(self, session_id: str, msg: pb.DraftOpen):
        opened = pb.DraftOpen()
        opened.CopyFrom(msg)
        opened.session_id = session_id
        session = await self._servicer._open(self._engine, opened)
        return _DraftSlot(session, self._servicer._prepare(self._engine, session)), self._servicer.session_state(session)

    async def serve(self, slot: _DraftSlot, kind: str, msg):
        if kind != "propose":
            raise errors.FailedPrecondition(f"session {slot.session.session_id!r} is open; send `propose` calls")
        prepared, slot.prepared = slot.prepared, None
        return "block", await self._servicer._propose(self._engine, slot.session, msg, prepared)

    def serve_at_once(self, slot: _DraftSlot, kind: str, msg):
        if kind != "propose" or not slot.session.free:  # a free session has no context read (``_prepare``)
            return None  # a model's proposal runs on the compute thread; a bad call's error comes from ``serve``
        return "block", self._servicer.propose_at_once(self._engine, slot.session, msg)

    def close(self, slot: _DraftSlot) -> pb.SessionState:
        state = self._servicer.session_state(slot.session)
        self._engine.close(slot.session.session_id)
        return state

    @staticmethod
    def reply(session_id: str, kind: str, message) -> pb.DraftReply:
        return pb.DraftReply(session_id=session_id, **{kind: message})

    @staticmethod
    def replies(replies: list) -> pb.DraftReplies:
        return pb.DraftReplies(replies=replies)
