"""gRPC servicer of the target: protos in, engine calls on the compute thread, protos out."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc

from specsplit.lmkit import errors, wire_version
from specsplit.lmkit.auth import current_caller
from specsplit.lmkit.grpc_server import ComputeThread, EngineServicer, abort_on_error
from specsplit.lmkit.message_limits import target_request_bytes
from specsplit.lmkit.session_mux import SessionMux
from specsplit.lmkit.wire import (
    features_to_proto,
    mask_from_proto,
    mode_from_proto,
    probs_from_proto,
    sampling_from_proto,
    successors_to_proto,
)
from specsplit.target_service.engine import TargetEngine, VerifyItem
from specsplit.target_service.scheduler import VerifyScheduler
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc


class TargetServicer(EngineServicer, pb_grpc.TargetServiceServicer):
    service_label = "target"

    def __init__(self, compute: ComputeThread, tp_degree: int = 1, device: str = "cpu", max_batch: int = 32) -> None:
        super().__init__(compute)
        self.tp_degree = tp_degree
        self.device = device
        self.max_batch = max_batch
        self.scheduler: VerifyScheduler | None = None
        self._max_request_bytes = 0

    def attach(self, engine: TargetEngine) -> None:
        self.scheduler = VerifyScheduler(self.compute, engine, self.max_batch)
        self._max_request_bytes = target_request_bytes(engine.max_context, engine.limits.max_block, engine.vocab_size)
        super().attach(engine)

    def max_request_bytes(self) -> int:
        return self._max_request_bytes

    def session_state(self, session) -> pb.SessionState:
        return pb.SessionState(
            session_id=session.session_id, position=len(session.tokens), cached_tokens=len(session.cache)
        )

    async def Info(self, request, context):
        e: TargetEngine = await self._require_engine(context)
        return pb.ModelInfo(
            model_id=e.model_id,
            vocab_size=e.vocab_size,
            vocab_fingerprint=e.vocab_fingerprint,
            max_context=min(e.max_context, 2**32 - 1),
            max_block=e.limits.max_block,
            tp_degree=self.tp_degree,
            device=self.device,
            forward=e.forward_kind,
            hidden_size=e.hidden_size,
            num_layers=e.num_layers,
            token_trees=e.verifies_trees,
            max_request_bytes=self._max_request_bytes,
            wire_version=wire_version.WIRE_VERSION,
            min_wire_version=wire_version.OLDEST_ORCHESTRATOR,
            sampling_defaults=pb.SamplingDefaults(**e.sampling_defaults),
        )

    async def Stats(self, request, context):
        stats = await super().Stats(request, context)
        engine: TargetEngine = await self._require_engine(context)
        stats.fed_tokens, stats.shared_tokens = engine.fed_tokens, engine.shared_tokens
        return stats

    async def Session(self, request_iterator, context):
        engine: TargetEngine = await self._require_engine(context)
        session = None
        try:
            async for request in self.session_requests(context):
                kind = request.WhichOneof("kind")
                if session is None:
                    if kind != "open":
                        await context.abort(
                            grpc.StatusCode.FAILED_PRECONDITION, "the first message of a session must be `open`"
                        )
                    session = await abort_on_error(context, self._open(engine, request.open))
                    yield pb.TargetResponse(opened=self.session_state(session))
                elif kind == "verify":
                    result = await abort_on_error(context, self._verify(engine, session, request.verify))
                    yield pb.TargetResponse(result=result)
                else:
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"session {session.session_id!r} is already open; send `verify` messages",
                    )
        finally:
            if session is not None:
                engine.close(session.session_id)

    async def Sessions(self, request_iterator, context):
        engine: TargetEngine = await self._require_engine(context)
        await SessionMux(context, _TargetCalls(self, engine), self.session_ttl_s).run()

    async def _open(self, engine: TargetEngine, msg: pb.TargetOpen):
        self.check_open()
        sampling = sampling_from_proto(msg.sampling)
        mode = mode_from_proto(msg.mode)
        top_logprobs = msg.top_logprobs if msg.return_logprobs else None
        return await self.compute.run(
            engine.open, msg.session_id, list(msg.tokens), sampling, mode, top_logprobs, list(msg.feature_layers),
            current_caller(), msg.reserve_tokens, msg.fork_from, msg.successors_k,
            msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        )

    async def _verify(self, engine: TargetEngine, session, msg: pb.VerifyRequest) -> pb.VerifyResult:
        received = time.perf_counter()
        item = VerifyItem(session, msg.position, list(msg.draft_tokens), None, list(msg.parents) or None)
        prepare = None
        if msg.HasField("draft_probs") or msg.HasField("allowed"):  # decoded on the compute thread, with the forward
            def prepare(item: VerifyItem) -> VerifyItem:
                probs = probs_from_proto(msg.draft_probs, engine.vocab_size) if msg.HasField("draft_probs") else None
                allowed = mask_from_proto(msg.allowed, engine.vocab_size) if msg.HasField("allowed") else None
                return replace(item, draft_probs=probs, allowed=allowed)
        done = await self.scheduler.verify(item, prepare)
        base_s, per_token_s = engine.cost_fit() or (0.0, 0.0)
        result = pb.VerifyResult(
            position=msg.position,
            accepted=done.accepted,
            next_token=done.next_token,
            path=done.path,
            timing=pb.ServiceTiming(
                compute_us=int(done.compute_s * 1e6),
                service_us=int((time.perf_counter() - received) * 1e6),
                forward_us=int(done.forward_s * 1e6),
            ),
            logprobs=_logprobs_to_proto(done.logprobs),
            prompt_logprobs=_logprobs_to_proto(done.prompt_logprobs),
            forward=pb.ForwardReport(
                batch_size=done.batch.size,
                batch_width=done.batch.width,
                batch_tokens=done.batch.tokens,
                batch_packed=done.batch.packed,
                others_committed=done.batch.others_committed,
                cost_base_us=base_s * 1e6,
                cost_per_token_us=per_token_s * 1e6,
            ),
        )
        if done.features is not None:
            result.features.CopyFrom(features_to_proto(done.features))
        if done.successors is not None:
            result.successors.CopyFrom(successors_to_proto(done.successors))
        return result


def _logprobs_to_proto(logprobs) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]) for lp in logprobs]


class _TargetCalls:
    """The target's calls on a ``Sessions`` stream: the same open and verify as a session's own stream."""

    def __init__(self, servicer: TargetServicer, engine: TargetEngine) -> None:
        self._servicer = servicer
        self._engine = engine

    async def open(self, session_id: str, msg: pb.TargetOpen):
        opened = pb.TargetOpen()
        opened.CopyFrom(msg)
        opened.session_id = session_id
        session = await self._servicer._open(self._engine, opened)
        return session, self._servicer.session_state(session)

    async def serve(self, session, kind: str, msg):
        if kind != "verify":
            raise errors.FailedPrecondition(f"session {session.session_id!r} is open; send `verify` calls")
        return "result", await self._servicer._verify(self._engine, session, msg)

    @staticmethod
    def serve_at_once(session, kind: str, msg) -> None:
        return None  # a verify waits for its batch's forward

    def close(self, session) -> pb.SessionState:
        state = self._servicer.session_state(session)
        self._engine.close(session.session_id)
        return state

    @staticmethod
    def reply(session_id: str, kind: str, message) -> pb.TargetReply:
        return pb.TargetReply(session_id=session_id, **{kind: message})

    @staticmethod
    def replies(replies: list) -> pb.TargetReplies:
        return pb.TargetReplies(replies=replies)
