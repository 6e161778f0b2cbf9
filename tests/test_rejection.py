"""Tests for target_service.rejection at three levels.

1. Hand-built distributions with exact expected tokens (and the edge cases).
2. Seeded determinism, and exactly k + 1 uniforms consumed per call.
3. Statistics: a full speculative loop over toy bigram models emits tokens
   distributed exactly as the target's own sampling (chi-square and total
   variation against the exact joint), and deliberately wrong samplers run
   through the same helper are caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lmkit.probs_codec import decode_probs, encode_probs, quantize_probs
from target_service.rejection import (
    VerificationMode,
    VerifyResult,
    verify_draft_probs,
    verify_greedy,
    verify_token_only,
)


def tokens(*ids: int) -> torch.Tensor:  # [k] int64
    return torch.tensor(ids, dtype=torch.int64)


def probs(*rows: list[float]) -> torch.Tensor:  # [rows, vocab] float32
    return torch.tensor(rows, dtype=torch.float32)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_modes_are_distinct_enum_members():
    assert {mode.value for mode in VerificationMode} == {1, 2, 3}


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
        ((2, 4, 0), VerifyResult(accepted=2, next_token=1)),  # rejected at 2: correction = argmax of row 2
        ((2, 4, 1), VerifyResult(accepted=3, next_token=3)),  # all accepted: bonus = argmax of row k
        ((0, 4, 1), VerifyResult(accepted=0, next_token=2)),  # later matches do not count after a miss
        ((2, 0, 1), VerifyResult(accepted=1, next_token=4)),
    ],
)
def test_greedy_accepts_the_matching_prefix(draft, expected):
    assert verify_greedy(GREEDY_LOGITS, tokens(*draft)) == expected


def test_greedy_with_no_draft_is_plain_argmax_decoding():
    assert verify_greedy(GREEDY_LOGITS[:1], tokens()) == VerifyResult(accepted=0, next_token=2)


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = probs([1.0, 3.0, 3.0], [2.0, 2.0, 0.0])
    assert verify_greedy(logits, tokens(2)) == VerifyResult(accepted=0, next_token=1)
    assert verify_greedy(logits, tokens(1)) == VerifyResult(accepted=1, next_token=0)


def test_greedy_handles_banned_tokens_and_refuses_nan():
    logits = probs([-math.inf, 0.0, -1.0], [0.0, -math.inf, -math.inf])
    assert verify_greedy(logits, tokens(1)) == VerifyResult(accepted=1, next_token=0)
    with pytest.raises(ValueError, match="NaN"):
        verify_greedy(probs([0.0, math.nan], [0.0, 1.0]), tokens(1))


# --- 1. hand-built cases: token-only --------------------------------------------


def test_token_only_always_accepts_a_token_with_p_one():
    target = probs([0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0])
    for seed in range(300):
        assert verify_token_only(target, tokens(1, 3), seeded(seed)) == VerifyResult(accepted=2, next_token=2)


def test_token_only_always_rejects_a_token_with_p_zero_and_never_returns_it():
    target = probs([0.0, 0.2, 0.8, 0.0], [0.25, 0.25, 0.25, 0.25])
    for seed in range(300):
        result = verify_token_only(target, tokens(3), seeded(seed))
        assert result.accepted == 0 and result.next_token in (1, 2)


def test_token_only_recovers_from_p_without_the_rejected_token():
    target = probs([0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])
    outcomes = {verify_token_only(target, tokens(0), seeded(seed)) for seed in range(300)}
    assert outcomes == {VerifyResult(accepted=1, next_token=0), VerifyResult(accepted=0, next_token=1)}


def test_token_only_falls_back_to_p_when_removing_x_leaves_nothing():
    # p(x) = 0.995 with no other mass (rows may miss 1 by rounding): rejection is rare, and then the
    # only token p allows is x itself.
    target = probs([0.995, 0.0, 0.0], [0.0, 0.0, 1.0])
    results = [verify_token_only(target, tokens(0), seeded(seed)) for seed in range(3000)]
    assert {result.next_token for result in results if result.accepted == 0} == {0}
    assert {result.next_token for result in results if result.accepted == 1} == {2}


def test_token_only_with_no_draft_samples_the_bonus_from_row_zero():
    assert verify_token_only(probs([0, 0, 1.0]), tokens(), seeded(0)) == VerifyResult(accepted=0, next_token=2)


# --- 1. hand-built cases: draft probabilities -----------------------------------


def test_draft_probs_always_accepts_where_p_is_at_least_q():
    target = probs([0.1, 0.6, 0.3], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0])
    draft = probs([0.4, 0.6, 0.0], [0.4, 0.6, 0.0])  # p(x) = q(x) at x = 1, then p(x) > q(x) at x = 0
    for seed in range(300):
        assert verify_draft_probs(target, draft, tokens(1, 0), seeded(seed)) == VerifyResult(2, 2)


def test_draft_probs_recovers_only_from_the_support_of_p_minus_q():
    target = probs([0.4, 0.3, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0])
    draft = probs([0.1, 0.6, 0.1, 0.2])  # p(1)/q(1) = 0.5; max(0, p - q) = [0.3, 0, 0.2, 0]
    results = [verify_draft_probs(target, draft, tokens(1), seeded(seed)) for seed in range(500)]
    assert {r.next_token for r in results if r.accepted == 0} == {0, 2}
    assert {r.next_token for r in results if r.accepted == 1} == {0}


def test_draft_probs_rejects_a_token_the_draft_gave_zero_probability():
    target = probs([0.5, 0.5, 0.0], [0.0, 1.0, 0.0])
    draft = probs([0.0, 0.5, 0.5])  # x = 0 has q = 0: a broken drafter, whatever p(x) says
    for seed in range(100):
        result = verify_draft_probs(target, draft, tokens(0), seeded(seed))
        assert result.accepted == 0 and result.next_token in (0, 1)


def test_draft_probs_falls_back_to_p_when_the_residual_is_empty():
    # p == q, so max(0, p - q) == 0; the broken q(x) = 0 forces the rejection that cannot happen otherwise.
    same = probs([0.5, 0.5, 0.0])
    target = torch.cat([same, probs([0.0, 0.0, 1.0])])
    results = {verify_draft_probs(target, same, tokens(2), seeded(seed)) for seed in range(100)}
    assert results == {VerifyResult(accepted=0, next_token=0), VerifyResult(accepted=0, next_token=1)}


def test_draft_probs_with_no_draft_samples_the_bonus_from_row_zero():
    result = verify_draft_probs(probs([0, 1.0, 0]), torch.zeros(0, 3), tokens(), seeded(0))
    assert result == VerifyResult(accepted=0, next_token=1)


# --- 1. entry checks ------------------------------------------------------------

P3 = probs([0.2, 0.8], [0.5, 0.5], [1.0, 0.0])
Q2 = probs([0.5, 0.5], [0.5, 0.5])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: verify_greedy(P3, tokens(0)), r"\[k\+1, vocab\] with k = 1"),
        (lambda: verify_greedy(P3, torch.tensor([0, 1], dtype=torch.int32)), "int64"),
        (lambda: verify_greedy(P3, torch.tensor([[0, 1]])), "1-D"),
        (lambda: verify_greedy(P3, tokens(0, 2)), r"token ids in \[0, 2\)"),
        (lambda: verify_greedy(P3, tokens(-1, 0)), r"token ids in \[0, 2\)"),
        (lambda: verify_greedy(P3.long(), tokens(0, 1)), "floating"),
        (lambda: verify_token_only(P3[:, :0], tokens(), seeded(0)), r"\[k\+1, vocab\]"),
        (lambda: verify_token_only(P3 * 3, tokens(0, 1), seeded(0)), "row 0 sums to 3.0"),
        (lambda: verify_token_only(P3, tokens(0, 1), None), "CPU torch.Generator"),
        (lambda: verify_token_only(probs([1.2, -0.2], [0.5, 0.5], [1, 0]), tokens(1, 0), seeded(0)), "negative"),
        (lambda: verify_token_only(probs([math.nan, 1], [0.5, 0.5], [1, 0]), tokens(1, 0), seeded(0)), "sums to nan"),
        (lambda: verify_draft_probs(P3, Q2[:1], tokens(0, 1), seeded(0)), r"draft_probs must have shape"),
        (lambda: verify_draft_probs(P3, Q2.long(), tokens(0, 1), seeded(0)), "floating"),
        (lambda: verify_draft_probs(P3, Q2 * 2, tokens(0, 1), seeded(0)), "draft_probs row 0 sums to 2.0"),
        (lambda: verify_draft_probs(P3, probs([1.5, -0.5], [0.5, 0.5]), tokens(1, 0), seeded(0)), "negative"),
    ],
)
def test_bad_inputs_are_refused_with_a_message(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- 2. exact draws and determinism ---------------------------------------------


def test_the_draws_are_k_plus_one_uniforms_used_in_order():
    target = probs([0.3, 0.7, 0.0], [0.6, 0.4, 0.0], [0.2, 0.2, 0.6])
    draft = probs([0.5, 0.5, 0.0], [0.2, 0.8, 0.0])  # x = (0, 1): accept w.p. 0.6, then 0.5
    p_x, q_x = [float(target[0, 0]), float(target[1, 1])], [float(draft[0, 0]), float(draft[1, 1])]
    outcomes = set()
    for seed in range(300):
        u = torch.rand(3, dtype=torch.float64, generator=seeded(seed)).tolist()
        if not u[0] * q_x[0] < p_x[0]:
            expected = VerifyResult(0, 1)  # max(0, p - q) = [0, 0.2, 0]
        elif not u[1] * q_x[1] < p_x[1]:
            expected = VerifyResult(1, 0)  # max(0, p - q) = [0.4, 0, 0]
        else:
            expected = VerifyResult(2, 0 if u[2] < 0.2 else 1 if u[2] < 0.4 else 2)  # bonus from row 2
        generator = seeded(seed)
        assert verify_draft_probs(target, draft, tokens(0, 1), generator) == expected
        outcomes.add(expected)
        # Exactly k + 1 = 3 float64 uniforms consumed, whatever the outcome.
        reference = seeded(seed)
        torch.rand(3, dtype=torch.float64, generator=reference)
        assert torch.equal(generator.get_state(), reference.get_state())
    assert len(outcomes) == 5  # every branch was taken


def test_a_rejection_decision_follows_the_uniform_exactly():
    target = probs([0.3, 0.7], [0.5, 0.5])
    for seed in range(200):
        u = torch.rand(2, dtype=torch.float64, generator=seeded(seed)).tolist()
        result = verify_token_only(target, tokens(1), seeded(seed))
        if u[0] < float(target[0, 1]):
            assert result.accepted == 1 and result.next_token == (0 if u[1] < 0.5 else 1)
        else:
            assert result == VerifyResult(accepted=0, next_token=0)  # p without token 1 is all on 0


def run_many(verify: Callable[[torch.Generator], VerifyResult], seed: int, calls: int = 200) -> list[VerifyResult]:
    generator = seeded(seed)
    return [verify(generator) for _ in range(calls)]


DET_TARGET = torch.softmax(torch.randn(4, 12, generator=seeded(1)), dim=-1)
DET_DRAFT = torch.softmax(torch.randn(3, 12, generator=seeded(2)), dim=-1)


@pytest.mark.parametrize(
    "verify",
    [
        lambda g: verify_token_only(DET_TARGET, tokens(3, 7, 1), g),
        lambda g: verify_draft_probs(DET_TARGET, DET_DRAFT, tokens(3, 7, 1), g),
    ],
    ids=["token_only", "draft_probs"],
)
def test_same_seed_same_results_different_seed_different_results(verify):
    first = run_many(verify, seed=5)
    assert run_many(verify, seed=5) == first
    assert run_many(verify, seed=6) != first
    assert len(set(first)) > 3  # the outcomes really vary from call to call


# --- 3. statistics: a full speculative loop on toy bigram models ----------------

VOCAB = 6
K = 2  # with 3 emitted tokens, the joint covers rejections at both positions, the bonus, and a second round
EMITTED = 3
TRIALS = 100_000
START = 0


def bigram_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # two [VOCAB, VOCAB] float32
    """Random p(next | prev) and a draft q that approximates it, each with ~20% zeros of its own.

    The draft's logits are the target's plus noise (a small model imitating a big one); the zero
    masks differ so that some drafted tokens have p = 0 and some target mass only the residual reaches.
    """
    generator = seeded(seed)

    def banned() -> torch.Tensor:
        mask = torch.rand(VOCAB, VOCAB, generator=generator) < 0.2
        mask[:, :2] = False  # at least two possible tokens per row, wherever the permutation puts them
        return mask[:, torch.randperm(VOCAB, generator=generator)]

    logits = torch.randn(VOCAB, VOCAB, generator=generator) * 3.0
    target = torch.softmax(logits.masked_fill(banned(), -math.inf), dim=-1)
    noisy = logits + torch.randn(VOCAB, VOCAB, generator=generator) * 0.6
    return target, torch.softmax(noisy.masked_fill(banned(), -math.inf), dim=-1)


TARGET, DRAFT = bigram_tables(seed=14)


def exact_joint(table: torch.Tensor) -> np.ndarray:  # -> [VOCAB, VOCAB, VOCAB] float64
    """P(first three tokens after START) under sampling from `table` alone."""
    p = table.double().numpy()
    p = p / p.sum(axis=1, keepdims=True)
    return p[START][:, None, None] * p[:, :, None] * p[None, :, :]


Drafter = Callable[[np.ndarray, np.random.Generator], np.ndarray]  # last tokens [m] -> draft blocks [m, K]
# (target_probs [K+1, VOCAB], draft block [K], context id into ALL_CONTEXTS, generator) -> result
Verifier = Callable[[torch.Tensor, torch.Tensor, int, torch.Generator], VerifyResult]


def sampling_drafter(table: torch.Tensor) -> Drafter:
    """A stochastic drafter: each token drawn from table[prev] by inverse CDF, for all trials at once."""
    cdf = np.cumsum(table.double().numpy(), axis=1)
    cdf /= cdf[:, -1:]  # the last token with mass gets exactly 1.0, so u < 1 never lands past it

    def draft(last: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        block, prev = np.empty((len(last), K), dtype=np.int64), last
        for i in range(K):
            prev = (cdf[prev] <= rng.random(len(last))[:, None]).sum(axis=1)
            block[:, i] = prev
        return block

    return draft


def argmax_drafter(table: torch.Tensor) -> Drafter:
    """A deterministic drafter (like n-gram lookup): the block is a fixed function of the context."""
    best = table.argmax(dim=1).numpy()

    def draft(last: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        block, prev = np.empty((len(last), K), dtype=np.int64), last
        for i in range(K):
            prev = best[prev]
            block[:, i] = prev
        return block

    return draft


# Every (previous token, block) a round can see, precomputed so the loop's per-call cost is the verifier's.
ALL_CONTEXTS = torch.cartesian_prod(*[torch.arange(VOCAB)] * (K + 1))  # [VOCAB**(K+1), K+1]
TARGET_BLOCKS = list(TARGET[ALL_CONTEXTS])  # [K+1, VOCAB] per context: row i is p(. | token before position i)
DRAFT_BLOCKS = list(ALL_CONTEXTS[:, 1:])  # [K] int64 per context: the drafted tokens


def speculative_samples(drafter: Drafter, verify: Verifier, seed: int) -> np.ndarray:  # -> [TRIALS, EMITTED]
    """Runs TRIALS independent sessions from START until each has emitted EMITTED tokens.

    Trials advance in lockstep so drafting is vectorised; every verification
    is one real call on one trial's block.
    """
    rng, generator = np.random.default_rng(seed), seeded(seed)
    emitted = np.full((TRIALS, EMITTED), -1, dtype=np.int64)
    filled = np.zeros(TRIALS, dtype=np.int64)
    last = np.full(TRIALS, START, dtype=np.int64)
    while (active := np.flatnonzero(filled < EMITTED)).size:
        blocks = drafter(last[active], rng)  # [m, K]
        contexts = np.concatenate([last[active, None], blocks], axis=1)  # [m, K+1]: the token before each row
        context_ids = np.ravel_multi_index(contexts.T, (VOCAB,) * (K + 1)).tolist()
        for trial, context_id in zip(active.tolist(), context_ids):
            block = DRAFT_BLOCKS[context_id]
            result = verify(TARGET_BLOCKS[context_id], block, context_id, generator)
            new = block[: result.accepted].tolist() + [result.next_token]
            start = filled[trial]
            take = new[: EMITTED - start]
            emitted[trial, start : start + len(take)] = take
            filled[trial] = start + len(take)
            last[trial] = new[-1]
    return emitted


@dataclass(frozen=True)
class Fit:
    pvalue: float  # chi-square goodness of fit against the exact joint; 0 if an impossible sequence appeared
    tv: float  # total variation between the empirical and exact joint
    tv_bound: float  # E[tv] bound plus a McDiarmid margin that fails with probability 1e-6


def fit_to_target(samples: np.ndarray) -> Fit:  # samples: [n, EMITTED]
    expected = exact_joint(TARGET).ravel()
    n = len(samples)
    counts = np.bincount(np.ravel_multi_index(samples.T, (VOCAB,) * EMITTED), minlength=expected.size)
    tv = 0.5 * np.abs(counts / n - expected).sum()
    # E[tv] <= 1/2 sum sqrt(p(1-p)/n) (Jensen); tv moves by <= 1/n per sample, so McDiarmid adds
    # sqrt(ln(1/delta) / 2n) for failure probability delta = 1e-6.
    tv_bound = 0.5 * np.sqrt(expected * (1 - expected) / n).sum() + math.sqrt(math.log(1e6) / (2 * n))
    if counts[expected == 0].any():
        return Fit(pvalue=0.0, tv=tv, tv_bound=tv_bound)
    return Fit(pvalue=_chisquare_merged(counts[expected > 0], n * expected[expected > 0]), tv=tv, tv_bound=tv_bound)


def _chisquare_merged(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value with cells of expected count < 5 pooled into one, as the test's approximation needs."""
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    expected = expected[keep] * (observed[keep].sum() / expected[keep].sum())  # exact totals for scipy
    return float(chisquare(observed[keep], expected).pvalue)


def token_only(target_probs, block, context_id, generator) -> VerifyResult:
    return verify_token_only(target_probs, block, generator)


QUANTIZED_DRAFT = quantize_probs(DRAFT)  # the draft samples from what the wire carries exactly


def draft_probs_over_the_wire() -> Verifier:
    """Probability mode with q sent through the codec; each distinct block is encoded and decoded once."""
    decoded: dict[int, torch.Tensor] = {}

    def verify(target_probs, block, context_id, generator) -> VerifyResult:
        if context_id not in decoded:
            sent = QUANTIZED_DRAFT[ALL_CONTEXTS[context_id, :K]]  # [K, VOCAB]: q(. | token before position i)
            decoded[context_id] = decode_probs(encode_probs(sent))
            assert torch.equal(decoded[context_id], sent)
        return verify_draft_probs(target_probs, decoded[context_id], block, generator)

    return verify


def recovering_from_p(verify: Verifier) -> Verifier:
    """Negative control: keeps the acceptance test of `verify` but on rejection samples from p itself.

    For TOKEN_ONLY that forgets to remove x; for DRAFT_PROBS it ignores max(0, p - q).
    """

    def wrong(target_probs, block, context_id, generator) -> VerifyResult:
        result = verify(target_probs, block, context_id, generator)
        if result.accepted == len(block):
            return result
        token = int(torch.multinomial(target_probs[result.accepted], 1, generator=generator))
        return VerifyResult(accepted=result.accepted, next_token=token)

    return wrong


def test_toy_models_exercise_the_edge_cases():
    assert ((TARGET == 0) & (DRAFT > 0)).any()  # drafted tokens the target forbids
    assert ((DRAFT == 0) & (TARGET > 0)).any()  # target mass only the residual can reach
    assert 0.3 < torch.minimum(TARGET, DRAFT).sum(dim=1).mean() < 0.8  # plenty of rejections and acceptances


@pytest.mark.parametrize(
    "drafter, verify",
    [
        (sampling_drafter(DRAFT), token_only),
        (argmax_drafter(DRAFT), token_only),
        (sampling_drafter(QUANTIZED_DRAFT), draft_probs_over_the_wire()),
    ],
    ids=["token_only-sampled_draft", "token_only-deterministic_draft", "draft_probs-codec"],
)
def test_speculative_output_is_distributed_as_the_target(drafter, verify):
    fit = fit_to_target(speculative_samples(drafter, verify, seed=2023))
    assert fit.pvalue > 1e-3, fit
    assert fit.tv < fit.tv_bound, fit


@pytest.mark.parametrize(
    "drafter, verify",
    [
        (sampling_drafter(DRAFT), recovering_from_p(token_only)),
        (sampling_drafter(QUANTIZED_DRAFT), recovering_from_p(draft_probs_over_the_wire())),
    ],
    ids=["token_only-keeps_x", "draft_probs-ignores_residual"],
)
def test_negative_control_a_wrong_sampler_is_caught(drafter, verify):
    fit = fit_to_target(speculative_samples(drafter, verify, seed=2023))
    assert fit.pvalue < 1e-6, fit
    assert fit.tv > fit.tv_bound, fit
