"""Sampling under a grammar stays lossless: a speculative loop whose blocks are pruned to the grammar and whose
every verified position is masked (``lmkit.token_mask``) emits tokens distributed exactly as the target's
constrained distribution, sampled one token at a time.

The toy grammar is a bigram automaton over 6 tokens (the tokens allowed next depend on the one before, draft
tokens included), the target and an unconstrained draft are random bigram models. The negative controls
mask only a block's first position, or every position with the committed context's mask (blind to the draft
tokens before it): the same test catches both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.lmkit import token_mask
from specsplit.target_service.rejection import verify_coupled, verify_token_only

pytestmark = pytest.mark.stats

VOCAB = 6
K = 3
EMITTED = 3
# Each negative control emits outputs the grammar refuses (or a p-value that underflows) well within 2,000 trials.
TRIALS = 3_000
START = 0


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target p(next | prev), draft q(next | prev), allowed[prev, next]): each row allows at least two tokens."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 2.0, dim=-1)
    draft = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 2.0, dim=-1)
    allowed = torch.rand(VOCAB, VOCAB, generator=generator) < 0.5
    allowed[torch.arange(VOCAB), torch.randint(VOCAB, (VOCAB,), generator=generator)] = True
    allowed[torch.arange(VOCAB), (torch.arange(VOCAB) + 1) % VOCAB] = True
    return target, draft, allowed


TARGET, DRAFT, ALLOWED = _tables(seed=3)


def exact_joint() -> np.ndarray:  # [VOCAB, VOCAB, VOCAB] float64
    """P(first three tokens after START) under the target constrained to the grammar, token by token."""
    constrained = (TARGET * ALLOWED).double()
    c = (constrained / constrained.sum(-1, keepdim=True)).numpy()
    return c[START][:, None, None] * c[:, :, None] * c[None, :, :]


def prune(block: list[int], last: int) -> list[int]:
    """The block cut at the first token the grammar refuses after the tokens before it (the orchestrator's rule)."""
    kept, prev = [], last
    for token in block:
        if not ALLOWED[prev, token]:
            break
        kept.append(token)
        prev = token
    return kept


def masks(context_last: int, block: list[int], rows_from: str) -> torch.Tensor:  # [len(block)+1, VOCAB] bool
    """The allowed tokens at each verified position. ``rows_from``: "tokens before it" (right); the negative
    controls: "first only" (the rest unmasked), "context only" (every row the committed context's mask, as if
    the draft tokens were not context)."""
    if rows_from == "context only":
        return ALLOWED[[context_last] * (len(block) + 1)].clone()
    rows = ALLOWED[[context_last, *block]].clone()
    if rows_from == "first only":
        rows[1:] = True
    return rows


def run(verifier: str, rows_from: str, seed: int = 0) -> np.ndarray:
    """Counts of the first EMITTED tokens over TRIALS generations."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB,) * EMITTED, dtype=np.int64)
    draft_cdf = np.cumsum(DRAFT.double().numpy(), axis=-1)  # [VOCAB, VOCAB]: sample next | prev by inversion
    for _ in range(TRIALS):
        out = [START]
        while len(out) <= EMITTED:
            block = []
            for u in rng.random(K):
                block.append(min(int(np.searchsorted(draft_cdf[(block or out)[-1]], u)), VOCAB - 1))
            block = prune(block, out[-1])
            lasts = [out[-1], *block]
            logits = TARGET[lasts].log()  # [len(block)+1, VOCAB]
            weights = token_mask.apply(logits, masks(out[-1], block, rows_from)).double().exp()
            probs = weights / weights.sum(-1, keepdim=True)  # softmax over the allowed tokens
            tokens = torch.tensor(block, dtype=torch.long)
            if verifier == "token_only":
                draws = torch.rand(len(block) + 1, 2, dtype=torch.float64, generator=generator)
                verdict = verify_token_only(probs, tokens, draws)
            else:
                gumbel = -torch.log(
                    -torch.log(torch.rand(len(block) + 1, VOCAB, dtype=torch.float64, generator=generator))
                )
                verdict = verify_coupled(probs, tokens, lambda i, ids, g=gumbel: g[i, ids])
            out.extend([*block[: verdict.accepted], verdict.next_token])
        counts[tuple(out[1 : EMITTED + 1])] += 1
    return counts


def p_value(counts: np.ndarray) -> float:
    """Chi-square of the counts against the exact constrained joint; outputs the grammar refuses (expected 0)
    are one more cell, so any of them fails the test."""
    expected = exact_joint().ravel() * counts.sum()
    observed = counts.ravel().astype(np.float64)
    refused = expected == 0
    if observed[refused].sum() > 0:
        return 0.0
    observed, expected = observed[~refused], expected[~refused]
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue)


@pytest.mark.parametrize("verifier", ["token_only", "coupled"])
def test_masked_every_position_is_the_constrained_distribution(verifier):
    assert math.isclose(exact_joint().sum(), 1.0, rel_tol=1e-9)
    assert p_value(run(verifier, "tokens before it")) > 1e-3


@pytest.mark.parametrize("rows_from", ["first only", "context only"])
@pytest.mark.parametrize("verifier", ["token_only", "coupled"])
def test_negative_control_a_mask_blind_to_the_draft_tokens_is_caught(verifier, rows_from):
    assert p_value(run(verifier, rows_from)) < 1e-6
