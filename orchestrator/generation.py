"""The orchestrator: owns sessions, tokenizes once, drives the speculative loop, streams text.

Only the orchestrator sees text. It connects to one target and optionally one
draft service, refuses a pair whose vocabularies differ, and turns each
request into a session on both services that lives exactly as long as the
generation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from lmkit import errors, models
from lmkit.kinds import DrafterKind, DrafterTraits, VerificationMode, default_chain
from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.sampling import SamplingParams
from lmkit.wire import sampling_to_proto
from orchestrator import metrics
from orchestrator.adaptive_k import AdaptiveK, CostModel
from orchestrator.config import OrchestratorConfig
from orchestrator.detok import IncrementalDetokenizer, StopMatcher
from orchestrator.links import DraftLink, TargetLink
from orchestrator.loop import Finish, LoopConfig, LoopStats, speculative_decode
from orchestrator.peers import ServiceClient, draft_client, target_client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request (see ``orchestrator.requests``)."""

    prompt: str
    chat: bool
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    k: int
    drafter: DrafterKind
    draft_probs: bool
    adaptive_k: bool = False  # k is then the per-round upper bound
    chain: tuple[DrafterKind, ...] = ()  # CHAIN members in order; empty = default_chain of what the draft serves
    overlap: bool = False  # draft block i+1 while the target verifies block i


@dataclass(frozen=True)
class GenerationEvent:
    text: str
    token_ids: list[int]
    finish: Finish | None = None
    stats: pb.GenerationStats | None = None
    loop: LoopStats | None = None  # per-round figures, on the last event (benchmarks read them)


def verification_mode(request: GenerationRequest) -> VerificationMode:
    if request.sampling.greedy:
        return VerificationMode.GREEDY
    return VerificationMode.DRAFT_PROBS if request.draft_probs else VerificationMode.TOKEN_ONLY


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tokenizer, target: ServiceClient, draft: ServiceClient | None):
        self.config = config
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.eos_ids = frozenset(eos_ids(config.tokenizer, tokenizer))
        # The drafters the draft serves and what each can do, as it reports them.
        self.drafter_traits: dict[DrafterKind, DrafterTraits] = {
            t.kind: t for t in (drafter_traits(draft.info) if draft is not None else ())
        }
        self.costs = CostModel()  # one target: its measured costs serve every session

    @classmethod
    async def connect(cls, config: OrchestratorConfig) -> "Orchestrator":
        """Connect to the services, check that they share a vocabulary, load the tokenizer."""
        tokenizer = models.load_tokenizer(config.tokenizer)
        target = target_client(config.target_address, config.peer_tls)
        draft = draft_client(config.draft_address, config.peer_tls) if config.draft_address else None
        target_info = await target.fetch_info(config.connect_timeout_s)
        check_pair(
            "tokenizer", config.tokenizer, models.vocab_fingerprint(tokenizer), "target", target_info
        )
        if draft is not None:
            draft_info = await draft.fetch_info(config.connect_timeout_s)
            if draft_info.vocab_fingerprint:  # model-free drafters accept any vocabulary
                check_pair("target", target_info.model_id, target_info.vocab_fingerprint, "draft", draft_info)
                if draft_info.vocab_size != target_info.vocab_size:
                    raise ValueError(
                        f"draft {draft_info.model_id} has {draft_info.vocab_size} output rows but target "
                        f"{target_info.model_id} has {target_info.vocab_size}; they must match"
                    )
        log.info(
            "target %s (tp=%d, %s) at %s; draft %s",
            target_info.model_id,
            target_info.tp_degree,
            target_info.device,
            config.target_address,
            f"{draft.info.model_id} at {config.draft_address}" if draft else "none (target-only)",
        )
        return cls(config, tokenizer, target, draft)

    async def close(self) -> None:
        await self.target.close()
        if self.draft is not None:
            await self.draft.close()

    @property
    def max_block(self) -> int:
        limits = [self.target.info.max_block]
        if self.draft is not None:
            limits.append(self.draft.info.max_block)
        return min(limits)

    @property
    def drafters(self) -> list[DrafterKind]:
        return list(self.drafter_traits)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(prompt))

    async def generate(self, request: GenerationRequest, prompt_ids: list[int]) -> AsyncIterator[GenerationEvent]:
        """Stream committed text; the last event carries the finish reason and stats."""
        start = time.perf_counter()
        stats = LoopStats()
        mode = verification_mode(request)
        sampling = sampling_to_proto(request.sampling)
        policy = self.config.link_policy
        speculating = request.k > 0 and self.draft is not None
        # A feature drafter (EAGLE) reads the target's hidden states of these layers, sent with each result.
        layers = self.feature_traits(request).feature_layers if speculating else ()
        target = TargetLink(
            self.target,
            lambda sid, tokens: pb.TargetOpen(
                session_id=sid, tokens=tokens, sampling=sampling, mode=mode.value, feature_layers=layers
            ),
            policy,
        )
        draft = None
        if speculating:
            draft = DraftLink(self.draft, lambda sid, tokens: self._draft_open(sid, tokens, request), policy)
        try:
            if draft is not None:
                await draft.open(prompt_ids)  # a draft that is down only means no speculation for now
            async for event in self._stream(request, prompt_ids, target, draft, stats):
                if event.finish is not None:
                    event = replace(
                        event, stats=self._stats(request, mode, prompt_ids, stats, start, target, draft), loop=stats
                    )
                    metrics.record_generation(stats, draft.fallback_rounds if draft else 0, target.reopens)
                yield event
        finally:
            await target.close()
            if draft is not None:
                await draft.close()

    async def _stream(self, request, prompt_ids, target, draft, stats) -> AsyncIterator[GenerationEvent]:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stops = StopMatcher(request.stop)
        config = LoopConfig(
            k=request.k if draft is not None else 0,
            max_new_tokens=request.max_new_tokens,
            eos_ids=self.eos_ids,
            max_context=self.target.info.max_context or 1 << 30,
            overlap=request.overlap and draft is not None,
            ahead_max=min(request.k, self.draft.info.max_block - 1) if draft is not None else 0,
        )
        controller = AdaptiveK(config.k, self.costs) if request.adaptive_k and config.k > 0 else None
        async for new, finish in speculative_decode(prompt_ids, config, target, draft, stats, controller, self.costs):
            text, stopped = stops.feed(detok.add(new))
            if stopped:
                finish = Finish.STOP_STRING
            elif finish is not None:
                tail, stopped = stops.feed(detok.flush())
                text += tail if stopped else tail + stops.flush()
                finish = Finish.STOP_STRING if stopped else finish
            yield GenerationEvent(text, new, finish)
            if finish is not None:
                return

    def _draft_open(self, session_id: str, prompt_ids: list[int], request: GenerationRequest) -> pb.DraftOpen:
        return pb.DraftOpen(
            session_id=session_id,
            tokens=prompt_ids,
            sampling=sampling_to_proto(request.sampling),
            drafter=request.drafter.value,
            return_probs=request.draft_probs and not request.sampling.greedy,
            ngram_min=self.config.ngram_min,
            ngram_max=self.config.ngram_max,
            chain=[kind.value for kind in self._chain(request)],
            feature_width=len(self.feature_traits(request).feature_layers) * self.target.info.hidden_size,
        )

    def feature_traits(self, request: GenerationRequest) -> DrafterTraits:
        """The traits of the request's feature drafter (alone or in its chain); empty traits when it has none."""
        for kind in (request.drafter, *self._chain(request)):
            traits = self.drafter_traits.get(kind)
            if traits is not None and traits.needs_features:
                return traits
        return DrafterTraits(request.drafter)

    def check_features(self, request: GenerationRequest) -> None:
        """Refuse a feature drafter whose head does not fit the target's hidden states."""
        traits = self.feature_traits(request)
        if not traits.needs_features:
            return
        info = self.target.info
        sends = len(traits.feature_layers) * info.hidden_size
        out_of_range = [layer for layer in traits.feature_layers if layer > info.num_layers]
        if out_of_range or sends != traits.feature_width:
            raise errors.FailedPrecondition(
                f"drafter {traits.kind.name}'s head reads {traits.feature_width} feature values per position from "
                f"target layers {list(traits.feature_layers)}, but target {info.model_id} has {info.num_layers} "
                f"layers of hidden size {info.hidden_size} (it would send {sends}): the head was trained for another "
                "target; start serve-draft with a head for this one"
            )

    def _chain(self, request: GenerationRequest) -> tuple[DrafterKind, ...]:
        if request.drafter is not DrafterKind.CHAIN:
            return ()
        return request.chain or default_chain(self.drafters)

    @staticmethod
    def _stats(request, mode, prompt_ids, stats: LoopStats, start: float, target, draft) -> pb.GenerationStats:
        wall = time.perf_counter() - start
        return pb.GenerationStats(
            prompt_tokens=len(prompt_ids),
            new_tokens=stats.committed,
            rounds=stats.rounds,
            drafted_tokens=stats.drafted,
            accepted_tokens=stats.accepted,
            acceptance_rate=stats.acceptance_rate,
            mean_accepted_length=stats.mean_accepted_length,
            tokens_per_s=stats.committed / wall if wall > 0 else 0.0,
            wall_s=wall,
            k=request.k,
            drafter=request.drafter.value,
            mode=mode.value,
            seed=request.sampling.seed,
            draft_compute_s=stats.draft_compute_s,
            target_compute_s=stats.target_compute_s,
            adaptive_k=request.adaptive_k,
            mean_k=stats.mean_k,
            draft_fallback_rounds=draft.fallback_rounds if draft else 0,
            draft_reattached=draft.reattached if draft else 0,
            target_reopens=target.reopens,
            overlap=request.overlap,
            overlap_hits=stats.overlap_hits,
            mean_batch_size=stats.mean_batch_size,
            feature_bytes=stats.feature_bytes,
            feature_bytes_per_round=stats.feature_bytes / stats.rounds if stats.rounds else 0.0,
        )


def drafter_traits(info: pb.ModelInfo) -> list[DrafterTraits]:
    """A draft service's drafters, registering the kinds it defines beyond the built-in ones."""
    return [
        DrafterTraits(
            DrafterKind(d.kind, d.name), d.has_probs, d.needs_model, d.needs_features, tuple(d.feature_layers),
            d.feature_width,
        )
        for d in info.drafter_info
    ]


def check_pair(a_name: str, a_model: str, a_fingerprint: str, b_name: str, b_info: pb.ModelInfo) -> None:
    """Refuse two components whose vocabularies differ, naming both."""
    if a_fingerprint != b_info.vocab_fingerprint:
        raise ValueError(
            f"vocabulary mismatch: {a_name} {a_model} (fingerprint {a_fingerprint[:12]}) and {b_name} "
            f"{b_info.model_id} (fingerprint {b_info.vocab_fingerprint[:12] or 'none'}) do not share a tokenizer; "
            "pair models that use the same vocabulary"
        )


def eos_ids(model_ref: str, tokenizer) -> set[int]:
    """End-of-sequence ids: the tokenizer's plus the generation config's (often a list)."""
    from transformers import GenerationConfig

    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    try:
        configured = GenerationConfig.from_pretrained(models.resolve(model_ref), local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        configured = None
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    return ids

