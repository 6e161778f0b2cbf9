"""The draft engine: one drafter per session, driven round by round. No grpc here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from specsplit.draft_service import abandon
from specsplit.draft_service.drafter import Drafter, Proposal
from specsplit.draft_service.model_drafter import ModelDrafter
from specsplit.draft_service.ngram import NgramConfig
from specsplit.draft_service.recycling import SuccessorTable
from specsplit.draft_service.registry import DRAFTERS, DraftRequestContext
from specsplit.lmkit import chain_step, errors, forward
from specsplit.lmkit.features import FeatureBlock
from specsplit.lmkit.kinds import DrafterKind, DrafterTraits
from specsplit.lmkit.kvcache import SessionCache, check_cache_layout, kv_bytes_per_token
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import (
    SessionLimits,
    SessionTable,
    check_open,
    check_prefill_chunk,
    check_tokens,
    reservation,
)
from specsplit.lmkit.successors import Successors

MAX_BRANCHES = 64  # continuations per token tree
DEFAULT_SUCCESSOR_TABLE_TOKENS = 65536  # tokens a caller's shared successor table holds (about 20 MB at most)


@dataclass
class DraftSession:
    session_id: str
    kind: DrafterKind
    drafter: Drafter
    rounds: int = 0
    feature_width: int = 0  # values per position of the target's features (feature drafters), else 0
    closed: bool = False  # set by DraftEngine.close (event loop); a running proposal then stops (abandon.py)
    free: bool = False  # every drafter of it proposes at ~no cost (``DraftEngine.free``): served on the event loop
    fork_source: "DraftSession | None" = None  # a MODEL session whose context cache it copies (DraftOpen.fork_from)


SELF_DRAFTS = (DrafterKind.LAYERSKIP, DrafterKind.QUANTIZED)  # views of the draft model that draft with a forward


@dataclass(frozen=True)
class TimedProposal:
    proposal: Proposal
    compute_s: float  # the drafter's time on it


class DraftEngine:
    """Holds an optional draft model and the live sessions."""

    def __init__(
        self,
        model=None,
        *,
        model_id: str = "",
        vocab_fingerprint: str = "",
        limits: SessionLimits,
        derived: Mapping[DrafterKind, object] | None = None,
        successor_table_tokens: int = DEFAULT_SUCCESSOR_TABLE_TOKENS,
        prefill_chunk: int = 0,
        forward_mode: str = "off",
        graph_context: int = 1024,
    ) -> None:
        """``successor_table_tokens``: tokens each caller's shared table of the target's successors holds at most
        (token recycling; serve-draft --recycling-table-tokens); 0: no shared table, each session drafts from its
        own reports alone. ``prefill_chunk``: context tokens a new session's read computes at most per call on the
        compute thread (serve-draft --prefill-chunk); 0: the whole context at once. ``forward_mode``: how the models
        that draft run their steps (``lmkit.forward``: serve-draft --compile resolved, or ``stock``); under
        ``cuda-graphs`` the draft model's sessions hold slots of ``graph_context`` positions of the static step
        (captured on CUDA, eager elsewhere), the self-drafts' views run the fast forward."""
        check_prefill_chunk(prefill_chunk)
        derived = dict(derived or {})
        if derived and model is None:
            raise ValueError("self-drafters (--layerskip-layers, --quantize) derive from --model; pass --model")
        unknown = [kind.name for kind in derived if not DRAFTERS[kind].derived]
        if unknown:
            raise ValueError(f"{unknown} are not derived drafters")
        if model is not None:
            check_cache_layout(model)
        self.model = model
        self.derived = derived  # LAYERSKIP / QUANTIZED views of ``model``
        self.model_id = model_id or "(model-free)"
        self.vocab_fingerprint = vocab_fingerprint if model is not None else ""
        self.vocab_size = int(model.config.vocab_size) if model is not None else None
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) if model is not None else 0
        self.limits = limits
        self.sessions: SessionTable[DraftSession] = SessionTable(limits, "draft")
        self.shared_tokens = 0  # context positions sessions copied from another's cache (DraftOpen.fork_from)
        # Per caller: the target's successors every session of that caller reported (RECYCLING). Callers do not
        # share one: a draft's speed would tell one caller about another's text.
        self.successor_tables: dict[str, SuccessorTable] = {}
        self.successor_table_tokens = successor_table_tokens
        self.prefill_chunk = prefill_chunk
        self.prefill_chunks = 0  # calls that read part of a new session's context (not in StatsResponse)
        self.position_bytes = _position_bytes(model, derived)  # KV bytes a position costs, by drafter kind
        # What runs each drafting model's steps (for the log), and the caches its sessions get
        self.forward_kinds: dict[DrafterKind, str] = {}
        self._new_slot: Callable[[], SessionCache] | None = None  # cuda-graphs: a slot of the draft model's step
        for kind, drafting in ((DrafterKind.MODEL, model), *((k, derived.get(k)) for k in SELF_DRAFTS)):
            if drafting is None:
                continue
            # the static step runs the draft model's own layers: a self-draft's view runs the fast forward
            mode = "off" if forward_mode == "cuda-graphs" and kind is not DrafterKind.MODEL else forward_mode
            self.forward_kinds[kind] = forward.install(drafting, mode, alone=True)
            if mode == "cuda-graphs":
                on_cuda = next(drafting.parameters()).device.type == "cuda"
                self._new_slot, context = forward.slots(drafting, limits.max_sessions, graph_context,
                                                        limits.max_block + 1, batch=1, graphs=on_cuda,
                                                        chain=min(limits.max_block, chain_step.MAX_CHAIN))
                self.max_context = min(self.max_context or context, context)
        abandon.watch([model, *derived.values()])  # a closed session's proposal stops at the next layer

    def _new_cache(self, model) -> SessionCache:
        """A session's cache over ``model`` (one of the drafting models): a slot of its static step, or a plain
        cache over the forward it was set up with."""
        return self._new_slot() if self._new_slot is not None and model is self.model else SessionCache(model)

    @property
    def drafters(self) -> list[DrafterKind]:
        return [kind for kind in DRAFTERS if self._available(kind)]

    @property
    def traits(self) -> list[DrafterTraits]:
        """What each served drafter can do, for ``ModelInfo.drafter_info``."""
        return [DRAFTERS[kind].traits(self.derived.get(kind)) for kind in self.drafters]

    def _available(self, kind: DrafterKind) -> bool:
        entry = DRAFTERS.get(kind)
        if entry is None:
            return False
        if entry.derived:
            return kind in self.derived
        return self.model is not None or not entry.needs_model

    def _check_available(self, kind: DrafterKind) -> None:
        if not self._available(kind):
            raise errors.FailedPrecondition(
                f"drafter {kind.name} is not available here (this service runs {[d.name for d in self.drafters]})"
                + (f"; {DRAFTERS[kind].enable_hint}" if kind in DRAFTERS and DRAFTERS[kind].enable_hint else "")
            )

    def _check_chain(self, kind: DrafterKind, chain: Sequence[DrafterKind]) -> None:
        if kind is not DrafterKind.CHAIN:
            if chain:
                raise errors.InvalidArgument(f"chain is only for the CHAIN drafter, but drafter is {kind.name}")
            return
        if not chain:
            raise errors.InvalidArgument("drafter CHAIN needs a chain: the drafters to try in order, e.g. [NGRAM, MODEL]")
        if DrafterKind.CHAIN in chain:
            raise errors.InvalidArgument("a chain cannot contain CHAIN; list the member drafters")
        if len(set(chain)) != len(chain):
            raise errors.InvalidArgument(f"chain {[c.name for c in chain]} repeats a drafter; list each at most once")
        for member in chain:
            self._check_available(member)

    def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        sampling: SamplingParams,
        kind: DrafterKind,
        return_probs: bool,
        ngram: NgramConfig,
        chain: Sequence[DrafterKind] = (),
        coupled: bool = False,  # COUPLED verification: model drafters take the target's Gumbel-max noise
        feature_width: int = 0,
        caller: str = "",  # who opens it (lmkit.auth), for the per-caller quota
        fork_from: str = "",  # a live session of the caller whose context cache to copy (DraftOpen.fork_from)
        reserve_tokens: int = 0,  # positions it may hold (DraftOpen.reserve_tokens); 0: the model's full context
    ) -> DraftSession:
        check_open(session_id, tokens, self.max_context, "draft model")
        check_tokens(tokens, self.vocab_size, "tokens")
        check_tokens(sampling.tokens(), self.vocab_size, "sampling.logit_bias ids and eos_token_ids")
        self._check_available(kind)
        self._check_chain(kind, chain)
        entry = DRAFTERS[kind]
        if return_probs and not entry.has_probs:
            raise errors.InvalidArgument(f"drafter {kind.name} has no draft probabilities; use token-only verification")
        if coupled and (return_probs or sampling.greedy):
            raise errors.InvalidArgument(
                "COUPLED verification samples (temperature > 0) and sends token ids only; unset return_probs"
            )
        width = self._check_features(kind, chain, feature_width)
        reads_successors = any(DRAFTERS[m].successors_k for m in _members(kind, chain))
        table = self._successor_table(caller) if reads_successors else None
        context = DraftRequestContext(
            list(tokens), sampling, return_probs, ngram, self.model, self.derived, tuple(chain), coupled, table,
            self._new_cache,
        )
        session = DraftSession(session_id, kind, entry.build(context), feature_width=width, free=self.free(kind, chain))
        source = self.sessions.find(fork_from, caller) if fork_from else None
        if source is not None and source.kind is kind and isinstance(session.drafter, ModelDrafter):
            session.fork_source = source  # the same kind of model drafter: the same model
        position_bytes = sum(self.position_bytes.get(member, 0) for member in _members(kind, chain))
        return self.sessions.add(session_id, session, caller, reservation(reserve_tokens, self.max_context, len(tokens)),
                                 position_bytes)

    def _successor_table(self, caller: str) -> SuccessorTable | None:
        if not self.successor_table_tokens:
            return None
        table = self.successor_tables.get(caller)
        if table is None:
            table = self.successor_tables[caller] = SuccessorTable(self.successor_table_tokens)
        return table

    @staticmethod
    def free(kind: DrafterKind, chain: Sequence[DrafterKind] = ()) -> bool:
        """Whether every drafter of a session (a chain's members) proposes at ~no cost: such a session's calls are
        served on the event loop, with no hop to the compute thread and no wait behind a model's work there."""
        members = _members(kind, chain)
        return bool(members) and all(DRAFTERS[m].free or DRAFTERS[m].cheap for m in members if m in DRAFTERS)

    def _check_features(self, kind: DrafterKind, chain: Sequence[DrafterKind], sent_width: int) -> int:
        """The features width a feature drafter (alone or in the chain) reads, checked against what the target sends."""
        for member in (kind, *chain):
            traits = DRAFTERS[member].traits(self.derived.get(member))
            if not traits.needs_features:
                continue
            if sent_width == 0:
                raise errors.InvalidArgument(
                    f"drafter {member.name} drafts from the target's hidden features: set DraftOpen.feature_width "
                    f"to the values per position the target sends (layers {list(traits.feature_layers)})"
                )
            if sent_width != traits.feature_width:
                raise errors.FailedPrecondition(
                    f"drafter {member.name}'s head reads {traits.feature_width} feature values per position "
                    f"(target layers {list(traits.feature_layers)}), but the target sends {sent_width}: the head was "
                    "trained for another target; start serve-draft with a head for this one"
                )
            return sent_width
        return 0

    def propose(
        self, session: DraftSession, position: int, tokens: Sequence[int], k: int,
        free_k: int = 0, max_branches: int = 1, features: FeatureBlock | None = None,
        successors: Sequence[Successors] = (),
    ) -> TimedProposal:
        """Take the committed tokens (and a feature drafter's features) from ``position`` on, then draft up to ``k``.

        A free drafter may draft up to ``free_k`` when larger. ``max_branches``
        > 1: up to that many continuations as a token tree (each as deep as a
        chain would be long), at most max_block tokens in all.
        """
        held = session.drafter.position
        if position > held:
            raise errors.FailedPrecondition(
                f"propose at position {position} but session {session.session_id!r} holds {held} tokens; "
                f"resend the committed tokens from position {held}"
            )
        if k > self.limits.max_block:
            raise errors.InvalidArgument(f"k = {k} is larger than this draft's max block {self.limits.max_block}")
        if free_k > self.limits.max_block:
            raise errors.InvalidArgument(
                f"free_k = {free_k} is larger than this draft's max block {self.limits.max_block}")
        if max_branches > MAX_BRANCHES:
            raise errors.InvalidArgument(f"max_branches = {max_branches}; send at most {MAX_BRANCHES}")
        if position + len(tokens) == 0:
            raise errors.InvalidArgument("propose would leave the context empty; send the committed tokens")
        check_tokens(tokens, self.vocab_size, "tokens")
        self._check_context(position + len(tokens), k)
        self._check_features_block(session, position + len(tokens), features)
        start = time.perf_counter()
        with abandon.proposing(lambda: session.closed):
            session.drafter.commit(position, tokens)
            if features is not None:
                session.drafter.add_features(features)
            for reported in successors:
                session.drafter.add_successors(reported)
            if max_branches > 1:
                proposal = session.drafter.propose_tree_within(k, free_k, max_branches, self.limits.max_block)
            else:
                proposal = session.drafter.propose_within(k, free_k)
        session.rounds += 1
        self.sessions.count_round()
        return TimedProposal(proposal, time.perf_counter() - start)

    def _check_context(self, committed: int, k: int) -> None:
        """Refuse a proposal that would run the draft model past its context (model-free drafters have none)."""
        if self.max_context and committed + k > self.max_context:
            room = max(self.max_context - committed, 0)
            raise errors.InvalidArgument(
                f"proposing {k} tokens after {committed} committed ones overflows the draft model's context of "
                f"{self.max_context}; ask for at most {room}"
            )

    def prepare(self, session: DraftSession) -> tuple[float, bool]:
        """Read the session's context ahead of its first proposal (run right after ``open``, on the compute
        thread, again until it is read), or copy it from the session it forks from while that one is open; stops
        at the next layer when the session closes meanwhile. A context longer than ``prefill_chunk`` is read that
        many tokens a call, so other sessions' proposals run between its chunks. Returns the seconds this call took
        and whether the context is read (or the session closed)."""
        start = time.perf_counter()
        source, session.fork_source = session.fork_source, None
        with abandon.proposing(lambda: session.closed):
            if source is not None and not source.closed:
                self.shared_tokens += session.drafter.prepare_from(source.drafter)
                done = True
            else:
                done = session.drafter.prepare(self.prefill_chunk)
                self.prefill_chunks += not done
        return time.perf_counter() - start, done or session.closed

    @staticmethod
    def _check_features_block(session: DraftSession, committed: int, features: FeatureBlock | None) -> None:
        if features is None:
            return
        if not session.feature_width:
            raise errors.InvalidArgument(
                f"features sent to drafter {session.kind.name}, which does not read them; send them only to a "
                "feature drafter (EAGLE)"
            )
        if features.end > committed:
            raise errors.FailedPrecondition(
                f"features of positions [{features.position}, {features.end}) reach past the committed context "
                f"of session {session.session_id!r} ({committed} tokens); send features of committed positions"
            )

    def close(self, session_id: str) -> None:
        session = self.sessions.remove(session_id)
        if session is not None:
            session.closed = True
            session.drafter.close()


def _position_bytes(model, derived: Mapping[DrafterKind, object]) -> dict[DrafterKind, int]:
    """The keys and values one position of a session costs, by the drafter that keeps them: the model's every
    layer (MODEL; QUANTIZED, whose int8 layers keep them in the model's dtype), its first layers (LAYERSKIP),
    the EAGLE head's one layer; model-free drafters and Medusa's heads keep none."""
    if model is None:
        return {}
    whole = kv_bytes_per_token(model)
    costs = {DrafterKind.MODEL: whole}
    if DrafterKind.QUANTIZED in derived:
        costs[DrafterKind.QUANTIZED] = whole
    if DrafterKind.LAYERSKIP in derived:
        layers = int(derived[DrafterKind.LAYERSKIP].config.num_hidden_layers)
        costs[DrafterKind.LAYERSKIP] = whole * layers // int(model.config.num_hidden_layers)
    if DrafterKind.EAGLE in derived:
        head = derived[DrafterKind.EAGLE]
        element = next(head.parameters()).element_size()
        costs[DrafterKind.EAGLE] = 2 * head.config.num_key_value_heads * head.config.head_dim * element
    return costs


def _members(kind: DrafterKind, chain: Sequence[DrafterKind]) -> Sequence[DrafterKind]:
    """The drafters a session runs: a chain's members, else its own kind."""
    return chain if kind is DrafterKind.CHAIN else (kind,)
