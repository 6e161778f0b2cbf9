"""Sampling with penalties stays lossless: the speculative output is distributed as the penalized target's.

A toy bigram target and draft; repetition, presence and frequency penalties
make each position's distribution depend on the whole history, draft tokens
included. Blocks (chains in TOKEN_ONLY and DRAFT_PROBS, a token tree in
TOKEN_ONLY) go through the target engine's own adjustment (``penalized``) and
decision; the first three emitted tokens are compared with the exact joint of
sampling the penalized target one token at a time (chi-square). The negative
control penalizes a block with the committed context only, ignoring the draft
tokens before each position, and the same test catches it.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np
import pytest
import torch

from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams, apply_penalties, logits_to_probs
from specsplit.target_service.engine import TargetEngine, TargetSession, penalized
from tests.stats.test_rejection import _chisquare_merged

pytestmark = pytest.mark.stats

VOCAB = 3
K = 2
EMITTED = 3
# The weakest negative control (token-only chain) reaches chi-square 471 on 19 df at 2,000 trials (p ~ 1e-87).
TRIALS = 3_000
START = 0
PARAMS = SamplingParams(
    temperature=1.0, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=1.0, prompt_length=1
)

_gen = torch.Generator().manual_seed(7)
TARGET_LOGITS = torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5 + 2.0 * torch.eye(VOCAB)  # likes repeating
DRAFT_LOGITS = TARGET_LOGITS + torch.randn(VOCAB, VOCAB, generator=_gen) * 0.5

# (session, raw rows [n, vocab], draft tokens, parents or None) -> the rows the verifier decides on
Adjust = Callable[[TargetSession, torch.Tensor, list[int], list[int] | None], torch.Tensor]


def committed_only(session, rows, draft_tokens, parents) -> torch.Tensor:
    """The negative control: every row penalized as if no draft token came before it."""
    return apply_penalties(rows, session.sampling, session.tokens, [()] * rows.shape[0])


def target_probs(context: list[int]) -> torch.Tensor:  # [vocab]
    rows = apply_penalties(TARGET_LOGITS[context[-1]][None], PARAMS, context, [()])
    return logits_to_probs(rows, PARAMS)[0]


def exact_joint() -> np.ndarray:  # [VOCAB ** EMITTED] float64
    joint = np.zeros((VOCAB,) * EMITTED)
    for seq in np.ndindex(*joint.shape):
        p, context = 1.0, [START]
        for token in seq:
            p *= float(target_probs(context)[token])
            context.append(int(token))
        joint[seq] = p
    return joint.ravel()


@functools.cache
def _draft_probs(context: tuple[int, ...], drafted: tuple[int, ...]) -> torch.Tensor:
    rows = apply_penalties(DRAFT_LOGITS[[*context, *drafted][-1]][None], PARAMS, context, [drafted])
    return logits_to_probs(rows, PARAMS)


def draft_probs(context: list[int], drafted: list[int]) -> torch.Tensor:  # [1, vocab], as the model drafter has q
    return _draft_probs(tuple(context), tuple(drafted))


def draft_chain(context: list[int], rng: np.random.Generator) -> tuple[list[int], torch.Tensor]:
    drafted, rows = [], []
    for _ in range(K):
        q = draft_probs(context, drafted)
        rows.append(q)
        drafted.append(int(np.searchsorted(_cdf(q), rng.random(), side="right")))
    return drafted, torch.cat(rows)


def _cdf(q: torch.Tensor) -> np.ndarray:  # [1, vocab] -> [vocab] float64, last entry exactly 1
    cdf = np.cumsum(q[0].double().numpy())
    return cdf / cdf[-1]


def round_chain(session: TargetSession, rng, adjust: Adjust) -> list[int]:
    drafted, q = draft_chain(session.tokens, rng)
    path = [*session.tokens[-1:], *drafted]
    rows = adjust(session, TARGET_LOGITS[path], drafted, None)  # row i follows path[i]
    probs = q if session.mode is VerificationMode.DRAFT_PROBS else None
    verdict = TargetEngine._decide(session, rows, drafted, probs)
    return [*drafted[: verdict.accepted], verdict.next_token]


def round_tree(session: TargetSession, rng, adjust: Adjust) -> list[int]:
    """Nodes: 0 = x0 (sampled), 1 = y0 (x0's runner-up sibling), 2 = x1 under x0."""
    drafted, _ = draft_chain(session.tokens, rng)
    q0 = draft_probs(session.tokens, [])[0].clone()
    q0[drafted[0]] = -1.0
    tokens, parents = [drafted[0], int(q0.argmax()), drafted[1]], [-1, -1, 0]
    rows = adjust(session, TARGET_LOGITS[[session.tokens[-1], *tokens]], tokens, parents)  # root, then nodes
    verdict = TargetEngine._decide_tree(session, rows, tokens, parents)
    return [*(tokens[i] for i in verdict.path), verdict.next_token]


def samples(mode: VerificationMode, round_fn, adjust: Adjust) -> np.ndarray:  # [TRIALS, EMITTED]
    rng = np.random.default_rng(11)
    out = np.empty((TRIALS, EMITTED), dtype=np.int64)
    for trial in range(TRIALS):
        session = TargetSession("s", [START], SamplingParams(**{**PARAMS.__dict__, "seed": trial}), mode, cache=None)
        emitted: list[int] = []
        while len(emitted) < EMITTED:
            new = round_fn(session, rng, adjust)
            emitted.extend(new)
            session.tokens.extend(new)
        out[trial] = emitted[:EMITTED]
    return out


def pvalue(drawn: np.ndarray) -> float:
    expected = exact_joint()
    counts = np.bincount(np.ravel_multi_index(drawn.T, (VOCAB,) * EMITTED), minlength=expected.size)
    return _chisquare_merged(counts, TRIALS * expected)


SHAPES = {
    "token-only chain": (VerificationMode.TOKEN_ONLY, round_chain),
    "draft-probs chain": (VerificationMode.DRAFT_PROBS, round_chain),
    "token-only tree": (VerificationMode.TOKEN_ONLY, round_tree),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_penalized_sampling_is_distributed_as_the_penalized_target(shape):
    mode, round_fn = SHAPES[shape]
    assert pvalue(samples(mode, round_fn, penalized)) > 1e-3


@pytest.mark.parametrize("shape", SHAPES)
def test_negative_control_penalties_blind_to_the_draft_tokens_are_caught(shape):
    mode, round_fn = SHAPES[shape]
    assert pvalue(samples(mode, round_fn, committed_only)) < 1e-6


def test_the_penalties_matter_here():
    """Without them the target's joint is far from the penalized one, so the control has something to catch."""
    plain = logits_to_probs(TARGET_LOGITS[START][None], PARAMS)[0]
    assert float((plain - target_probs([START, START])).abs().max()) > 0.1
    assert not math.isclose(float(target_probs([START])[START]), float(target_probs([START, START])[START]))
