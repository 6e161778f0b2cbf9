"""The round model: what a speculative round brings and what it costs, by the shape of the round.

Pure functions of the measurements (``policy.measure``): expected tokens per
target pass from per-position acceptance (Leviathan et al. 2023, sec. 3.3), the
time of a round by its shape (target-only, sync, drafted ahead during the
previous verification, a free block in hand) including both links' round trips
and jitter (Clark 1961 for E[max] of two normal legs), the rate of a block over
every session of a batched forward, the saving of a block or an ask, and the
token tree worth verifying (SpecInfer, Sequoia, EAGLE-2). Every formula is
written out in docs/design.md, "The round model". Pure: no I/O.
"""

from __future__ import annotations

import enum
import math
from typing import Callable, Sequence

from specsplit.lmkit import token_tree
from specsplit.orchestrator.decode.policy.measure import Costs, Links, Load, RttEstimator, SiblingStats

DEADLINE_FLOOR_S = 0.002  # a deadline is never shorter: scheduling noise on a busy host is ~1 ms
DEADLINE_SLACK = 0.5  # and allows half the expected time again (draft compute varies with context)


class Shape(enum.Enum):
    """How a round's block comes to be (with k = 0 every shape is a target-only step)."""

    TARGET_ONLY = 1  # no draft call at all
    SYNC = 2  # draft, then verify
    AHEAD = 3  # the next block drafted during this verification (overlap)
    IN_HAND = 4  # a free block already drafted, being cut to k: its draft round trip is paid whatever k is


# -- what a block brings -------------------------------------------------------------------------------------------
def expected_tokens(alpha: float, k: int) -> float:
    """E(k): committed tokens per target pass for i.i.d. acceptance alpha (Leviathan eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_by_position(accept: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} accept[j-1]: ``expected_tokens`` when every entry is alpha."""
    total, run = 1.0, 1.0
    for p in accept[:k]:
        run *= p
        total += run
    return total


def whole_probability(accept: Sequence[float], n: int) -> float:
    """P(the first n positions all pass); positions past the list repeat its last entry."""
    whole = 1.0
    for i in range(n):
        whole *= accept[min(i, len(accept) - 1)] if accept else 0.0
    return whole


# -- what a round costs --------------------------------------------------------------------------------------------
def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def expected_max(mean_a: float, sigma_a: float, mean_b: float, sigma_b: float) -> float:
    """E[max(A, B)] for independent normal A and B (Clark 1961, eq. 2)."""
    theta = math.hypot(sigma_a, sigma_b)
    if theta < 1e-12:
        return max(mean_a, mean_b)
    alpha = (mean_a - mean_b) / theta
    density = math.exp(-alpha * alpha / 2) / math.sqrt(2 * math.pi)
    return mean_a * normal_cdf(alpha) + mean_b * normal_cdf(-alpha) + theta * density


def round_s(shape: Shape, k: int, verify_s: float, draft_token_s: float, links: Links, hit: float = 1.0,
            excess_s: float = 0.0) -> float:
    """Expected wall time of a round whose forward takes ``verify_s`` and whose block has k tokens drafted at
    ``draft_token_s`` each. ``hit``: P(a block drafted ahead is used: this one accepted whole, the bonus guessed);
    ``excess_s``: what an ask during the forward slows it by (``Costs.ahead_excess_s``)."""
    target = verify_s + links.target.srtt
    if k == 0 or shape in (Shape.TARGET_ONLY, Shape.IN_HAND):
        return target
    if shape is Shape.SYNC:
        return target + links.draft.srtt + k * draft_token_s
    ahead = links.draft.srtt + (k + 1) * draft_token_s
    paced = expected_max(target + excess_s, links.target.sigma, ahead, links.draft.sigma)
    return paced + (1.0 - hit) * (links.draft.srtt + k * draft_token_s)


def chain_rounds(costs: Costs, load: Load, accept: Sequence[float], limit: int, shape: Shape,
                 draft_token_s: float = 0.0) -> list[float]:
    """``round_s`` of a chain block of k = 0..limit under ``load`` (its acceptance gives each k's hit)."""
    excess = costs.ahead_excess_s()
    return [round_s(shape, k, costs.verify_s(load.tokens(k)), draft_token_s, costs.links,
                    whole_probability(accept, k + 1), excess) for k in range(limit + 1)]


def ask_s(links: Links, compute_s: float, during_s: float | None = None, excess_s: float = 0.0) -> float:
    """What an ask of a drafter computing for ``compute_s`` adds to a round: before its verification
    (``during_s`` None), the draft's round trip and its deviation; sent ahead during a verification whose leg takes
    ``during_s``, what it slows that verification by and what of it outlasts the verification."""
    ask = links.draft.srtt + compute_s
    if during_s is None:
        return ask + links.draft.rttvar
    return expected_max(during_s + excess_s, links.target.sigma, ask, links.draft.sigma) - during_s


def two_requests_fit(links: Links, tokens: int, verify_s: float, draft_token_s: float) -> bool:
    """Whether two draft requests in a row, ``tokens`` tokens in all, come back before a verification (a second
    one then costs the round nothing: the draft would otherwise wait)."""
    return 2 * links.draft.srtt + tokens * draft_token_s <= verify_s + links.target.srtt


def deadline_s(link: RttEstimator, expected_s: float, slack: float = DEADLINE_SLACK) -> float:
    """How long to wait for a call expected to take ``expected_s`` beyond the link's round trip, allowing
    ``slack`` of it again and four deviations (RFC 6298's RTO), never under ``DEADLINE_FLOOR_S``."""
    return max(link.srtt + expected_s * (1 + slack) + 4 * link.rttvar, DEADLINE_FLOOR_S)


# -- what pays best ------------------------------------------------------------------------------------------------
def rate(expected: float, seconds: float, others: float = 0.0) -> float:
    """Committed tokens per second over every session in the forward (``others``: what the other rows commit)."""
    return (others + expected) / seconds


def best_k(accept: Sequence[float], rounds: Sequence[float], others: float = 0.0) -> tuple[int, float]:
    """(k, its rate) of the chain block with the highest rate, k in [0, len(rounds) - 1], given each k's round time
    (ties: the smaller k)."""
    rates = [rate(expected_tokens_by_position(accept, k), seconds, others) for k, seconds in enumerate(rounds)]
    k = max(range(len(rates)), key=lambda i: (rates[i], -i))
    return k, rates[k]


def best_saving_s(accept: Sequence[float], rounds: Sequence[float], others: float = 0.0) -> float:
    """Seconds a block in hand with per-position acceptance ``accept`` saves at its best cut against a target-only
    step (``rounds[0]``), given each cut's round time: the best over k of (G + E(k)) T_0 / (G + 1) - T(k), never
    below 0 (k = 0 saves nothing)."""
    best, expected, run, step = 0.0, 1.0, 1.0, rounds[0]
    for k, p in enumerate(accept[: len(rounds) - 1], start=1):
        run *= p
        expected += run
        best = max(best, (others + expected) * step / (others + 1.0) - rounds[k])
    return best


# -- token trees ---------------------------------------------------------------------------------------------------
def path_probabilities(parents: Sequence[int], accept: Sequence[float]) -> list[float]:
    """P_i: the probability that node i and all its ancestors are accepted."""
    out: list[float] = []
    for parent, a in zip(parents, accept):
        out.append(a * (1.0 if parent == token_tree.ROOT else out[parent]))
    return out


def node_acceptance(parents: Sequence[int], chain: Sequence[float], siblings: SiblingStats) -> list[float]:
    """a_i per node: ``chain[depth]`` for a first child (its last entry beyond), ``siblings`` for later ones."""
    out = []
    for rank, depth in zip(token_tree.ranks(parents), token_tree.depths(parents)):
        if rank == 0:
            out.append(chain[min(depth, len(chain) - 1)] if chain else siblings.prior)
        else:
            out.append(siblings.acceptance(rank, depth))
    return out


def choose_nodes(
    parents: Sequence[int],
    accept: Sequence[float],  # [n] a_i, each in [0, 1]
    round_s: Callable[[int], float],  # the round verifying this many of the tree's nodes (in hand)
    others: float = 0.0,
) -> list[int]:
    """The nodes worth verifying (closed under ancestors, ascending); empty when no draft pays. The n nodes of
    largest path probability form a tree, the tree of n nodes with the largest E; of those the n with the best
    rate is kept."""
    if len(accept) != len(parents):
        raise ValueError(f"{len(accept)} acceptance estimates for {len(parents)} nodes")
    if any(not 0.0 <= a <= 1.0 for a in accept):
        raise ValueError("acceptance estimates must be probabilities in [0, 1]")
    probs = path_probabilities(parents, accept)
    order = sorted(range(len(parents)), key=lambda i: (-probs[i], i))  # a parent before its equally likely child
    best_n, best_rate, expected = 0, rate(1.0, round_s(0), others), 1.0
    for n, node in enumerate(order, start=1):
        expected += probs[node]
        candidate = rate(expected, round_s(n), others)
        if candidate > best_rate:
            best_n, best_rate = n, candidate
    return sorted(order[:best_n])
