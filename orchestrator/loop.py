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

A round without a block drafts ahead the same way where the session has a
free drafter and a controller: the block of nothing is accepted whole, the
draft's first token guesses the target's next one, and the rest is the next
round's block if the guess comes true. A far draft link is then paid during
the verification instead of before it.

Token trees: with ``tree_branches`` > 1 the draft may answer several
continuations as a tree; ``specsplit.orchestrator.tree_shape`` keeps the nodes worth
their verify cost, the target verifies them in one pass and answers the
accepted path, which is committed like a chain's accepted prefix. Drafting
ahead assumes the tree's primary chain (the drafter's first choice) accepted,
and may itself answer a tree: its first tokens are then several guesses of the
bonus token, and the block is the subtree below the guess that came true.

Free drafts: a drafter whose proposals cost nothing (prompt lookup) is asked
for up to the round's bound in every round where the controller judges the
ask worth its round trip (``AdaptiveK.ask_free``), and the controller cuts the
block to the tokens worth verifying from its reported match quality
(``AdaptiveK.cut``); a drafter that pays per token is asked for what the
controller chooses beforehand (``AdaptiveK.ask``). A round that asks nothing
sends no draft request: it is a target-only step.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

from specsplit.lmkit import token_tree
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.wire import drop_leading_rows
from specsplit.orchestrator.acceptance import AcceptanceStats, Quality, StatsKey, Verification, quality_of
from specsplit.orchestrator.adaptive_k import AdaptiveK
from specsplit.orchestrator.free_ask import NO_BLOCK
from specsplit.orchestrator.links import DraftCall, DraftLink, TargetLink, drafter_of
from specsplit.orchestrator.rate import ALONE, CostModel, Load, whole_probability
from specsplit.orchestrator.tree_shape import BranchStats, choose_nodes, node_acceptance

from specsplit.v1 import specsplit_pb2 as pb


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
    tree_branches: int = 1  # continuations a round may verify as a token tree; 1 = chains only
    branch: bool = True  # with overlap, also draft past the drafter's second guess where that is free
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
    draft_warm_s: float = 0.0  # draft time of replies that were not a session's first, used or not
    draft_warm_tokens: int = 0  # tokens of those replies, used or not (drafted ahead for a miss included)
    target_compute_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    overlap_hits: int = 0  # rounds whose block was drafted during the previous verification
    ahead_started: int = 0  # blocks drafted during a verification (hit rate: overlap_hits / ahead_started)
    overlap_waiting: int = 0  # hits whose block was already back when the verification's result came
    branch_started: int = 0  # blocks drafted past the drafter's second guess (a second outcome)
    branch_hits: int = 0  # ... that were used (counted in overlap_hits too)
    late_blocks: int = 0  # draft replies that missed their round's deadline (the target stepped alone)
    draft_requests: int = 0  # proposals sent to the draft (before a verification or ahead during one)
    busy_rounds: int = 0  # rounds without a draft because a late reply was still due
    feature_bytes: int = 0  # hidden features the target sent for a feature drafter
    batch_sizes: list[int] = field(default_factory=list)  # sessions in each verifying forward
    tree_rounds: int = 0  # rounds that verified a token tree
    tree_nodes: int = 0  # draft tokens those trees carried
    branch_accepted: int = 0  # tokens accepted off a tree's primary chain

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
    def overlap_hit_rate(self) -> float:
        return self.overlap_hits / self.ahead_started if self.ahead_started else 0.0

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


def load_of(result: pb.VerifyResult, fed: int) -> Load:
    """The load signal of a verification that fed ``fed`` tokens of this session (an old target without the
    fields reads as alone; one that does not report its forward's tokens, as padded)."""
    sessions = max(result.forward.batch_size, 1)
    others = None
    if result.forward.batch_packed and result.forward.batch_tokens:
        others = max(result.forward.batch_tokens - fed, sessions - 1)
    return Load(sessions, float(result.forward.others_committed), others)


@dataclass
class _Block:
    tokens: list[int]
    probs: pb.DraftProbs | None = None
    k: int = 0  # tokens asked for (a free block: the tokens kept)
    parents: list[int] = field(default_factory=list)  # a token tree's (lmkit.token_tree); empty: a chain
    branch: tuple[int, int] | None = None  # a chain's drafter's second guess: (index into tokens, token)
    key: StatsKey | None = None  # what its acceptance is recorded under (None: nothing to record)
    proposed: int = 0  # tokens the drafter computed (a free block's before the cut)

    @property
    def chain(self) -> list[int]:
        """The tokens of the primary chain: all of them for a chain."""
        if not self.parents:
            return self.tokens
        return [self.tokens[i] for i in token_tree.primary_chain(self.parents)]


def _block_of(reply: pb.DraftBlock | None, k: int, guess: int | None = None) -> _Block | None:
    """A draft reply as a block (a tree's parents checked; a chain's empty).

    ``guess``: the reply was drafted ahead and begins with the draft's guess of
    the bonus token (a tree: its guesses, the context's children); the bonus
    token came out as ``guess``, and the block is what follows that guess.
    None when no guess was right or nothing follows it.
    """
    if reply is None:
        return None
    probs = reply.probs if reply.HasField("probs") else None
    tokens, parents = list(reply.tokens), list(reply.parents)
    if token_tree.is_chain(parents):
        parents = []
    else:
        token_tree.check_parents(parents, len(tokens))
    chain, skip = not parents, 0
    if guess is not None:
        after = _after_guess(tokens, parents, guess)
        if after is None:
            return None
        tokens, parents = after
        if chain:  # its first token was the guess
            skip = 1
            probs = drop_leading_rows(probs, 1) if probs is not None else None
    branch = None  # a chain's only: a tree carries its alternatives itself
    if chain and reply.HasField("branch") and 0 <= reply.branch.index - skip < len(tokens):
        branch = (reply.branch.index - skip, reply.branch.token)
    return _Block(tokens, probs, k, parents, branch, proposed=len(reply.tokens))


def _after_guess(tokens: list[int], parents: list[int], guess: int) -> tuple[list[int], list[int]] | None:
    """What follows the bonus guess ``guess`` in a block drafted ahead: a chain's tokens after its first, a
    tree's subtree below its root child carrying ``guess``; None when no guess is ``guess`` or nothing follows."""
    if not parents:
        return (tokens[1:], []) if len(tokens) >= 2 and tokens[0] == guess else None
    right = [i for i, parent in enumerate(parents) if parent == token_tree.ROOT and tokens[i] == guess]
    if not right:
        return None
    tokens, parents = token_tree.below(tokens, parents, right[0])
    if not tokens:
        return None
    return tokens, [] if token_tree.is_chain(parents) else parents


@dataclass
class _Ahead:
    """A block drafted during a verification, assuming an outcome of the block in verification."""

    call: DraftCall
    base: int  # committed length when it was sent
    assumed: list[int]  # the tokens it assumes the verification commits
    k: int
    guess: bool  # its first token guesses the bonus token (assumed: the block accepted whole)
    free_k: int = 0  # the bound it asked of a free drafter

    def fits(self, committed: list[int]) -> bool:
        """Whether the verification committed what this block assumes (the bonus guess is checked later)."""
        outcome = committed[self.base :]
        return (outcome[:-1] if self.guess else outcome) == self.assumed


class _Loop:
    """One generation's rounds; ``speculative_decode`` drives it."""

    def __init__(self, prompt, config, draft, stats, controller, costs, branches=None, record=None) -> None:
        self.committed = list(prompt)
        self.branches = branches if branches is not None else BranchStats()
        self.config = config
        self.draft = draft
        self.stats = stats
        self.controller = controller
        self.costs = costs
        # Without a controller (fixed K): the statistics its verified blocks are recorded in, and how blocks are
        # verified, so that adaptive sessions learn from fixed ones' blocks too.
        self.record: tuple[AcceptanceStats, Verification] | None = record
        # Until this session's first decode round reports its own forward, the target's load as the
        # orchestrator last saw it: a session joining a busy target must not pad the batch with a
        # block sized for a target of its own.
        self.load = costs.load if costs is not None else ALONE
        self.aheads: list[_Ahead] = []  # next blocks drafted during this verification, one per assumed outcome

    def limit(self, extra: int = 0) -> int:
        """The most draft tokens a round may carry ``extra`` tokens from now (k + 1 must fit budget and context)."""
        budget = self.config.max_new_tokens - self.stats.committed - extra
        room = self.config.max_context - len(self.committed) - extra
        return min(self.config.k, budget - 1, room - 1)

    def choose(self, limit: int, overlap: bool | None = None, during: int | None = None,
               hit: float = 1.0) -> tuple[int, int]:
        """(k asked of a drafter that pays per token, the bound for a free one) for a round of at most ``limit``;
        ``during``, ``hit``: asked ahead, as in ``AdaptiveK.ask_free``."""
        overlap = self.config.overlap if overlap is None else overlap
        limit = max(limit, 0)
        if self.controller is None:
            return min(self.config.k, limit), 0
        k = self.controller.ask(limit, self.load, overlap)
        free = self.free_drafter
        # Asked together with a paid drafter, a free one rides on its request: no round trip of its own.
        asked = free is not None and (k > 0 or self.controller.ask_free(free, limit, self.load, during, hit))
        return k, limit if asked else 0

    @property
    def free_drafter(self) -> DrafterKind | None:
        """The session's free drafter (a chain's first free member), None without one."""
        free = self.config.free_drafters
        if not free:
            return None
        return self.config.drafter if self.config.drafter in free else min(free, key=lambda kind: kind.value)

    def record_return(self, reply: pb.DraftBlock | None, free_k: int, guessed: bool = False) -> None:
        """Tell the controller what an ask of the free drafter returned (nothing to tell for a late reply)."""
        if reply is None or free_k <= 0 or self.controller is None or self.free_drafter is None:
            return
        quality: Quality | None = NO_BLOCK
        if reply.tokens and drafter_of(reply, self.config.drafter) in self.config.free_drafters and \
                reply.HasField("quality"):
            quality = quality_of(reply.quality.length + guessed, reply.quality.occurrences)
        self.controller.asked_free(self.free_drafter, quality)

    def finish_block(self, reply: pb.DraftBlock | None, k: int, guess: int | None = None) -> _Block:
        """A reply as this round's block (``guess``: as in ``_block_of``; no block after it gives an empty one)."""
        return self.finished(reply, _block_of(reply, k, guess) or _Block([], k=k), guess is not None)

    def finished(self, reply: pb.DraftBlock | None, block: _Block, guessed: bool = False) -> _Block:
        """A reply's block as this round's: recorded under its drafter and quality, a free chain cut to the
        tokens worth verifying and a tree to the nodes worth verifying (from its quality and the statistics
        only, never from random draws). ``guessed``: drafted ahead, past a bonus guess that came true."""
        if reply is not None and block.tokens and self.verification is not None:
            block.key = self.key_of(reply, guessed)
            if block.key is not None and self.controller is not None:
                self.cut(block)
        return self.shape(block) if block.parents else block

    @property
    def verification(self) -> Verification | None:
        """How this session's blocks are verified, the last part of their statistics key; None where nothing
        records them (no controller, and no server-wide record)."""
        if self.controller is not None:
            return self.controller.verification
        return self.record[1] if self.record is not None else None

    def key_of(self, reply: pb.DraftBlock, guessed: bool) -> StatsKey | None:
        """The statistics key of a reply's block: its drafter, the session's verification, its match quality."""
        drafter = drafter_of(reply, self.config.drafter)
        if drafter is None:
            return None
        quality = None
        if reply.HasField("quality"):  # a block drafted ahead is used after its guess: its match is one longer
            quality = quality_of(reply.quality.length + guessed, reply.quality.occurrences)
        return StatsKey(drafter, self.verification, quality)

    def cut(self, block: _Block) -> None:
        """Cut a free drafter's chain to the tokens worth verifying (the controller's, from the block's key)."""
        if block.key.drafter in self.config.free_drafters and block.probs is None and not block.parents:
            block.k = self.controller.cut(block.key, len(block.tokens), self.load)
            block.tokens = block.tokens[: block.k]
            if block.branch is not None and block.branch[0] >= block.k:
                block.branch = None  # past the cut: that outcome cannot happen

    def overlap_pays(self) -> bool:
        """Draft the next block during this verification? Where the controller judges it slower, no."""
        if not self.config.overlap:
            return False
        return self.controller is None or self.controller.ahead_pays(self.load)

    async def next_block(self) -> _Block:
        """This round's block: one drafted ahead whose assumed outcome came true, else a fresh proposal.

        A draft that is down, busy with a late reply, or late with this one
        gives no block: the target steps alone this round.
        """
        ready = await self.take_ahead()
        if ready is not None:
            self.stats.overlap_hits += bool(ready.tokens)
            return ready
        k, free_k = self.choose(self.limit(), self.overlap_pays())
        if self.draft is None or (k <= 0 and free_k <= 0):
            return _Block([], k=k)
        call = self.draft.send(self.committed, (), k, free_k, self.config.tree_branches)
        self.stats.draft_requests += call is not None
        reply = await self.draft.receive(call) if call is not None else None
        self.record_return(reply, free_k)
        return self.finish_block(reply, k)

    def shape(self, block: _Block) -> _Block:
        """The nodes of a drafted tree worth verifying (all of them with a fixed K); a chain if that is all."""
        tokens, parents = block.tokens, block.parents
        if self.controller is not None:
            accept = node_acceptance(parents, self.chain_acceptance(block), self.branches)
            keep = choose_nodes(parents, accept, lambda n: self.costs.verify_s(self.load.tokens(n)),
                                self.load.others_committed)
            tokens, parents = token_tree.subtree(tokens, parents, keep)
        room = self.config.max_context - len(self.committed) - 1
        if len(tokens) > room:  # near the end of the context: the primary chain only
            tokens, parents = token_tree.subtree(tokens, parents, token_tree.primary_chain(parents)[:room])
        return replace(block, tokens=tokens, parents=[] if token_tree.is_chain(parents) else parents)

    def chain_acceptance(self, block: _Block) -> list[float]:
        """Per-depth acceptance of the drafter's first choices: the paid drafter's session record, else the
        server-wide figures of the block's drafter (a free one, e.g. prompt lookup)."""
        key = block.key
        if key is None or key.drafter is self.controller.paid:
            return self.controller.acceptance()
        return self.controller.stats.acceptance(key, self.controller.k_max)

    async def take_ahead(self) -> _Block | None:
        """The block drafted ahead for the outcome that came true, if it is back by its deadline.

        Blocks drafted for other outcomes are not waited for; the link drops
        them when they come (they were drafted from other contexts).
        """
        aheads, self.aheads = self.aheads, []
        ahead = next((a for a in aheads if a.fits(self.committed)), None)
        if ahead is None:
            return None
        waiting = ahead.call.task.done()  # the reply came before the verification's
        reply = await self.draft.receive(ahead.call)
        self.record_return(reply, ahead.free_k, guessed=ahead.guess)
        # Usable iff (a guess) the guessed bonus token is the one the target committed, and tokens follow.
        block = _block_of(reply, ahead.k, self.committed[-1] if ahead.guess else None)
        if block is None or not block.tokens:
            return None
        self.stats.overlap_waiting += waiting
        self.stats.branch_hits += not ahead.guess
        # cut to nothing, it is still this round's answer
        return self.finished(reply, block, guessed=ahead.guess)

    def start_ahead(self, block: _Block) -> None:
        """While the target verifies ``block``, draft the next one assuming it is accepted whole, and,
        where it costs the round nothing, past the drafter's second guess too (rejected at its least
        sure position, its runner-up the correction).

        A round without a block (a target-only step) is a block of nothing accepted whole: the next one is
        drafted ahead too, its first token a guess of the target's next token, where a free drafter asked
        during the verification costs less than asking after it (``AdaptiveK.ask_free``: what outlasts the
        verification and what the ask slows it by, ``CostModel.ahead_excess_s``)."""
        ahead_of_nothing = self.controller is not None and self.free_drafter is not None
        if not ((block.tokens or ahead_of_nothing) and self.draft is not None and self.draft.up
                and self.overlap_pays()):
            return
        if self.controller is not None and self.costs is not None and self.costs.quiet_due():
            return  # one forward without an ask keeps the fit an ask's excess is measured against current
        chain = block.chain  # a tree's primary chain: the drafter's first choice
        hit = self.hit_probability(block)
        k, free_k = self.choose(min(self.limit(extra=len(chain) + 1), self.config.ahead_max), overlap=True,
                                during=len(block.tokens), hit=hit)
        if k <= 0 and free_k <= 0:
            return
        # + 1: the guess of the bonus token (a tree: several guesses)
        call = self.draft.send(self.committed, chain, k + 1, free_k + 1 if free_k else 0, self.config.tree_branches)
        if call is None:
            return
        self.stats.draft_requests += 1
        self.aheads = [_Ahead(call, len(self.committed), list(chain), k, guess=True, free_k=free_k)]
        self.stats.ahead_started += 1
        if block.branch is None or not self.config.branch:
            return
        index, token = block.branch
        assumed = [*block.tokens[:index], token]
        k_branch, free_branch = self.choose(min(self.limit(extra=len(assumed)), self.config.ahead_max), overlap=True,
                                            during=len(block.tokens))
        if (k_branch <= 0 and free_branch <= 0) or not self.branch_is_free(len(block.tokens), k + 1 + k_branch):
            return
        call = self.draft.send(self.committed, assumed, k_branch, free_branch, self.config.tree_branches)
        if call is not None:
            self.stats.draft_requests += 1
            self.aheads.append(_Ahead(call, len(self.committed), assumed, k_branch, guess=False, free_k=free_branch))
            self.stats.branch_started += 1

    def hit_probability(self, block: _Block) -> float:
        """P(a block drafted ahead of ``block`` is used): its primary chain accepted whole and the bonus guessed
        (1 without a controller, or before its drafter has figures)."""
        if self.controller is None or block.key is None:
            return 1.0
        chain = len(block.chain)
        return whole_probability(self.chain_acceptance(block)[: chain + 1], chain + 1)

    def branch_is_free(self, block_tokens: int, drafted: int) -> bool:
        """Whether drafting ``drafted`` tokens in two requests comes back before the verification does."""
        if self.costs is None or not self.costs.draft_measured:
            return False
        verify_s = self.costs.verify_s(self.load.tokens(block_tokens))
        draft_s = self.costs.draft_s_per_token(self.config.drafter)
        return self.costs.links.two_requests_fit(drafted, verify_s, draft_s)

    async def close(self) -> None:
        """Stop the proposals drafted ahead, if any, and wait until they have stopped (the draft link's close
        cancels every request still on its way)."""
        aheads, self.aheads = self.aheads, []
        if aheads and self.draft is not None:
            await self.draft.close()

    def commit(
        self, block: _Block, result: pb.VerifyResult, prefilled: bool = False
    ) -> tuple[list[int], Finish | None]:
        """Commit a verified block; ``prefilled``: the target re-read the context in this forward (a new session)."""
        stats, target_s = self.stats, result.timing.compute_us / 1e6
        drafted = len(block.tokens)
        budget = self.config.max_new_tokens - stats.committed
        load = load_of(result, drafted + 1)
        stats.target_compute_s += target_s
        accepted = self.accepted_tokens(block, result)
        if block.key is not None:  # keyed where a controller or (fixed K) the server-wide record takes it
            observer = self.controller if self.controller is not None else self.record[0]
            observer.observe(block.key, len(block.chain), self.primary_accepted(block, result))
        if self.costs is not None:
            self.costs.observe_target_fit(result.forward.cost_base_us / 1e6, result.forward.cost_per_token_us / 1e6)
        # A forward that re-read the context (the first round's prompt, or a session re-opened after a
        # target restart) runs alone by design: it says nothing about the batch's load or a decode
        # forward's cost. The same for a proposal that re-read the context on a re-attached draft.
        if stats.rounds > 0 and not prefilled:
            self.load = load
            if self.costs is not None:  # the draft link reports the draft's costs itself (late blocks too)
                self.costs.load = load
                tokens = result.forward.batch_tokens or load.sessions * max(result.forward.batch_width, drafted + 1)
                self.costs.observe_verify(tokens, target_s, ahead=bool(self.aheads))
        if result.HasField("features"):
            stats.feature_bytes += len(result.features.values)
            if self.draft is not None:
                self.draft.add_features(result.features)
        new, finish = cut_at_finish([*accepted, result.next_token], self.config.eos_ids, budget)
        self.committed.extend(new)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += result.accepted
        stats.committed += len(new)
        stats.accepted_per_round.append(result.accepted)
        stats.drafted_per_round.append(drafted)
        stats.k_per_round.append(block.k)
        stats.batch_sizes.append(load.sessions)
        if self.draft is not None:
            stats.late_blocks, stats.busy_rounds = self.draft.late_blocks, self.draft.busy_rounds
            stats.draft_compute_s = self.draft.compute_s  # every reply's, used or not
            stats.draft_warm_s, stats.draft_warm_tokens = self.draft.warm_s, self.draft.warm_tokens
        if finish is None and len(self.committed) >= self.config.max_context:
            finish = Finish.CONTEXT
        return new, finish

    def accepted_tokens(self, block: _Block, result: pb.VerifyResult) -> list[int]:
        """The draft tokens the target accepted: a chain's prefix, or a tree's path (checked to be one)."""
        if not block.parents:
            return block.tokens[: result.accepted]
        path = list(result.path)
        if len(path) != result.accepted or (path and token_tree.path_to(block.parents, path[-1]) != path):
            raise ValueError(f"the target answered {path} ({result.accepted} accepted), not a path of the tree sent")
        self.branches.observe(block.parents, path)
        self.stats.tree_rounds += 1
        self.stats.tree_nodes += len(block.tokens)
        self.stats.branch_accepted += result.accepted - self.primary_accepted(block, result)
        return [block.tokens[i] for i in path]

    @staticmethod
    def primary_accepted(block: _Block, result: pb.VerifyResult) -> int:
        """How many tokens of the primary chain were accepted."""
        if not block.parents:
            return result.accepted
        primary, count = token_tree.primary_chain(block.parents), 0
        for node, taken in zip(primary, result.path):
            if node != taken:
                break
            count += 1
        return count


async def speculative_decode(
    prompt: Sequence[int],
    config: LoopConfig,
    target: TargetLink,
    draft: DraftLink | None,
    stats: LoopStats,
    controller: AdaptiveK | None = None,
    costs: CostModel | None = None,
    branches: BranchStats | None = None,
    record: tuple[AcceptanceStats, Verification] | None = None,
) -> AsyncIterator[tuple[list[int], Finish | None, list[pb.TokenLogprob]]]:
    """Yield (newly committed tokens, finish reason or None, their logprobs) once per round.

    The logprobs are the target's, one per token, when its session was opened
    with ``return_logprobs``; empty otherwise.

    With a ``controller``, each round's k is chosen in [0, config.k] from the
    measured acceptance, costs, links and target load (a free drafter's
    block is cut to it), and whether to draft ahead at all; ``costs`` learns
    from every round but the first (which carries the prompt's prefill).
    """
    loop = _Loop(prompt, config, draft, stats, controller, costs, branches, record)
    try:
        while True:
            if len(loop.committed) >= config.max_context:
                yield [], Finish.CONTEXT, []
                return
            block = await loop.next_block()
            verifying = asyncio.ensure_future(target.verify(loop.committed, block.tokens, block.probs, block.parents))
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
