"""The speculative loop: draft K, verify in one target pass, commit accepted + 1, repeat.

The orchestrator's ``committed`` list is the source of truth. Each round the
draft receives the tokens committed since it last heard (the accepted prefix of
its own block plus the target's correction or bonus token) and rolls back the
rest; the target commits the same accepted + 1 tokens itself, so both caches
stay in step without re-reading the prompt.

Overlap (pipelined drafting): while the target verifies block i, the draft
already drafts past it as if it were accepted whole, k + 1 tokens whose first
is its guess for the bonus token. If the target accepts all of block i and its
bonus token equals the guess, the rest is block i + 1, ready at once;
otherwise it is discarded and the draft rolls back with the next proposal.
A used block was drafted from exactly the context it now continues, with the
draft's usual sampling, so greedy output is unchanged and sampling stays
lossless (whether the block is used depends only on the target's decisions
about block i, not on the block's own draws).

Free drafts: a drafter whose proposals cost nothing (prompt lookup) is asked
every round for up to the round's bound, and the controller cuts the block to
the tokens worth verifying from its reported match quality
(``AdaptiveK.cut``); a drafter that pays per token is asked for what the
controller chooses beforehand (``AdaptiveK.ask``).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from lmkit.kinds import DrafterKind
from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.wire import drop_leading_rows
from orchestrator.acceptance import StatsKey, quality_of
from orchestrator.adaptive_k import AdaptiveK
from orchestrator.links import DraftLink, TargetLink
from orchestrator.rate import ALONE, CostModel, Load


class Finish(enum.Enum):
    LENGTH = 1
    EOS = 2
    STOP_STRING = 3
    CONTEXT = 4


@dataclass(frozen=True)
class LoopConfig:
    k: int  # draft tokens per round (the bound when adaptive); 0 = target-only decoding
    max_new_tokens: int
    eos_ids: frozenset[int]
    max_context: int  # positions the target accepts
    overlap: bool = False  # draft block i+1 while the target verifies block i
    ahead_max: int = 0  # largest k drafted ahead (the draft proposes k + 1 then); 0 = no overlap
    drafter: DrafterKind | None = None  # the session's drafter (a block's drafter unless it names a chain member)
    free_drafters: frozenset[DrafterKind] = frozenset()  # its drafters whose proposals cost nothing (cut by quality)


@dataclass
class LoopStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    delivered: int = 0  # tokens sent to the client: committed ones, less any past a stop string
    draft_compute_s: float = 0.0
    target_compute_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    overlap_hits: int = 0  # rounds whose block was drafted during the previous verification
    feature_bytes: int = 0  # hidden features the target sent for a feature drafter
    batch_sizes: list[int] = field(default_factory=list)  # sessions in each verifying forward

    @property
    def mean_batch_size(self) -> float:
        return sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward pass (accepted + 1)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        return sum(self.k_per_round) / len(self.k_per_round) if self.k_per_round else 0.0


def cut_at_finish(new: Sequence[int], eos_ids: frozenset[int], budget: int) -> tuple[list[int], Finish | None]:
    """Truncate a round's tokens after the first EOS, or at the token budget."""
    for i, token in enumerate(new[:budget]):
        if token in eos_ids:
            return list(new[: i + 1]), Finish.EOS
    if len(new) >= budget:
        return list(new[:budget]), Finish.LENGTH
    return list(new), None


def load_of(result: pb.VerifyResult) -> Load:
    """The load signal of a verification (an old target without the fields reads as alone)."""
    return Load(max(result.batch_size, 1), float(result.others_committed))


@dataclass
class _Block:
    tokens: list[int]
    probs: pb.DraftProbs | None = None
    draft_s: float = 0.0
    k: int = 0  # tokens asked for (a free block: the tokens kept)
    key: StatsKey | None = None  # what its acceptance is recorded under (None: nothing to record)
    proposed: int = 0  # tokens the drafter computed (a free block's before the cut)
    prefilled: bool = False  # the draft re-read the context for it (a new or re-attached session)


def _block_of(reply: pb.DraftBlock | None, k: int, skip: int = 0) -> _Block | None:
    """A draft reply as a block, without its first ``skip`` tokens (the bonus guess of a block drafted ahead)."""
    if reply is None:
        return None
    probs = reply.probs if reply.HasField("probs") else None
    if probs is not None and skip:
        probs = drop_leading_rows(probs, skip)
    return _Block(list(reply.tokens)[skip:], probs, reply.compute_us / 1e6, k, proposed=len(reply.tokens))


def drafter_of(reply: pb.DraftBlock, session_drafter: DrafterKind | None) -> DrafterKind | None:
    """The drafter that drafted a reply: the chain member it names, else the session's."""
    try:
        return DrafterKind(reply.drafter) if reply.drafter else session_drafter
    except ValueError:  # a kind the draft did not announce: count it as the session's
        return session_drafter


class _Loop:
    """One generation's rounds; ``speculative_decode`` drives it."""

    def __init__(self, prompt, config, draft, stats, controller, costs) -> None:
        self.committed = list(prompt)
        self.config = config
        self.draft = draft
        self.stats = stats
        self.controller = controller
        self.costs = costs
        # Until this session's first decode round reports its own forward, the target's load as the
        # orchestrator last saw it: a session joining a busy target must not pad the batch with a
        # block sized for a target of its own.
        self.load = costs.load if costs is not None else ALONE
        self.ahead: asyncio.Task | None = None  # the next block, drafted during this verification
        self.ahead_base = 0  # committed length when it started
        self.ahead_block: list[int] = []  # the block it assumes accepted whole
        self.ahead_k = 0

    def limit(self, extra: int = 0) -> int:
        """The most draft tokens a round may carry ``extra`` tokens from now (k + 1 must fit budget and context)."""
        budget = self.config.max_new_tokens - self.stats.committed - extra
        room = self.config.max_context - len(self.committed) - extra
        return min(self.config.k, budget - 1, room - 1)

    def choose(self, limit: int) -> tuple[int, int]:
        """(k asked of a drafter that pays per token, the bound for a free one) for a round of at most ``limit``."""
        limit = max(limit, 0)
        if self.controller is None:
            return min(self.config.k, limit), 0
        free_k = limit if self.config.free_drafters else 0
        return self.controller.ask(limit, self.load, self.config.overlap), free_k

    def finish_block(self, reply: pb.DraftBlock | None, k: int, skip: int = 0) -> _Block:
        """A reply as this round's block: recorded under its drafter and quality, and a free one cut to the
        tokens worth verifying (from its quality and the statistics only, never from random draws)."""
        block = _block_of(reply, k, skip) or _Block([], k=k)
        if reply is None or not block.tokens or self.controller is None:
            return block
        drafter = drafter_of(reply, self.config.drafter)
        if drafter is None:
            return block
        quality = None
        if reply.HasField("quality"):  # a block drafted ahead is used after its guess: its match is one longer
            quality = quality_of(reply.quality.length + skip, reply.quality.occurrences)
        block.key = self.controller.key(drafter, quality)
        if drafter in self.config.free_drafters and block.probs is None:
            block.k = self.controller.cut(block.key, len(block.tokens), self.load)
            block.tokens = block.tokens[: block.k]
        return block

    async def next_block(self) -> _Block:
        """This round's block: the one drafted ahead when its assumption held, else a fresh proposal."""
        ready = await self.take_ahead()
        if ready is not None:
            self.stats.overlap_hits += bool(ready.tokens)
            return ready
        k, free_k = self.choose(self.limit())
        if self.draft is None or (k <= 0 and free_k <= 0):
            return _Block([], k=k)
        block = self.finish_block(await self.draft.propose(self.committed, k, free_k), k)
        block.prefilled = self.draft.last_prefilled
        self.stats.draft_compute_s += block.draft_s
        return block

    async def take_ahead(self) -> _Block | None:
        if self.ahead is None:
            return None
        reply, self.ahead = await self.ahead, None
        if reply is None:
            return None
        self.stats.draft_compute_s += reply.compute_us / 1e6  # spent whether or not the block is used
        guess = list(reply.tokens[:1])
        # Usable iff the last round committed exactly the assumed block plus the guessed bonus token.
        if len(reply.tokens) < 2 or self.committed[self.ahead_base :] != [*self.ahead_block, *guess]:
            return None
        return self.finish_block(reply, self.ahead_k, skip=1)  # cut to nothing, it is still this round's answer

    def start_ahead(self, block: _Block) -> None:
        """While the target verifies ``block``, draft the next one assuming it is accepted whole."""
        if not (self.config.overlap and self.draft is not None and self.draft.up and block.tokens):
            return
        k, free_k = self.choose(min(self.limit(extra=len(block.tokens) + 1), self.config.ahead_max))
        if k > 0 or free_k > 0:
            self.ahead_base, self.ahead_block, self.ahead_k = len(self.committed), list(block.tokens), k
            self.ahead = asyncio.create_task(
                self.draft.propose_ahead(list(self.committed), block.tokens, k, free_k))

    async def close(self) -> None:
        """Stop the proposal drafted ahead, if any, and wait until it has stopped."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)

    def commit(
        self, block: _Block, result: pb.VerifyResult, prefilled: bool = False
    ) -> tuple[list[int], Finish | None]:
        """Commit a verified block; ``prefilled``: the target re-read the context in this forward (a new session)."""
        stats, target_s = self.stats, result.compute_us / 1e6
        drafted = len(block.tokens)
        budget = self.config.max_new_tokens - stats.committed
        load = load_of(result)
        stats.target_compute_s += target_s
        if self.controller is not None and block.key is not None:
            self.controller.observe(block.key, drafted, result.accepted)
        if self.costs is not None:
            self.costs.observe_target_fit(result.cost_base_us / 1e6, result.cost_per_token_us / 1e6)
        # A forward that re-read the context (the first round's prompt, or a session re-opened after a
        # target restart) runs alone by design: it says nothing about the batch's load or a decode
        # forward's cost. The same for a proposal that re-read the context on a re-attached draft.
        if stats.rounds > 0 and not prefilled:
            self.load = load
            if self.costs is not None:
                self.costs.load = load
                self.costs.observe_verify(load.sessions * max(result.batch_width, drafted + 1), target_s)
        if stats.rounds > 0 and self.costs is not None and not block.prefilled:
            self.costs.observe_draft(block.proposed, block.draft_s, block.key.drafter if block.key else None)
        if result.HasField("features"):
            stats.feature_bytes += len(result.features.values)
            if self.draft is not None:
                self.draft.add_features(result.features)
        new, finish = cut_at_finish([*block.tokens[: result.accepted], result.next_token], self.config.eos_ids, budget)
        self.committed.extend(new)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += result.accepted
        stats.committed += len(new)
        stats.accepted_per_round.append(result.accepted)
        stats.drafted_per_round.append(drafted)
        stats.k_per_round.append(block.k)
        stats.batch_sizes.append(load.sessions)
        if finish is None and len(self.committed) >= self.config.max_context:
            finish = Finish.CONTEXT
        return new, finish


async def speculative_decode(
    prompt: Sequence[int],
    config: LoopConfig,
    target: TargetLink,
    draft: DraftLink | None,
    stats: LoopStats,
    controller: AdaptiveK | None = None,
    costs: CostModel | None = None,
) -> AsyncIterator[tuple[list[int], Finish | None, list[pb.TokenLogprob]]]:
    """Yield (newly committed tokens, finish reason or None, their logprobs) once per round.

    The logprobs are the target's, one per token, when its session was opened
    with ``return_logprobs``; empty otherwise.

    With a ``controller``, each round's k is chosen in [0, config.k] from the
    measured acceptance, costs and target load (a free drafter's block is cut
    to it); ``costs`` learns from every round but the first (which carries the
    prompt's prefill).
    """
    loop = _Loop(prompt, config, draft, stats, controller, costs)
    try:
        while True:
            if len(loop.committed) >= config.max_context:
                yield [], Finish.CONTEXT, []
                return
            block = await loop.next_block()
            verifying = asyncio.ensure_future(target.verify(loop.committed, block.tokens, block.probs))
            loop.start_ahead(block)
            try:
                result = await verifying
            finally:
                verifying.cancel()  # no-op once done; stops the verify when the generation is cancelled
            new, finish = loop.commit(block, result, target.last_prefilled)
            if finish is not None:
                await loop.close()  # nothing is drafted past the end: the look-ahead stops before the last yield
            yield new, finish, list(result.logprobs[: len(new)])
            if finish is not None:
                return
    finally:
        await loop.close()
