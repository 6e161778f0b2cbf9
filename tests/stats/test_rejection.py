"""Tests for target_service.rejection, level 3: statistics (levels 1 and 2: unit/target_service/test_rejection.py).

A full speculative loop over toy bigram models emits tokens distributed exactly
as the target's own sampling (chi-square and total variation against the exact
joint), and deliberately wrong samplers run through the same helper are caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.lmkit.draws import SAMPLE, inverse_cdf
from specsplit.lmkit.probs_codec import decode_probs, encode_probs, quantize_probs
from specsplit.target_service.rejection import (
    Verdict,
    verify_coupled,
    verify_draft_probs,
    verify_token_only,
)
from tests.unit.target_service.test_rejection import seeded

pytestmark = pytest.mark.stats

# --- statistics: a full speculative loop on toy bigram models ----------------

VOCAB = 6
K = 2  # with 3 emitted tokens, the joint covers rejections at both positions, the bonus, and a second round
EMITTED = 3
# The weakest negative control (probability mode ignoring the residual) is off by TV ~ 0.034; at 50,000 trials
# the bound it must exceed is 0.018, and the chi-square p-value of either control underflows to 0.
TRIALS = 50_000
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


@dataclass(frozen=True)
class BlockDraws:
    """The draws of one block, never reused: what the target service takes from lmkit.draws by position."""

    uniforms: torch.Tensor  # [K+1, 2] float64: per row, the accept test and the sample
    gumbel: torch.Tensor | None  # [K+1, VOCAB] float64 Gumbel noise of the block's positions (coupled runs)


# (last tokens [m], rng, Gumbel noise of the block's draft positions [m, K, VOCAB] or None) -> draft blocks [m, K]
Drafter = Callable[[np.ndarray, np.random.Generator, np.ndarray | None], np.ndarray]
# (target_probs [K+1, VOCAB], draft block [K], context id into ALL_CONTEXTS, the block's draws) -> result
Verifier = Callable[[torch.Tensor, torch.Tensor, int, BlockDraws], Verdict]


def sampling_drafter(table: torch.Tensor) -> Drafter:
    """A stochastic drafter: each token drawn from table[prev] by inverse CDF, for all trials at once."""
    cdf = np.cumsum(table.double().numpy(), axis=1)
    cdf /= cdf[:, -1:]  # the last token with mass gets exactly 1.0, so u < 1 never lands past it

    def draft(last: np.ndarray, rng: np.random.Generator, gumbel) -> np.ndarray:
        block, prev = np.empty((len(last), K), dtype=np.int64), last
        for i in range(K):
            prev = (cdf[prev] <= rng.random(len(last))[:, None]).sum(axis=1)
            block[:, i] = prev
        return block

    return draft


def argmax_drafter(table: torch.Tensor) -> Drafter:
    """A deterministic drafter (like n-gram lookup): the block is a fixed function of the context."""
    best = table.argmax(dim=1).numpy()

    def draft(last: np.ndarray, rng: np.random.Generator, gumbel) -> np.ndarray:
        block, prev = np.empty((len(last), K), dtype=np.int64), last
        for i in range(K):
            prev = best[prev]
            block[:, i] = prev
        return block

    return draft


def coupled_drafter(table: torch.Tensor) -> Drafter:
    """A model drafter in coupled mode: argmax(log q + G) with the target's noise at each position."""
    with np.errstate(divide="ignore"):
        log_q = np.log(table.double().numpy())

    def draft(last: np.ndarray, rng: np.random.Generator, gumbel: np.ndarray) -> np.ndarray:
        block, prev = np.empty((len(last), K), dtype=np.int64), last
        for i in range(K):
            prev = (log_q[prev] + gumbel[:, i]).argmax(axis=1)
            block[:, i] = prev
        return block

    return draft


# Every (previous token, block) a round can see, precomputed so the loop's per-call cost is the verifier's.
ALL_CONTEXTS = torch.cartesian_prod(*[torch.arange(VOCAB)] * (K + 1))  # [VOCAB**(K+1), K+1]
TARGET_BLOCKS = list(TARGET[ALL_CONTEXTS])  # [K+1, VOCAB] per context: row i is p(. | token before position i)
DRAFT_BLOCKS = list(ALL_CONTEXTS[:, 1:])  # [K] int64 per context: the drafted tokens


def speculative_samples(
    drafter: Drafter, verify: Verifier, seed: int, trials: int = TRIALS, noise: str = "none"
) -> np.ndarray:  # -> [trials, EMITTED]
    """Runs ``trials`` independent sessions from START until each has emitted EMITTED tokens.

    Trials advance in lockstep so drafting is vectorised; every verification
    is one real call on one trial's block. ``noise``: "position" gives every
    (trial, position) its own Gumbel noise over the vocabulary, shared by
    drafter and verifier (coupled mode); "replayed" gives every position of a
    trial the same noise (a negative control); "none" makes none.
    """
    rng, generator = np.random.default_rng(seed), seeded(seed)
    gumbel = None
    if noise != "none":
        gumbel = rng.gumbel(size=(trials, 1 if noise == "replayed" else EMITTED + K, VOCAB))
        gumbel = np.broadcast_to(gumbel, (trials, EMITTED + K, VOCAB))
    emitted = np.full((trials, EMITTED), -1, dtype=np.int64)
    filled = np.zeros(trials, dtype=np.int64)
    last = np.full(trials, START, dtype=np.int64)
    while (active := np.flatnonzero(filled < EMITTED)).size:
        # [m, K+1, VOCAB]: the noise of each active trial's block positions
        block_noise = None if gumbel is None else gumbel[active[:, None], filled[active, None] + np.arange(K + 1)]
        blocks = drafter(last[active], rng, None if block_noise is None else block_noise[:, :K])  # [m, K]
        contexts = np.concatenate([last[active, None], blocks], axis=1)  # [m, K+1]: the token before each row
        context_ids = np.ravel_multi_index(contexts.T, (VOCAB,) * (K + 1)).tolist()
        fresh = torch.rand(len(context_ids), K + 1, 2, dtype=torch.float64, generator=generator)  # never reused
        for j, (trial, context_id, uniforms) in enumerate(zip(active.tolist(), context_ids, fresh)):
            block = DRAFT_BLOCKS[context_id]
            draws = BlockDraws(uniforms, None if block_noise is None else torch.from_numpy(block_noise[j]))
            result = verify(TARGET_BLOCKS[context_id], block, context_id, draws)
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


def token_only(target_probs, block, context_id, draws: BlockDraws) -> Verdict:
    return verify_token_only(target_probs, block, draws.uniforms)


def coupled(target_probs, block, context_id, draws: BlockDraws) -> Verdict:
    return verify_coupled(target_probs, block, lambda i, ids: draws.gumbel[i, ids])


QUANTIZED_DRAFT = quantize_probs(DRAFT)  # the draft samples from what the wire carries exactly


def draft_probs_over_the_wire() -> Verifier:
    """Probability mode with q sent through the codec; each distinct block is encoded and decoded once."""
    decoded: dict[int, torch.Tensor] = {}

    def verify(target_probs, block, context_id, draws: BlockDraws) -> Verdict:
        if context_id not in decoded:
            sent = QUANTIZED_DRAFT[ALL_CONTEXTS[context_id, :K]]  # [K, VOCAB]: q(. | token before position i)
            decoded[context_id] = decode_probs(encode_probs(sent))
            assert torch.equal(decoded[context_id], sent)
        return verify_draft_probs(target_probs, decoded[context_id], block, draws.uniforms)

    return verify


def recovering_from_p(verify: Verifier) -> Verifier:
    """Negative control: keeps the acceptance test of `verify` but on rejection samples from p itself.

    For TOKEN_ONLY that forgets to remove x; for DRAFT_PROBS it ignores max(0, p - q).
    """

    def wrong(target_probs, block, context_id, draws: BlockDraws) -> Verdict:
        result = verify(target_probs, block, context_id, draws)
        if result.accepted == len(block):
            return result
        token = inverse_cdf(target_probs[result.accepted].double(), float(draws.uniforms[result.accepted, SAMPLE]))
        return Verdict(accepted=result.accepted, next_token=token)

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


# A coupled round costs a Gumbel argmax per reached row; replayed noise is off by TV ~ 0.27, its bound here 0.033.
COUPLED_TRIALS = 15_000


@pytest.mark.parametrize("drafter", [coupled_drafter(DRAFT), argmax_drafter(DRAFT)], ids=["model_draft", "deterministic_draft"])
def test_coupled_output_is_distributed_as_the_target(drafter):
    samples = speculative_samples(drafter, coupled, seed=2024, trials=COUPLED_TRIALS, noise="position")
    fit = fit_to_target(samples)
    assert fit.pvalue > 1e-3, fit
    assert fit.tv < fit.tv_bound, fit


def test_negative_control_coupled_noise_replayed_across_positions_is_caught():
    samples = speculative_samples(coupled_drafter(DRAFT), coupled, seed=2024, trials=COUPLED_TRIALS, noise="replayed")
    fit = fit_to_target(samples)
    assert fit.pvalue < 1e-6, fit
    assert fit.tv > fit.tv_bound, fit
