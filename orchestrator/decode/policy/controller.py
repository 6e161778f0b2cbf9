"""One session's round decisions: plan a round, cut a block, observe a result.

The loop and the draft link call only this interface; fixed K is a policy like
adaptive K. ``AdaptiveK`` chooses each round's block from the round model
(``policy.model``) over what every session measured (``policy.measure``): how
many tokens to ask of a drafter that pays per token, whether to ask a free one
(prompt lookup) at all, how far to cut its block by match quality, which tree
nodes to verify, whether to draft ahead during a verification, and when to
probe a drafter that does not pay. Every choice depends only on committed
context and on blocks already verified, never on the draws of the positions it
covers, so sampled verification stays lossless. docs/design.md, "The round
model", has the formulas and the reasons. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specsplit.lmkit import token_tree
from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.decode.policy import model
from specsplit.orchestrator.decode.policy.measure import (
    NO_BLOCK,
    AcceptRule,
    Forward,
    Load,
    Measurements,
    Quality,
    QualityMix,
    StatsKey,
)
from specsplit.orchestrator.decode.policy.model import Shape


@dataclass(frozen=True)
class Ask:
    """What a round asks of the draft: k tokens of a drafter that pays per token, and up to ``free_k`` of a free
    one (0: not asked)."""

    k: int = 0
    free_k: int = 0

    @property
    def empty(self) -> bool:
        return self.k <= 0 and self.free_k <= 0


NOTHING = Ask()


@dataclass
class Block:
    """A round's draft block as the loop holds it: a chain, or a token tree (``lmkit.token_tree`` parents)."""

    tokens: list[int]
    probs: object | None = None  # the drafter's distributions of its tokens (DraftProbs), opaque here
    k: int = 0  # tokens asked for (a free block: the tokens kept)
    parents: list[int] = field(default_factory=list)  # a token tree's; empty: a chain
    second_guess: tuple[int, int] | None = None  # a chain's: where its drafter is least sure, (index, runner-up)
    drafter: DrafterKind | None = None  # who drafted it (None: an empty block, nothing to record)
    quality: Quality | None = None  # its match quality, a copied block's
    proposed: int = 0  # tokens the drafter computed (a free block's before the cut)
    forced: int = 0  # tokens a grammar forced, appended after the drafter's (not the drafter's to learn from)

    @property
    def chain(self) -> list[int]:
        """The tokens of the primary chain (the drafter's first choices): all of them for a chain."""
        if not self.parents:
            return self.tokens
        return [self.tokens[i] for i in token_tree.primary_chain(self.parents)]


@dataclass(frozen=True)
class Drafters:
    """A session's drafters: its own kind (a chain's, for a chain) and which of its members cost nothing."""

    session: DrafterKind | None = None
    free: frozenset[DrafterKind] = frozenset()  # members whose proposals cost nothing (cut by quality)
    paid: DrafterKind | None = None  # the member that pays per token; None: all are free

    @property
    def first_free(self) -> DrafterKind | None:
        """The free drafter asked for free blocks (the session's own, else a chain's first free member)."""
        if not self.free:
            return None
        return self.session if self.session in self.free else min(self.free, key=lambda kind: kind.value)


@dataclass
class Controller:
    """The interface, and what every policy shares: observing results, and how long to wait for the draft."""

    k_max: int  # the most draft tokens a round carries; 0: target-only decoding
    measured: Measurements
    rule: AcceptRule
    drafters: Drafters = field(default_factory=Drafters)
    overlap: bool = False  # the session may draft a block during the verification before it
    second_guess: bool = True  # with overlap, also draft past the drafter's second guess where that is free
    draft_timeout_s: float = 5.0  # the longest a round waits for a draft reply
    draft_deadline_s: float = 0.0  # a fixed wait for a block; 0: from the link's round trip and the costs
    load: Load = field(init=False)  # the target's load as this session last saw it

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        # Until this session's first decode round reports its own forward, the load as the orchestrator last saw
        # it: a session joining a busy target must not size a block for a target of its own.
        self.load = self.costs.load

    @property
    def costs(self):
        return self.measured.costs

    @property
    def acceptance(self):
        return self.measured.acceptance

    # -- plan a round ------------------------------------------------------------------------------------------------
    def plan(self, limit: int) -> Ask:
        """What to ask before this round's verification, for a block of at most ``limit`` tokens."""
        raise NotImplementedError

    def plan_ahead(self, block: Block, limit: int) -> Ask:
        """What to ask during the verification of ``block``, assuming it is accepted whole (the ask begins with a
        guess of the bonus token, not counted here)."""
        raise NotImplementedError

    def plan_second_guess(self, block: Block, limit: int, ahead: Ask) -> Ask:
        """What to ask, besides ``ahead``, during the verification of ``block``, assuming it is rejected at its
        second guess (which is the correction then). Only where both come back before the verification."""
        if block.second_guess is None or not self.second_guess:
            return NOTHING
        ask = self._plan_during(limit, len(block.tokens))
        if ask.empty or not self._two_requests_fit(len(block.tokens), ahead.k + 1 + ask.k):
            return NOTHING
        return ask

    def _plan_during(self, limit: int, during: int, hit: float = 1.0) -> Ask:
        """The ask sent during the verification of a block of ``during`` tokens, used with probability ``hit``."""
        raise NotImplementedError

    def _two_requests_fit(self, block_tokens: int, drafted: int) -> bool:
        if not self.costs.draft_measured:
            return False
        verify_s = self.costs.verify_s(self.load.tokens(block_tokens))
        draft_s = self.costs.draft_s_per_token(self.drafters.session)
        return model.two_requests_fit(self.costs.links, drafted, verify_s, draft_s)

    # -- cut a block -------------------------------------------------------------------------------------------------
    def cut(self, block: Block) -> Block:
        """The part of a drafted block worth verifying."""
        return block

    # -- observe -----------------------------------------------------------------------------------------------------
    def key_of(self, block: Block) -> StatsKey | None:
        """What a block's acceptance is recorded under (None: nothing to record)."""
        return StatsKey(block.drafter, self.rule, block.quality) if block.drafter is not None else None

    def returned(self, drafter: DrafterKind | None, quality: Quality | None) -> None:
        """An ask of the free drafter returned a block of ``drafter`` with ``quality`` (None: no block)."""

    def observe(self, block: Block, primary_accepted: int, path: list[int], forward: Forward) -> None:
        """A verified block: ``primary_accepted`` of its primary chain passed (a tree: the target walked ``path``),
        in the reported ``forward``."""
        key = self.key_of(block)
        if key is not None:
            drafted = len(block.chain) - block.forced
            self.record(key, drafted, min(primary_accepted, drafted))
        if block.parents:
            self.measured.siblings_of(self.drafters.session).observe(block.parents, path)
        self.costs.observe_target_fit(*forward.fit)
        # A forward that re-read the context runs alone by design: it says nothing about the batch's load or a
        # decode forward's cost.
        if not forward.prefill:
            self.load = self.costs.load = forward.load
            self.costs.observe_verify(forward.tokens, forward.seconds, ahead=forward.ahead)

    def record(self, key: StatsKey, drafted: int, accepted: int) -> None:
        """``accepted`` of a block's ``drafted`` tokens passed (a rejection ends it): every session learns it."""
        self.acceptance.observe(key, drafted, accepted)

    # -- the draft link ----------------------------------------------------------------------------------------------
    def wait_s(self, tokens: int, first: bool, context: int, since_open_s: float) -> float:
        """How long a round waits for a draft reply of ``tokens`` tokens after ``context`` (``first``: the session's
        first, behind the draft's read of the context begun ``since_open_s`` ago); 0: it is not waited for."""
        timeout = self.draft_timeout_s
        budget = timeout if first else self._deadline_s(tokens)
        if budget >= timeout and not self.draft_deadline_s:
            budget = min(budget, self._worth_waiting_s(tokens))
            if first and not self._first_arrives_within(context, tokens, budget, since_open_s):
                budget = 0.0  # the target's prefill goes on while the draft reads
        return budget

    def _deadline_s(self, tokens: int) -> float:
        if not self.costs.draft_measured:  # a draft's cost is unknown until it has answered once
            return self.draft_timeout_s
        draft_s = self.costs.draft_s_per_token(self.drafters.session)
        deadline = self.draft_deadline_s or model.deadline_s(self.costs.links.draft, tokens * draft_s)
        return min(deadline, self.draft_timeout_s)

    def _worth_waiting_s(self, tokens: int) -> float:
        """The longest wait for a block whose cost is unknown: as many target steps as it has tokens (the most it
        could save), on top of the link's round trip and deviations, without slack; the draft timeout before
        any target forward was measured."""
        step_s = self.costs.step_s()
        if step_s is None:
            return self.draft_timeout_s
        return model.deadline_s(self.costs.links.draft, tokens * step_s, slack=0.0)

    def _first_arrives_within(self, context: int, tokens: int, budget_s: float, since_open_s: float) -> bool:
        """Whether a session's first block is expected back within ``budget_s``: what is left of the draft's read
        of the context (priced per context token from earlier reads), then its drafting. True before any read was
        measured (it is then waited for)."""
        read = self.costs.read_s(context, self.drafters.session)
        if read is None:
            return True
        left = max(read - since_open_s, 0.0)
        drafting = tokens * self.costs.draft_s_per_token(self.drafters.session)
        return self.costs.links.draft.srtt + left + drafting <= budget_s

    def observe_proposal(self, wall_s: float | None, compute_s: float, tokens: int, drafter: DrafterKind | None,
                         read: tuple[int, float] | None = None) -> None:
        """A draft reply came ``wall_s`` after its request (None: it was sent behind another of its session, and
        its wait says nothing of the link), ``compute_s`` of it drafting ``tokens`` tokens by ``drafter``;
        ``read``: the session's first, (context tokens, seconds the draft spent reading them)."""
        # Waiting behind other sessions' proposals on the draft's compute thread counts as link time: no load model
        # covers the draft, and a deadline must allow for it.
        if wall_s is not None:
            self.costs.links.draft.observe(wall_s - compute_s)
        if read is not None:
            self.costs.observe_read(*read, self.drafters.session)
        else:
            self.costs.observe_draft(tokens, compute_s, drafter)


@dataclass
class FixedK(Controller):
    """A fixed block of ``k_max`` tokens every round (fewer near the end); ahead of every block with overlap."""

    def plan(self, limit: int) -> Ask:
        return Ask(min(self.k_max, max(limit, 0)))

    def plan_ahead(self, block: Block, limit: int) -> Ask:
        return self._plan_during(limit, len(block.tokens)) if block.tokens and self.overlap else NOTHING

    def _plan_during(self, limit: int, during: int, hit: float = 1.0) -> Ask:
        return self.plan(limit)


@dataclass
class AdaptiveK(Controller):
    """Each round's block chosen from the round model over every session's measurements."""

    session_weight: float = 4.0  # pseudo-observations behind the server-wide figures, per position
    decay: float = 0.8  # this session's own record: recent rounds dominate (acceptance comes in runs)
    probe_every: int = 8
    probe_alpha: float = 0.9  # probe only where drafts this good would pay
    probe_backoff: int = 8  # the probe interval grows to at most this many times probe_every
    free_weight: float = 2.0  # pseudo-positions behind the server's figures for this session's free blocks
    free_decay: float = 0.95  # per position of this session's free blocks
    returns_decay: float = 0.7  # this session's record of what its asks of a free drafter returned
    returns_weight: float = 2.0  # pseudo-asks behind every session's record of those returns
    _passed: list[float] = field(default_factory=list, init=False)
    _reached: list[float] = field(default_factory=list, init=False)
    _free_passed: float = field(default=0.0, init=False)  # positions of this session's free blocks that passed
    _free_expected: float = field(default=0.0, init=False)  # how many the server-wide figures predicted would
    _returns: QualityMix = field(default=None, init=False)  # what this session's asks of a free drafter returned

    def __post_init__(self) -> None:
        super().__post_init__()
        self._passed = [0.0] * self.k_max
        self._reached = [0.0] * self.k_max
        self._returns = QualityMix(self.returns_decay)

    def key(self, drafter: DrafterKind, quality: Quality | None = None) -> StatsKey:
        return StatsKey(drafter, self.rule, quality)

    @property
    def _longest_interval(self) -> int:
        return self.probe_backoff * self.probe_every

    # -- plan --------------------------------------------------------------------------------------------------------
    def plan(self, limit: int) -> Ask:
        return self._choose(limit, self.overlap and self.ahead_pays())

    def plan_ahead(self, block: Block, limit: int) -> Ask:
        # A round without a block is a block of nothing accepted whole: with a free drafter the next block is
        # drafted ahead too, its first token a guess of the target's next one.
        if not (block.tokens or self.drafters.first_free is not None) or not self.overlap or not self.ahead_pays():
            return NOTHING
        if self.costs.quiet_due():
            return NOTHING  # one forward without an ask keeps the fit an ask's excess is measured against current
        return self._plan_during(limit, len(block.tokens), self.hit_probability(block))

    def _plan_during(self, limit: int, during: int, hit: float = 1.0) -> Ask:
        return self._choose(limit, True, during, hit)

    def _choose(self, limit: int, overlap: bool, during: int | None = None, hit: float = 1.0) -> Ask:
        """k of the paid drafter and, where it is asked at all, the free drafter's bound (asked with a paid
        drafter, a free one rides on its request: no round trip of its own)."""
        limit = min(max(limit, 0), self.k_max)  # the round's room (budget, context), within the session's bound
        k = self.ask(limit, overlap)
        free = self.drafters.first_free
        asked = free is not None and (k > 0 or self.ask_free(free, limit, during, hit))
        return Ask(k, limit if asked else 0)

    def ahead_pays(self) -> bool:
        """Whether drafting the next block during verification beats drafting it after. Free drafters cost
        nothing to draft ahead: a session with no paid drafter always does."""
        if self.drafters.paid is None:
            return True
        accept, draft_s = self.paid_acceptance(), self.costs.draft_s_per_token(self.drafters.paid)
        ahead, ahead_rate = self._best(accept, self.k_max, Shape.AHEAD, draft_s)
        _, sync_rate = self._best(accept, self.k_max, Shape.SYNC, draft_s)
        return ahead > 0 and ahead_rate >= sync_rate

    def _best(self, accept, limit: int, shape: Shape, draft_s: float = 0.0) -> tuple[int, float]:
        rounds = model.chain_rounds(self.costs, self.load, accept, limit, shape, draft_s)
        return model.best_k(accept, rounds, self.load.others_committed)

    def hit_probability(self, block: Block) -> float:
        """P(a block drafted ahead of ``block`` is used): its primary chain accepted whole and the bonus guessed
        (1 before its drafter has figures)."""
        if block.drafter is None:
            return 1.0
        chain = len(block.chain)
        return model.whole_probability(self.chain_acceptance(block)[: chain + 1], chain + 1)

    # -- a drafter that pays per token -------------------------------------------------------------------------------
    def paid_acceptance(self) -> list[float]:
        """P(position i passes | the positions before it passed), i = 1..k_max, of the paid drafter's blocks: this
        session's record shrunk towards every session's."""
        if self.drafters.paid is None:
            return [0.0] * self.k_max
        server = self.acceptance.acceptance(self.key(self.drafters.paid), self.k_max)
        w = self.session_weight
        return [(p + s * w) / (r + w) for p, r, s in zip(self._passed, self._reached, server)]

    def ask(self, limit: int, overlap: bool = False) -> int:
        """Tokens to ask of the paid drafter this round, in [0, min(k_max, limit)]; after rounds at 0, a probe of
        one token (a whole block while the drafter's price is unsettled), backing off server-wide where it never
        pays."""
        limit, paid = min(limit, self.k_max), self.drafters.paid
        if paid is None or limit <= 0:
            return 0
        accept, draft_s = self.paid_acceptance(), self.costs.draft_s_per_token(paid)
        k, _ = self._best(accept, limit, Shape.AHEAD if overlap else Shape.SYNC, draft_s)
        backoff = self.acceptance.backoff(self.key(paid))
        if k > 0:
            backoff.paid(self.probe_every)
            return k
        if not backoff.skip(self.probe_every, self.load.sessions):
            return 0
        if self.costs.draft_unsettled(paid):
            # a price resting on too few proposals (one may have spanned an outage) rules nothing out: a probe of a
            # whole block fetches a proposal that settles it (one token would be priced mostly by what any
            # proposal costs: the round trip's handling and the catch-up on tokens committed meanwhile)
            backoff.probed(self.probe_every, self._longest_interval)
            return limit
        # priced in the session's best mode, not only this round's: where overlap stopped because acceptance fell,
        # only a probe brings back the figures that start it again
        shape = Shape.AHEAD if overlap or self.overlap else Shape.SYNC
        if self._best([self.probe_alpha] * limit, limit, shape, draft_s)[0] > 0:
            backoff.probed(self.probe_every, self._longest_interval)
            return 1
        return 0

    # -- a free drafter ----------------------------------------------------------------------------------------------
    def ask_free(self, drafter: DrafterKind, limit: int, during: int | None = None, hit: float = 1.0) -> bool:
        """Whether to ask the free ``drafter`` for a block of up to ``limit`` tokens: when what its asks returned
        saves more than the ask costs. ``during``: the ask goes ahead, during the verification of a block of this
        many tokens, its block used with probability ``hit``; it goes only where cheaper than asking after."""
        limit = min(limit, self.k_max)
        if limit <= 0:
            return False
        costs, links = self.costs, self.costs.links
        compute_s = limit * costs.draft_s_per_token(drafter)
        during_s = None if during is None else costs.verify_s(self.load.tokens(during)) + links.target.srtt
        cost = model.ask_s(links, compute_s, during_s, costs.ahead_excess_s())
        needed = cost if during is None else (cost / hit if hit > 0 else float("inf"))
        saving = self.free_saving_s(drafter, limit, needed)
        if during is not None:
            return (saving is None or hit * saving > cost) and cost <= hit * model.ask_s(links, compute_s)
        backoff = self.acceptance.ask_backoff(self.key(drafter))  # server-wide: sessions may be short
        if saving is None or saving > cost:
            backoff.paid(self.probe_every)
            return True
        if not backoff.skip(self.probe_every, self.load.sessions):
            return False
        if self.saving_s([self.probe_alpha] * limit, limit) <= cost:
            return False
        backoff.probed(self.probe_every, self._longest_interval)
        return True

    def free_saving_s(self, drafter: DrafterKind, limit: int, needed: float | None = None) -> float | None:
        """Expected seconds an ask of the free ``drafter`` saves against a target-only step: the mean over what
        asks returned of each block's best cut; None before any ask returned. ``needed``: the caller only asks
        whether the saving exceeds this; where even blocks passing whole could not, that bound is returned without
        pricing each quality."""
        shares = self._returns.shares(self.acceptance.returns(self.key(drafter)), self.returns_weight)
        if not shares:
            return None
        found = {quality: share for quality, share in shares.items() if quality is not NO_BLOCK and share > 1e-3}
        rounds = self._rounds_in_hand(limit)  # the same for every quality: computed once a decision
        if needed is not None:
            bound = sum(found.values()) * self.saving_s([1.0] * limit, limit, rounds)
            if bound <= needed:
                return bound
        return sum(share * self.saving_s(self.free_acceptance(self.key(drafter, quality), limit), limit, rounds)
                   for quality, share in found.items())

    def saving_s(self, accept: list[float], limit: int, rounds: list[float] | None = None) -> float:
        """Seconds a block in hand with acceptance ``accept`` saves at its best cut against a target-only step."""
        rounds = rounds if rounds is not None else self._rounds_in_hand(limit)
        return model.best_saving_s(accept[:limit], rounds, self.load.others_committed)

    def _rounds_in_hand(self, limit: int) -> list[float]:
        """The round with a block in hand cut to k, for k = 0..limit."""
        return model.chain_rounds(self.costs, self.load, [], limit, Shape.IN_HAND)

    def returned(self, drafter: DrafterKind | None, quality: Quality | None) -> None:
        free = self.drafters.first_free
        if free is None:
            return
        quality = quality if drafter in self.drafters.free else NO_BLOCK
        self._returns.add(quality)
        self.acceptance.asked(self.key(free), quality)

    def free_acceptance(self, key: StatsKey, n: int) -> list[float]:
        """Acceptance of positions 1..n of a free block of ``key``: every session's figures scaled by
        ``free_scale``."""
        scale = self.free_scale()
        return [min(p * scale, 1.0) for p in self.acceptance.acceptance(key, n)]

    def free_scale(self) -> float:
        """This session's free blocks: positions passed over positions every session's figures predicted would
        pass, both shrunk by ``free_weight`` (1 before any block)."""
        w = self.free_weight
        return (self._free_passed + w) / (self._free_expected + w)

    # -- cut -----------------------------------------------------------------------------------------------------------
    def cut(self, block: Block) -> Block:
        """A free drafter's chain cut to the tokens worth verifying from its quality; a tree cut to the nodes worth
        verifying."""
        if block.drafter in self.drafters.free and block.probs is None and not block.parents:
            k = self.cut_k(self.key_of(block), len(block.tokens))
            second = block.second_guess if block.second_guess is not None and block.second_guess[0] < k else None
            return replace(block, tokens=block.tokens[:k], k=k, second_guess=second)
        if block.parents:
            return self._shape(block)
        return block

    def cut_k(self, key: StatsKey, available: int) -> int:
        """Tokens to verify of a free block of ``key`` with ``available`` tokens, in [0, available]. The block is in
        hand: only the target's forward weighs against the tokens it may add. A quality cut to nothing is verified
        for one token now and then, server-wide."""
        available = min(available, self.k_max)
        if available <= 0:
            return 0
        k, _ = self._best(self.free_acceptance(key, available), available, Shape.IN_HAND)
        backoff = self.acceptance.backoff(key)
        if k > 0:
            return k
        if backoff.skip(self.probe_every, self.load.sessions) and self._best(
                [self.probe_alpha] * available, available, Shape.IN_HAND)[0] > 0:
            backoff.probed(self.probe_every, self.probe_every)
            return 1
        return 0

    def _shape(self, block: Block) -> Block:
        """The nodes of a drafted tree worth verifying, by the same round model as a chain (the tree is in hand)."""
        siblings = self.measured.siblings_of(self.drafters.session)
        accept = model.node_acceptance(block.parents, self.chain_acceptance(block), siblings)
        links, costs = self.costs.links, self.costs

        def round_s(n: int) -> float:
            return model.round_s(Shape.IN_HAND, n, costs.verify_s(self.load.tokens(n)), 0.0, links)

        keep = model.choose_nodes(block.parents, accept, round_s, self.load.others_committed)
        tokens, parents = token_tree.subtree(block.tokens, block.parents, keep)
        return replace(block, tokens=tokens, parents=[] if token_tree.is_chain(parents) else parents)

    def chain_acceptance(self, block: Block) -> list[float]:
        """Per-depth acceptance of the drafter's first choices: the paid drafter's session record, else every
        session's figures of the block's drafter (a free one)."""
        key = self.key_of(block)
        if key is None or key.drafter is self.drafters.paid:
            return self.paid_acceptance()
        return self.acceptance.acceptance(key, self.k_max)

    # -- observe -------------------------------------------------------------------------------------------------------
    def record(self, key: StatsKey, drafted: int, accepted: int) -> None:
        if key.quality is not None and drafted > 0:  # a free block: how it did against every session's figures
            predicted = self.acceptance.acceptance(key, drafted)
            for i in range(min(drafted, accepted + 1)):
                self._free_expected = self._free_expected * self.free_decay + predicted[i]
                self._free_passed = self._free_passed * self.free_decay + (1 if i < accepted else 0)
        super().record(key, drafted, accepted)
        if key.drafter is not self.drafters.paid or key.quality is not None:
            return
        for i in range(min(drafted, accepted + 1, self.k_max)):  # positions the verifier looked at
            self._reached[i] = self._reached[i] * self.decay + 1
            self._passed[i] = self._passed[i] * self.decay + (1 if i < accepted else 0)
