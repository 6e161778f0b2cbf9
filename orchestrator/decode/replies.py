"""What the services answer a round, as the loop reads it: a ``DraftedBlock`` and a ``VerifiedBlock``
(and what a draft reply cost, ``DraftReplyCost``).

The links make these from the messages where they arrive (``drafted_of``,
``verified_of``); the loop and the policy read them and never a protobuf field,
so a round reads as the algorithm and the .proto can change under it. What the
loop only carries on (the drafter's distributions to the target, the target's
features and successors to the draft, the target's logprobs to the front) stays
as it came, opaque here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specsplit.lmkit.kinds import DrafterKind
from specsplit.v1 import specsplit_pb2 as pb


@dataclass(frozen=True, slots=True)
class DraftedBlock:
    """A draft's block as it came (``DraftBlock``), before the loop cuts or fits it."""

    position: int  # where the block starts: committed + assumed tokens it continues
    tokens: list[int]
    parents: list[int] = field(default_factory=list)  # a token tree's (``lmkit.token_tree``); empty: a chain
    probs: object | None = None  # the drafter's distributions of its tokens (DraftProbs), carried to the target
    second_guess: tuple[int, int] | None = None  # a chain's (index, runner-up) where its drafter is least sure
    match: tuple[int, int] | None = None  # a copying drafter's (match length, earlier occurrences)
    drafter: DrafterKind | None = None  # the chain member that drafted it; None: the session's own drafter
    compute_s: float = 0.0  # the draft's compute for it (a session's first: its read of the context included)
    service_s: float = 0.0  # the draft's time on it, receipt to answer
    read_s: float = 0.0  # of which reading the context (a session's first; 0: not reported)


@dataclass(frozen=True, slots=True)
class VerifiedBlock:
    """The target's decision on a block (``VerifyResult``), and what it reports of the forward that made it."""

    position: int
    accepted: int  # draft tokens accepted: a chain's first ``accepted``, a tree's ``path``
    next_token: int  # the correction or bonus token after them
    path: list[int] = field(default_factory=list)  # a tree's accepted nodes, root to leaf; empty for a chain
    compute_s: float = 0.0  # the whole (shared) forward's compute
    service_s: float = 0.0  # the target's time on this block, receipt to answer
    forward_s: float = 0.0  # the model's forward alone
    batch_size: int = 0  # sessions in the forward (0: not reported)
    batch_width: int = 0  # its widest row
    batch_tokens: int = 0  # tokens it computed over, every row's
    batch_packed: bool = False  # rows packed (each its own width), not padded to the widest
    others_committed: int = 0  # tokens the other sessions of the forward committed
    cost_fit: tuple[float, float] = (0.0, 0.0)  # the target's fit t(x) = a + s x of its forwards, seconds
    logprobs: Sequence[object] = ()  # TokenLogprob per committed token, when the session asked (for the front)
    features: object | None = None  # HiddenFeatures of committed positions, for a feature drafter
    feature_bytes: int = 0  # their size
    successors: object | None = None  # Successors of verified positions, for a recycling drafter


@dataclass(frozen=True, slots=True)
class DraftReplyCost:
    """What one draft reply cost, as the draft link saw it come (late replies too), for the controller."""

    block: DraftedBlock
    wall_s: float | None  # request to reply, here; None: sent behind a request still on its way (see DraftLink)
    read: tuple[int, float] | None = None  # a session's first: (context tokens, seconds the draft spent reading)


def drafter_kind(value: int) -> DrafterKind | None:
    """The drafter a reply names; None when it names none or a kind the draft did not announce."""
    try:
        return DrafterKind(value) if value else None
    except ValueError:
        return None


def drafter_of(drafted: DraftedBlock, session_drafter: DrafterKind | None) -> DrafterKind | None:
    """The drafter that drafted a block: the chain member it names, else the session's."""
    return drafted.drafter or session_drafter


def drafted_of(reply: pb.DraftBlock) -> DraftedBlock:
    return DraftedBlock(
        position=reply.position,
        tokens=list(reply.tokens),
        parents=list(reply.parents),
        probs=reply.probs if reply.HasField("probs") else None,
        second_guess=(reply.second_guess.index, reply.second_guess.token) if reply.HasField("second_guess") else None,
        match=(reply.quality.length, reply.quality.occurrences) if reply.HasField("quality") else None,
        drafter=drafter_kind(reply.drafter),
        compute_s=reply.timing.compute_us / 1e6,
        service_s=reply.timing.service_us / 1e6,
        read_s=reply.timing.read_us / 1e6,
    )


def verified_of(result: pb.VerifyResult) -> VerifiedBlock:
    forward = result.forward
    return VerifiedBlock(
        position=result.position,
        accepted=result.accepted,
        next_token=result.next_token,
        path=list(result.path),
        compute_s=result.timing.compute_us / 1e6,
        service_s=result.timing.service_us / 1e6,
        forward_s=result.timing.forward_us / 1e6,
        batch_size=forward.batch_size,
        batch_width=forward.batch_width,
        batch_tokens=forward.batch_tokens,
        batch_packed=forward.batch_packed,
        others_committed=forward.others_committed,
        cost_fit=(forward.cost_base_us / 1e6, forward.cost_per_token_us / 1e6),
        logprobs=tuple(result.logprobs),
        features=result.features if result.HasField("features") else None,
        feature_bytes=len(result.features.values),
        successors=result.successors if result.HasField("successors") else None,
    )
