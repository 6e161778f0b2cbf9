"""The speculative loop: draft K, verify in one target pass, commit accepted + 1, repeat.

The orchestrator's ``committed`` list is the source of truth. Each round the
draft gets the tokens committed since it last heard and rolls back the rest;
the target commits the same accepted + 1 tokens, so both caches stay in step.
What a round asks of the draft, how a block is cut and what a verdict teaches
is the session's controller's (``policy.controller``); the loop carries it out.

Overlap: while the target verifies block i, the draft drafts past it as if it
were accepted whole (and past its second guess where that is free); a block
drafted for the outcome that came true is the next round's, ready at once. It
was drafted from exactly the context it continues, and whether it is used
depends only on the target's decisions about block i: greedy output is
unchanged and sampling lossless. docs/design.md, "One round".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

from specsplit.lmkit import token_tree
from specsplit.lmkit.wire import drop_leading_rows
from specsplit.orchestrator.decode.grammar import Constraint
from specsplit.orchestrator.decode.links import DraftCall, DraftLink, TargetLink
from specsplit.orchestrator.decode.policy.controller import Block, Controller
from specsplit.orchestrator.decode.policy.measure import Forward, Load, quality_of
from specsplit.orchestrator.decode.replies import DraftedBlock, VerifiedBlock, drafter_of


class Finish(enum.Enum):
    LENGTH = 1
    EOS = 2
    STOP_STRING = 3
    CONTEXT = 4


@dataclass(frozen=True)
class LoopConfig:
    max_new_tokens: int
    eos_ids: frozenset[int]
    max_context: int  # positions the target accepts
    ahead_max: int = 0  # largest k drafted ahead (the draft proposes k + 1 then); 0 = no overlap
    tree_branches: int = 1  # continuations a round may verify as a token tree; 1 = chains only
    constraint: Constraint | None = None  # the grammar the output follows (its matcher: this generation's)


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
    # Where a round's time went (the overhead suite): waits here for the target's results and the draft's replies,
    # and the services' own times on them (service: receipt to answer; forward: the target model alone).
    target_wait_s: float = 0.0
    target_service_s: float = 0.0
    target_forward_s: float = 0.0
    draft_wait_s: float = 0.0  # rounds waiting for a block (drafted after the verification, or ahead and late)
    draft_wall_s: float = 0.0  # every reply's wall time, request to reply (with overlap, mostly hidden)
    draft_service_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    overlap_hits: int = 0  # rounds whose block was drafted during the previous verification
    ahead_started: int = 0  # blocks drafted during a verification (hit rate: overlap_hits / ahead_started)
    overlap_waiting: int = 0  # hits whose block was already back when the verification's result came
    second_guess_started: int = 0  # blocks drafted past the drafter's second guess (a second outcome)
    second_guess_hits: int = 0  # ... that were used (counted in overlap_hits too)
    late_blocks: int = 0  # draft replies that missed their round's deadline (the target stepped alone)
    draft_requests: int = 0  # proposals sent to the draft (before a verification or ahead during one)
    busy_rounds: int = 0  # rounds without a draft because a late reply was still due
    feature_bytes: int = 0  # hidden features the target sent for a feature drafter
    batch_sizes: list[int] = field(default_factory=list)  # sessions in each verifying forward
    tree_rounds: int = 0  # rounds that verified a token tree
    tree_nodes: int = 0  # draft tokens those trees carried
    branch_accepted: int = 0  # tokens accepted off a tree's primary chain
    forced_tokens: int = 0  # tokens drafted because the grammar forced them (jump-forward)

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


def load_of(verified: VerifiedBlock, fed: int) -> Load:
    """The load signal of a verification that fed ``fed`` tokens of this session (a target that does not report
    its forward's tokens reads as padded)."""
    sessions = max(verified.batch_size, 1)
    others = None
    if verified.batch_packed and verified.batch_tokens:
        others = max(verified.batch_tokens - fed, sessions - 1)
    return Load(sessions, float(verified.others_committed), others)


def forward_of(verified: VerifiedBlock, fed: int, prefill: bool, ahead: bool) -> Forward:
    """What a verified block says of the forward it came from, for the controller."""
    load = load_of(verified, fed)
    tokens = verified.batch_tokens or load.sessions * max(verified.batch_width, fed)
    return Forward(verified.compute_s, tokens, load, verified.cost_fit, prefill, ahead)


def ask_draft(draft: DraftLink, controller: Controller, committed: Sequence[int], assumed: Sequence[int], k: int,
              free_k: int = 0, max_branches: int = 1) -> DraftCall | None:
    """Send the draft a request (``DraftLink.send``) with the wait the controller gives its reply: a session's
    first waits behind the draft's read of the context begun at the open."""
    wait_s = 0.0
    if draft.up:
        wait_s = controller.wait_s(max(k, free_k), draft.cold, len(committed) + len(assumed), draft.since_open_s())
    return draft.send(committed, assumed, k, free_k, max_branches, wait_s)


def learn_draft_costs(draft: DraftLink, controller: Controller) -> None:
    """Tell the controller what the draft's replies cost since it last heard (late replies' too)."""
    for cost in draft.take_costs():
        block = cost.block
        controller.observe_proposal(cost.wall_s, block.compute_s, len(block.tokens),
                                    drafter_of(block, controller.drafters.session), cost.read)


def block_of(reply: DraftedBlock | None, k: int, guess: int | None = None) -> Block | None:
    """A draft reply as a block (a tree's parents checked; a chain's empty).

    ``guess``: the reply was drafted ahead and begins with the draft's guess of
    the bonus token (a tree: its guesses, the context's children); the bonus
    token came out as ``guess``, and the block is what follows that guess.
    None when no guess was right or nothing follows it.
    """
    if reply is None:
        return None
    probs, tokens, parents = reply.probs, reply.tokens, reply.parents
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
    second = None  # a chain's only: a tree carries its alternatives itself
    if chain and reply.second_guess is not None and 0 <= reply.second_guess[0] - skip < len(tokens):
        second = (reply.second_guess[0] - skip, reply.second_guess[1])
    return Block(tokens, probs, k, parents, second, proposed=len(reply.tokens))


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

    def __init__(self, prompt: Sequence[int], config: LoopConfig, draft: DraftLink, stats: LoopStats,
                 controller: Controller) -> None:
        self.committed = list(prompt)
        self.config = config
        self.draft = draft
        self.stats = stats
        self.controller = controller
        self.aheads: list[_Ahead] = []  # next blocks drafted during this verification, one per assumed outcome

    def limit(self, extra: int = 0) -> int:
        """The most draft tokens a round may carry ``extra`` tokens from now (k + 1 must fit budget and context)."""
        budget = self.config.max_new_tokens - self.stats.committed - extra
        room = self.config.max_context - len(self.committed) - extra
        return min(budget - 1, room - 1)

    async def next_block(self) -> Block:
        """This round's block: one drafted ahead whose assumed outcome came true, else a fresh proposal.

        A draft that is down, busy with a late reply, or late with this one
        gives no block: the target steps alone this round.
        """
        ready = await self.take_ahead()
        if ready is not None:
            self.stats.overlap_hits += bool(ready.tokens)
            return ready
        ask = self.controller.plan(self.limit())
        if ask.empty:
            return Block([], k=ask.k)
        call = self.ask_draft((), ask.k, ask.free_k)
        self.stats.draft_requests += call is not None
        reply = await self.received(call) if call is not None else None
        self.returned(reply, ask.free_k)
        return self.finish_block(reply, ask.k)

    async def received(self, call: DraftCall) -> DraftedBlock | None:
        """The call's reply, by its deadline (``DraftLink.receive``); the round's wait for it is counted."""
        start = time.perf_counter()
        try:
            return await self.draft.receive(call)
        finally:
            self.stats.draft_wait_s += time.perf_counter() - start
            learn_draft_costs(self.draft, self.controller)

    def ask_draft(self, assumed: Sequence[int], k: int, free_k: int) -> DraftCall | None:
        """Ask the draft for a block continuing the committed tokens and ``assumed`` (``ask_draft``)."""
        return ask_draft(self.draft, self.controller, self.committed, assumed, k, free_k, self.config.tree_branches)

    def returned(self, reply: DraftedBlock | None, free_k: int, guessed: bool = False) -> None:
        """Tell the controller what an ask of the free drafter returned (nothing to tell for a late reply)."""
        if reply is None or free_k <= 0:
            return
        quality = self.quality(reply, guessed) if reply.tokens else None
        self.controller.returned(drafter_of(reply, self.controller.drafters.session), quality)

    @staticmethod
    def quality(reply: DraftedBlock, guessed: bool):
        """A reply's match quality (a block drafted ahead is used after its guess: its match is one longer)."""
        if reply.match is None:
            return None
        length, occurrences = reply.match
        return quality_of(length + guessed, occurrences)

    def finish_block(self, reply: DraftedBlock | None, k: int, guess: int | None = None) -> Block:
        """A reply as this round's block (``guess``: as in ``block_of``; no block after it gives an empty one)."""
        return self.finished(reply, block_of(reply, k, guess) or Block([], k=k), guess is not None)

    def finished(self, reply: DraftedBlock | None, block: Block, guessed: bool = False) -> Block:
        """A reply's block as this round's: its drafter and quality noted, cut by the controller to what is worth
        verifying, a tree to what fits the context. ``guessed``: drafted ahead, past a bonus guess that came true."""
        if reply is not None and block.tokens:
            block.drafter = drafter_of(reply, self.controller.drafters.session)
            block.quality = self.quality(reply, guessed)
            block = self.controller.cut(block)
        return self.fit_context(block) if block.parents else block

    def fit_context(self, block: Block) -> Block:
        """Near the end of the context a tree is cut to its primary chain."""
        room = self.config.max_context - len(self.committed) - 1
        if len(block.tokens) <= room:
            return block
        tokens, parents = token_tree.subtree(block.tokens, block.parents, token_tree.primary_chain(block.parents)[:room])
        return replace(block, tokens=tokens, parents=[] if token_tree.is_chain(parents) else parents)

    async def take_ahead(self) -> Block | None:
        """The block drafted ahead for the outcome that came true, if it is back by its deadline.

        Blocks drafted for other outcomes are not waited for; the link drops
        them when they come (they were drafted from other contexts).
        """
        aheads, self.aheads = self.aheads, []
        ahead = next((a for a in aheads if a.fits(self.committed)), None)
        if ahead is None:
            return None
        waiting = ahead.call.reply.done()  # the reply came before the verification's
        reply = await self.received(ahead.call)
        self.returned(reply, ahead.free_k, guessed=ahead.guess)
        # Usable iff (a guess) the guessed bonus token is the one the target committed, and tokens follow.
        block = block_of(reply, ahead.k, self.committed[-1] if ahead.guess else None)
        if block is None or not block.tokens:
            return None
        self.stats.overlap_waiting += waiting
        self.stats.second_guess_hits += not ahead.guess
        # cut to nothing, it is still this round's answer
        return self.finished(reply, block, guessed=ahead.guess)

    def start_ahead(self, block: Block) -> None:
        """While the target verifies ``block``, draft what the controller plans for after it: the next block
        assuming it is accepted whole, and past the drafter's second guess where that is free."""
        if not self.draft.up:
            return
        chain = block.chain  # a tree's primary chain: the drafter's first choice
        ask = self.controller.plan_ahead(block, min(self.limit(extra=len(chain) + 1), self.config.ahead_max))
        if ask.empty:
            return
        # + 1: the guess of the bonus token (a tree: several guesses)
        free_k = ask.free_k + 1 if ask.free_k else 0
        call = self.ask_draft(chain, ask.k + 1, free_k)
        if call is None:
            return
        self.stats.draft_requests += 1
        self.aheads = [_Ahead(call, len(self.committed), list(chain), ask.k, guess=True, free_k=ask.free_k)]
        self.stats.ahead_started += 1
        if block.second_guess is None:
            return
        index, token = block.second_guess
        assumed = [*block.tokens[:index], token]
        second = self.controller.plan_second_guess(
            block, min(self.limit(extra=len(assumed)), self.config.ahead_max), ask)
        if second.empty:
            return
        call = self.ask_draft(assumed, second.k, second.free_k)
        if call is not None:
            self.stats.draft_requests += 1
            self.aheads.append(_Ahead(call, len(self.committed), assumed, second.k, guess=False,
                                      free_k=second.free_k))
            self.stats.second_guess_started += 1

    def constrain(self, block: Block) -> tuple[Block, bytes | None]:
        """The block fitted to the grammar (refused tokens cut, forced ones appended) and the mask of its
        positions and the one after them; the block as it is without a grammar."""
        constraint = self.config.constraint
        if constraint is None:
            return block, None
        assert block.probs is None, "a grammar is not verified with draft probabilities"
        fitted = constraint.fit(block.tokens, block.parents, self.limit())
        second = block.second_guess if block.second_guess and block.second_guess[0] < len(fitted.tokens) else None
        self.stats.forced_tokens += fitted.forced
        block = replace(block, tokens=fitted.tokens, parents=fitted.parents, second_guess=second, forced=fitted.forced)
        return block, fitted.bits

    async def close(self) -> None:
        """Stop the proposals drafted ahead, if any, and wait until they have stopped (the draft link's close
        cancels every request still on its way)."""
        aheads, self.aheads = self.aheads, []
        if aheads:
            await self.draft.close()

    def commit(self, block: Block, result: VerifiedBlock, prefilled: bool = False,
               wall_s: float = 0.0) -> tuple[list[int], Finish | None]:
        """Commit a verified block; ``prefilled``: the target re-read the context in this forward (a new session,
        or one re-opened after a target restart: such a forward runs alone by design); ``wall_s``: the verify's
        wall time here."""
        stats = self.stats
        learn_draft_costs(self.draft, self.controller)  # replies that came during the verification, late ones too
        stats.target_wait_s += wall_s
        stats.target_service_s += result.service_s
        stats.target_forward_s += result.forward_s
        drafted = len(block.tokens)
        budget = self.config.max_new_tokens - stats.committed
        forward = forward_of(result, drafted + 1, stats.rounds == 0 or prefilled, bool(self.aheads))
        stats.target_compute_s += forward.seconds
        accepted, path = self.accepted_tokens(block, result)
        self.controller.observe(block, self.primary_accepted(block, result), path, forward)
        if result.features is not None:
            stats.feature_bytes += result.feature_bytes
            self.draft.add_features(result.features)
        if result.successors is not None:
            self.draft.add_successors(result.successors)
        new, finish = cut_at_finish([*accepted, result.next_token], self.config.eos_ids, budget)
        if self.config.constraint is not None:
            self.config.constraint.advance(new)
        self.committed.extend(new)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += result.accepted
        stats.committed += len(new)
        stats.accepted_per_round.append(result.accepted)
        stats.drafted_per_round.append(drafted)
        stats.k_per_round.append(block.k)
        stats.batch_sizes.append(forward.load.sessions)
        stats.late_blocks, stats.busy_rounds = self.draft.late_blocks, self.draft.busy_rounds
        stats.draft_compute_s = self.draft.compute_s  # every reply's, used or not
        stats.draft_warm_s, stats.draft_warm_tokens = self.draft.warm_s, self.draft.warm_tokens
        stats.draft_wall_s, stats.draft_service_s = self.draft.wall_s, self.draft.service_s
        if finish is None and len(self.committed) >= self.config.max_context:
            finish = Finish.CONTEXT
        return new, finish

    def accepted_tokens(self, block: Block, result: VerifiedBlock) -> tuple[list[int], list[int]]:
        """The draft tokens the target accepted, and a tree's path to them (checked to be one; empty for a chain)."""
        if not block.parents:
            return block.tokens[: result.accepted], []
        path = result.path
        if len(path) != result.accepted or (path and token_tree.path_to(block.parents, path[-1]) != path):
            raise ValueError(f"the target answered {path} ({result.accepted} accepted), not a path of the tree sent")
        self.stats.tree_rounds += 1
        self.stats.tree_nodes += len(block.tokens)
        self.stats.branch_accepted += result.accepted - self.primary_accepted(block, result)
        return [block.tokens[i] for i in path], path

    @staticmethod
    def primary_accepted(block: Block, result: VerifiedBlock) -> int:
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
    draft: DraftLink,
    stats: LoopStats,
    controller: Controller,
) -> AsyncIterator[tuple[list[int], Finish | None, list]]:
    """Yield (newly committed tokens, finish reason or None, their logprobs) once per round.

    The logprobs are the target's, one per token, when its session was opened
    with ``return_logprobs``; empty otherwise. ``draft``: ``links.NO_DRAFT`` for
    target-only decoding (then ``controller`` plans nothing).
    """
    loop = _Loop(prompt, config, draft, stats, controller)
    try:
        while True:
            if len(loop.committed) >= config.max_context:
                yield [], Finish.CONTEXT, []
                return
            block, allowed = loop.constrain(await loop.next_block())
            loop.start_ahead(block)  # its requests leave with the verify's, when this task next yields
            result = await target.verify(loop.committed, block.tokens, block.probs, block.parents, allowed)
            new, finish = loop.commit(block, result, target.last_prefilled, target.last_wall_s)
            if finish is not None:
                await loop.close()  # nothing is drafted past the end: the look-ahead stops before the last yield
            yield new, finish, list(result.logprobs[: len(new)])
            if finish is not None:
                return
    finally:
        await loop.close()
