"""Tests for target_service.rejection, levels 1 and 2 (level 3, statistics: tests/stats/test_rejection.py).

1. Hand-built distributions with exact expected tokens (and the edge cases).
2. Exact use of the draws passed in: uniforms[i, 0] tests draft token i, uniforms[i, 1] samples the token at i.
"""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.lmkit import draws
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams, logits_to_probs
from specsplit.target_service.rejection import (
    Verdict,
    verify_coupled,
    verify_coupled_rows,
    verify_draft_probs,
    verify_draft_probs_rows,
    verify_greedy,
    verify_token_only,
    verify_token_only_rows,
)

pytestmark = pytest.mark.unit


def tokens(*ids: int) -> torch.Tensor:  # [k] int64
    return torch.tensor(ids, dtype=torch.int64)


def probs(*rows: list[float]) -> torch.Tensor:  # [rows, vocab] float32
    return torch.tensor(rows, dtype=torch.float32)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def drawn(seed: int, k: int) -> torch.Tensor:  # [k+1, 2] float64: the draws of one block
    return torch.rand(k + 1, 2, dtype=torch.float64, generator=seeded(seed))


def test_modes_are_distinct_enum_members():
    assert {mode.value for mode in VerificationMode} == {1, 2, 3, 4}


# --- 1. hand-built cases: greedy ------------------------------------------------

# Row argmaxes: 2, 4, 1, 3.
GREEDY_LOGITS = probs(
    [0.0, 1.0, 5.0, 2.0, 0.0],
    [1.0, 0.0, 0.0, 0.0, 3.0],
    [0.0, 9.0, 1.0, 1.0, 1.0],
    [0.0, 0.0, 0.0, 7.0, 6.0],
)


@pytest.mark.parametrize(
    "draft, expected",
    [
        ((2, 4, 0), Verdict(accepted=2, next_token=1)),  # rejected at 2: correction = argmax of row 2
        ((2, 4, 1), Verdict(accepted=3, next_token=3)),  # all accepted: bonus = argmax of row k
        ((0, 4, 1), Verdict(accepted=0, next_token=2)),  # later matches do not count after a miss
        ((2, 0, 1), Verdict(accepted=1, next_token=4)),
    ],
)
def test_greedy_accepts_the_matching_prefix(draft, expected):
    assert verify_greedy(GREEDY_LOGITS, tokens(*draft)) == expected


def test_greedy_with_no_draft_is_plain_argmax_decoding():
    assert verify_greedy(GREEDY_LOGITS[:1], tokens()) == Verdict(accepted=0, next_token=2)


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = probs([1.0, 3.0, 3.0], [2.0, 2.0, 0.0])
    assert verify_greedy(logits, tokens(2)) == Verdict(accepted=0, next_token=1)
    assert verify_greedy(logits, tokens(1)) == Verdict(accepted=1, next_token=0)


def test_greedy_handles_banned_tokens_and_refuses_nan():
    logits = probs([-math.inf, 0.0, -1.0], [0.0, -math.inf, -math.inf])
    assert verify_greedy(logits, tokens(1)) == Verdict(accepted=1, next_token=0)
    with pytest.raises(ValueError, match="NaN"):
        verify_greedy(probs([0.0, math.nan], [0.0, 1.0]), tokens(1))


# --- 1. hand-built cases: token-only --------------------------------------------


def test_token_only_always_accepts_a_token_with_p_one():
    target = probs([0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0])
    for seed in range(300):
        assert verify_token_only(target, tokens(1, 3), drawn(seed, 2)) == Verdict(accepted=2, next_token=2)


def test_token_only_always_rejects_a_token_with_p_zero_and_never_returns_it():
    target = probs([0.0, 0.2, 0.8, 0.0], [0.25, 0.25, 0.25, 0.25])
    for seed in range(300):
        result = verify_token_only(target, tokens(3), drawn(seed, 1))
        assert result.accepted == 0 and result.next_token in (1, 2)


def test_token_only_recovers_from_p_without_the_rejected_token():
    target = probs([0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])
    outcomes = {verify_token_only(target, tokens(0), drawn(seed, 1)) for seed in range(300)}
    assert outcomes == {Verdict(accepted=1, next_token=0), Verdict(accepted=0, next_token=1)}


def test_token_only_falls_back_to_p_when_removing_x_leaves_nothing():
    # p(x) = 0.995 with no other mass (rows may miss 1 by rounding): rejection is rare, and then the
    # only token p allows is x itself.
    target = probs([0.995, 0.0, 0.0], [0.0, 0.0, 1.0])
    results = [verify_token_only(target, tokens(0), drawn(seed, 1)) for seed in range(3000)]
    assert {result.next_token for result in results if result.accepted == 0} == {0}
    assert {result.next_token for result in results if result.accepted == 1} == {2}


def test_token_only_with_no_draft_samples_the_bonus_from_row_zero():
    assert verify_token_only(probs([0, 0, 1.0]), tokens(), drawn(0, 0)) == Verdict(accepted=0, next_token=2)


# --- 1. hand-built cases: draft probabilities -----------------------------------


def test_draft_probs_always_accepts_where_p_is_at_least_q():
    target = probs([0.1, 0.6, 0.3], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0])
    draft = probs([0.4, 0.6, 0.0], [0.4, 0.6, 0.0])  # p(x) = q(x) at x = 1, then p(x) > q(x) at x = 0
    for seed in range(300):
        assert verify_draft_probs(target, draft, tokens(1, 0), drawn(seed, 2)) == Verdict(2, 2)


def test_draft_probs_recovers_only_from_the_support_of_p_minus_q():
    target = probs([0.4, 0.3, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0])
    draft = probs([0.1, 0.6, 0.1, 0.2])  # p(1)/q(1) = 0.5; max(0, p - q) = [0.3, 0, 0.2, 0]
    results = [verify_draft_probs(target, draft, tokens(1), drawn(seed, 1)) for seed in range(500)]
    assert {r.next_token for r in results if r.accepted == 0} == {0, 2}
    assert {r.next_token for r in results if r.accepted == 1} == {0}


def test_draft_probs_rejects_a_token_the_draft_gave_zero_probability():
    target = probs([0.5, 0.5, 0.0], [0.0, 1.0, 0.0])
    draft = probs([0.0, 0.5, 0.5])  # x = 0 has q = 0: a broken drafter, whatever p(x) says
    for seed in range(100):
        result = verify_draft_probs(target, draft, tokens(0), drawn(seed, 1))
        assert result.accepted == 0 and result.next_token in (0, 1)


def test_draft_probs_falls_back_to_p_when_the_residual_is_empty():
    # p == q, so max(0, p - q) == 0; the broken q(x) = 0 forces the rejection that cannot happen otherwise.
    same = probs([0.5, 0.5, 0.0])
    target = torch.cat([same, probs([0.0, 0.0, 1.0])])
    results = {verify_draft_probs(target, same, tokens(2), drawn(seed, 1)) for seed in range(100)}
    assert results == {Verdict(accepted=0, next_token=0), Verdict(accepted=0, next_token=1)}


def test_draft_probs_with_no_draft_samples_the_bonus_from_row_zero():
    result = verify_draft_probs(probs([0, 1.0, 0]), torch.zeros(0, 3), tokens(), drawn(0, 0))
    assert result == Verdict(accepted=0, next_token=1)


# --- 1. hand-built cases: coupled (Gumbel-max) -----------------------------------


def fixed_noise(rows: list[list[float]], asked: list[int] | None = None):
    """Gumbel noise given per row over the whole vocabulary; records which rows were asked for."""
    table = torch.tensor(rows, dtype=torch.float64)

    def noise(i: int, ids: torch.Tensor) -> torch.Tensor:
        if asked is not None:
            asked.append(i)
        return table[i, ids]

    return noise


def test_coupled_emits_argmax_of_log_p_plus_noise_and_accepts_only_that_token():
    target = probs([0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.4, 0.0])
    noise = fixed_noise([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    # Row 0: log .5 + 0 < log .3 + 1, so token 1. Row 1: argmax p = 2. Row 2: token 2 has p = 0, never chosen.
    assert verify_coupled(target, tokens(1, 2), noise) == Verdict(accepted=2, next_token=0)
    assert verify_coupled(target, tokens(0, 2), noise) == Verdict(accepted=0, next_token=1)
    assert verify_coupled(target, tokens(1, 0), noise) == Verdict(accepted=1, next_token=2)
    assert verify_coupled(target[:1], tokens(), noise) == Verdict(accepted=0, next_token=1)


def test_coupled_never_looks_past_the_first_mismatch():
    target = probs([0.5, 0.5], [0.5, 0.5], [0.5, 0.5])
    asked: list[int] = []
    verify_coupled(target, tokens(1, 1), fixed_noise([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], asked))
    assert asked == [0]


def test_coupled_rows_are_made_only_while_reached_and_the_verdict_is_the_whole_blocks():
    """The target's lazy path (a row's temperature and top-p made when the row is reached) decides as the
    eager one over the whole block, and makes rows 0..accepted only."""
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=3)
    logits = torch.randn(5, 40, generator=seeded(1)) * 3  # [k+1, vocab], k = 4
    noise = lambda i, ids: draws.gumbel(params.seed, draws.Stream.COUPLED, 100 + i, ids)  # noqa: E731
    eager = logits_to_probs(logits, params)
    chosen = [verify_coupled(eager[i : i + 1], tokens(), lambda _, ids, i=i: noise(i, ids)).next_token for i in range(5)]
    verdicts = set()
    for trial in range(30):
        block = tokens(*chosen[:4])
        if trial:  # a wrong token at a position drawn per trial, or none (accept-all)
            at = trial % 5
            block = tokens(*[(t + 1) % 40 if i == at else t for i, t in enumerate(chosen[:4])])
        made: list[int] = []

        def row(i: int, made: list[int] = made) -> torch.Tensor:
            made.append(i)
            return logits_to_probs(logits[i : i + 1], params)[0]

        verdict = verify_coupled_rows(row, block, 40, noise)
        assert verdict == verify_coupled(eager, block, noise)
        assert made == list(range(verdict.accepted + 1))
        verdicts.add(verdict.accepted)
    assert verdicts == {0, 1, 2, 3, 4}


def _eager_reference(target, draft, block, uniforms) -> Verdict:
    """The textbook rule over the whole block: accept while u_i < p_i(x_i) / q_i(x_i) (q = 1 for token-only),
    then sample the residual max(0, p - q) (token-only: p with x removed) or, all accepted, p_k."""
    u = uniforms.tolist()
    for i, x in enumerate(block.tolist()):
        q = 1.0 if draft is None else float(draft[i, x])
        if not u[i][0] * q < float(target[i, x]):
            p = target[i].double()
            residual = p.clone()
            if draft is None:
                residual[x] = 0.0
            else:
                residual = (p - draft[i].double()).clamp(min=0.0)
            return Verdict(i, draws.inverse_cdf(residual, u[i][1], fallback=p))
    return Verdict(len(block), draws.inverse_cdf(target[-1].double(), u[-1][1]))


@pytest.mark.parametrize("with_q", [False, True], ids=["token-only", "draft-probs"])
def test_token_only_and_draft_probs_rows_are_made_only_while_reached(with_q):
    """The target's lazy paths decide as the textbook rule over the whole block, and make rows 0..accepted."""
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=3)
    verdicts = set()
    for trial in range(200):
        logits = torch.randn(5, 12, generator=seeded(trial)) * 2  # [k+1, vocab], k = 4
        eager = logits_to_probs(logits, params)
        draft = torch.softmax(torch.randn(4, 12, generator=seeded(1000 + trial)), -1) if with_q else None
        block = eager[:4].argmax(-1) if trial % 3 else torch.randint(0, 12, (4,), generator=seeded(trial))
        uniforms = drawn(trial, 4)
        made: list[int] = []

        def row(i: int, made: list[int] = made, logits: torch.Tensor = logits) -> torch.Tensor:
            made.append(i)
            return logits_to_probs(logits[i : i + 1], params)[0]

        if with_q:
            verdict = verify_draft_probs_rows(row, draft, block, 12, uniforms)
            assert verdict == verify_draft_probs(eager, draft, block, uniforms)
        else:
            verdict = verify_token_only_rows(row, block, 12, uniforms)
            assert verdict == verify_token_only(eager, block, uniforms)
        assert verdict == _eager_reference(eager, draft, block, uniforms)
        assert made == list(range(verdict.accepted + 1))
        verdicts.add(verdict.accepted)
    assert verdicts == {0, 1, 2, 3, 4}


def test_coupled_rows_are_checked_where_they_are_made():
    block = tokens(0)
    with pytest.raises(ValueError, match="row 0 sums to 2.0"):
        verify_coupled_rows(lambda i: torch.tensor([1.0, 1.0]), block, 2, fixed_noise([[0, 0]] * 2))
    with pytest.raises(ValueError, match=r"row 1 must be a tensor \[vocab\]"):
        verify_coupled_rows(lambda i: torch.tensor([1.0, 0.0] if i == 0 else [1.0]), block, 2,
                            fixed_noise([[5.0, 0.0]] * 2))
    with pytest.raises(ValueError, match="token ids in"):
        verify_coupled_rows(lambda i: torch.tensor([1.0, 0.0]), tokens(2), 2, fixed_noise([[0, 0]] * 2))


def test_coupled_ties_go_to_the_lowest_token_id():
    target = probs([0.0, 0.5, 0.5])
    assert verify_coupled(target, tokens(), fixed_noise([[0.0, 0.0, 0.0]])) == Verdict(0, 1)


# --- 1. entry checks ------------------------------------------------------------

P3 = probs([0.2, 0.8], [0.5, 0.5], [1.0, 0.0])
Q2 = probs([0.5, 0.5], [0.5, 0.5])
U2 = drawn(0, 2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: verify_greedy(P3, tokens(0)), r"\[k\+1, vocab\] with k = 1"),
        (lambda: verify_greedy(P3, torch.tensor([0, 1], dtype=torch.int32)), "int64"),
        (lambda: verify_greedy(P3, torch.tensor([[0, 1]])), "1-D"),
        (lambda: verify_greedy(P3, tokens(0, 2)), r"token ids in \[0, 2\)"),
        (lambda: verify_greedy(P3, tokens(-1, 0)), r"token ids in \[0, 2\)"),
        (lambda: verify_greedy(P3.long(), tokens(0, 1)), "floating"),
        (lambda: verify_token_only(P3[:, :0], tokens(), U2), r"\[k\+1, vocab\]"),
        (lambda: verify_token_only(P3 * 3, tokens(0, 1), U2), "row 0 sums to 3.0"),
        (lambda: verify_token_only(P3, tokens(0, 1), None), r"uniforms must be a tensor \[k\+1, 2\]"),
        (lambda: verify_token_only(P3, tokens(0, 1), U2[:2]), r"uniforms must be a tensor \[k\+1, 2\]"),
        (lambda: verify_token_only(P3, tokens(0, 1), U2 + 1), r"uniforms must lie in \[0, 1\)"),
        (lambda: verify_token_only(P3, tokens(0, 1), U2 * math.nan), r"uniforms must lie in \[0, 1\)"),
        (lambda: verify_token_only(P3, tokens(0, 1), U2.long()), "uniforms must be floating point"),
        (lambda: verify_token_only(probs([1.2, -0.2], [0.5, 0.5], [1, 0]), tokens(1, 0), U2), "negative"),
        (lambda: verify_token_only(probs([math.nan, 1], [0.5, 0.5], [1, 0]), tokens(1, 0), U2), "sums to nan"),
        (lambda: verify_draft_probs(P3, Q2[:1], tokens(0, 1), U2), r"draft_probs must have shape"),
        (lambda: verify_draft_probs(P3, Q2.long(), tokens(0, 1), U2), "floating"),
        (lambda: verify_draft_probs(P3, Q2 * 2, tokens(0, 1), U2), "draft_probs row 0 sums to 2.0"),
        (lambda: verify_draft_probs(P3, probs([1.5, -0.5], [0.5, 0.5]), tokens(1, 0), U2), "negative"),
        (lambda: verify_coupled(P3 * 2, tokens(0, 1), fixed_noise([[0, 0]] * 3)), "row 0 sums to 2.0"),
        (lambda: verify_coupled(P3[:2], tokens(0, 1), fixed_noise([[0, 0]] * 3)), r"\[k\+1, vocab\]"),
    ],
)
def test_bad_inputs_are_refused_with_a_message(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- 2. exact use of the draws ----------------------------------------------------


def test_each_position_uses_its_own_two_draws():
    target = probs([0.3, 0.7, 0.0], [0.6, 0.4, 0.0], [0.2, 0.2, 0.6])
    draft = probs([0.5, 0.5, 0.0], [0.2, 0.8, 0.0])  # x = (0, 1): accept w.p. 0.6, then 0.5
    p_x, q_x = [float(target[0, 0]), float(target[1, 1])], [float(draft[0, 0]), float(draft[1, 1])]
    outcomes = set()
    for seed in range(300):
        u = drawn(seed, 2).tolist()
        if not u[0][0] * q_x[0] < p_x[0]:
            expected = Verdict(0, 1)  # max(0, p - q) = [0, 0.2, 0]: any u[0][1] gives token 1
        elif not u[1][0] * q_x[1] < p_x[1]:
            expected = Verdict(1, 0)  # max(0, p - q) = [0.4, 0, 0]
        else:
            expected = Verdict(2, 0 if u[2][1] < 0.2 else 1 if u[2][1] < 0.4 else 2)  # bonus from row 2
        assert verify_draft_probs(target, draft, tokens(0, 1), drawn(seed, 2)) == expected
        outcomes.add(expected)
    assert len(outcomes) == 5  # every branch was taken


def test_a_rejection_decision_and_its_recovered_token_follow_the_draws_exactly():
    target = probs([0.3, 0.4, 0.3], [0.5, 0.5, 0.0])
    for seed in range(200):
        u = drawn(seed, 1).tolist()
        result = verify_token_only(target, tokens(1), drawn(seed, 1))
        if u[0][0] < float(target[0, 1]):
            assert result.accepted == 1 and result.next_token == (0 if u[1][1] < 0.5 else 1)
        else:  # p without token 1 is [0.5, 0, 0.5] after renormalising: u[0][1] picks
            assert result == Verdict(accepted=0, next_token=0 if u[0][1] < 0.5 else 2)


def test_draws_of_positions_not_reached_change_nothing():
    target = probs([0.1, 0.9], [0.5, 0.5], [0.5, 0.5])
    for seed in range(100):
        u = drawn(seed, 2)
        result = verify_token_only(target, tokens(0, 1), u)
        if result.accepted == 0:  # rejected at 0: rows 1 and 2 were never reached
            other = u.clone()
            other[1:] = torch.rand(2, 2, dtype=torch.float64, generator=seeded(seed + 1000))
            assert verify_token_only(target, tokens(0, 1), other) == result


DET_TARGET = torch.softmax(torch.randn(4, 12, generator=seeded(1)), dim=-1)
DET_DRAFT = torch.softmax(torch.randn(3, 12, generator=seeded(2)), dim=-1)


@pytest.mark.parametrize(
    "verify",
    [
        lambda u: verify_token_only(DET_TARGET, tokens(3, 7, 1), u),
        lambda u: verify_draft_probs(DET_TARGET, DET_DRAFT, tokens(3, 7, 1), u),
    ],
    ids=["token_only", "draft_probs"],
)
def test_same_draws_same_results_different_draws_different_results(verify):
    first = [verify(drawn(seed, 3)) for seed in range(200)]
    assert [verify(drawn(seed, 3)) for seed in range(200)] == first
    assert [verify(drawn(seed, 3)) for seed in range(200, 400)] != first
    assert len(set(first)) > 3  # the outcomes really vary from draw to draw
