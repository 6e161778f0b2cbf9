"""Token-tree sampling is lossless: a full loop over toy bigram models emits the target's own distribution.

The drafter is deterministic (like n-gram lookup) and proposes a tree: three candidates after the last
token, the first one expanded by two more, the second by one. Rounds run until three tokens are
emitted, and the joint of those tokens is compared with the target's exact joint (chi-square and total
variation, as for chains in stats/test_rejection.py). The negative control accepts a later sibling
with its plain probability p(c) instead of its share of the residual, and the same test catches it.
Coupled trees (Gumbel-max) emit, trial by trial, exactly the tokens coupled sampling emits one at a time
with the same noise, and so the target's joint; a walk that follows the first child is caught.
Why 25,000 trials a run suffice: docs/testing.md ("Wall time").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.lmkit import token_tree
from specsplit.lmkit.draws import ACCEPT, SAMPLE, gumbel_max, inverse_cdf
from specsplit.target_service.tree_verify import (
    TreeVerdict,
    uniform_columns,
    verify_tree_coupled,
    verify_tree_token_only,
)
from tests.stats.test_rejection import DRAFT, EMITTED, START, TARGET, fit_to_target
from tests.unit.target_service.test_rejection import seeded

pytestmark = pytest.mark.stats

TRIALS = 25_000  # half the chain tests' trials (each trial is a Python loop); its power: docs/testing.md


def tree_after(last: int) -> tuple[list[int], list[int]]:
    """The draft's three most likely tokens after ``last``; the first continued by its top two, the second by one."""
    ranked = DRAFT.argsort(dim=1, descending=True)
    first, second, third = ranked[last, :3].tolist()
    return token_tree.merge(
        [[first, int(ranked[first, 0])], [first, int(ranked[first, 1])], [second, int(ranked[second, 0])], [third]]
    )


TREES = [tree_after(last) for last in range(TARGET.shape[0])]


def wrong_sibling_rule(target_probs, tokens, parents, uniforms) -> TreeVerdict:
    """Negative control: tests a later sibling c against p(c) rather than against the residual's share."""
    kids = token_tree.children(parents)
    path, node = [], token_tree.ROOT
    while True:
        u = uniforms[len(path)].tolist()
        p = target_probs[node + 1].double()
        residual = p.clone()
        following = None
        for rank, child in enumerate(kids[node + 1]):
            if u[ACCEPT if rank == 0 else 1 + rank] < float(p[tokens[child]]):
                following = child
                break
            residual[tokens[child]] = 0.0
        if following is None:
            return TreeVerdict(path, inverse_cdf(residual if kids[node + 1] else p, u[SAMPLE], fallback=p))
        path.append(following)
        node = following


def tree_samples(verify, seed: int) -> np.ndarray:  # -> [TRIALS, EMITTED]
    generator = seeded(seed)
    out = np.empty((TRIALS, EMITTED), dtype=np.int64)
    for trial in range(TRIALS):
        emitted, last = [], START
        while len(emitted) < EMITTED:
            tokens, parents = TREES[last]
            target_probs = TARGET[[last, *tokens]]  # [n+1, vocab]: p after the context, then after each node
            depth = max(token_tree.depths(parents)) + 2
            uniforms = torch.rand(depth, uniform_columns(parents), dtype=torch.float64, generator=generator)
            verdict = verify(target_probs, torch.tensor(tokens), parents, uniforms)
            new = [tokens[i] for i in verdict.path] + [verdict.next_token]
            emitted.extend(new)
            last = new[-1]
        out[trial] = emitted[:EMITTED]
    return out


def test_the_trees_exercise_siblings_and_their_children():
    tokens, parents = TREES[START]
    assert len(token_tree.children(parents)[0]) == 3 and len(tokens) == 6


@pytest.mark.parametrize("verify, lossless", [(verify_tree_token_only, True), (wrong_sibling_rule, False)],
                         ids=["sibling-rule", "negative-control"])
def test_tree_sampling_is_distributed_as_the_target(verify, lossless):
    fit = fit_to_target(tree_samples(verify, seed=2024))
    if lossless:
        assert fit.pvalue > 1e-3, fit
        assert fit.tv < fit.tv_bound, fit
    else:
        assert fit.pvalue < 1e-6, fit


COUPLED_TRIALS = 6_000  # the negative control below fails at p ~ 0 with far fewer; each trial is a Python loop


def coupled_samples(walk, seed: int) -> tuple[np.ndarray, np.ndarray]:  # -> [TRIALS, EMITTED] walked, sequential
    """Per trial one Gumbel table [EMITTED, vocab] (noise keyed by position): the tokens the tree walks emit, and
    the tokens coupled sampling emits one at a time (k = 0) with the same noise."""
    generator = seeded(seed)
    vocab = TARGET.shape[1]
    walked = np.empty((COUPLED_TRIALS, EMITTED), dtype=np.int64)
    alone = np.empty((COUPLED_TRIALS, EMITTED), dtype=np.int64)
    for trial in range(COUPLED_TRIALS):
        u = torch.rand(EMITTED + 8, vocab, dtype=torch.float64, generator=generator)
        gumbel = -torch.log(-torch.log(u))  # [positions, vocab]
        emitted, last = [], START
        while len(emitted) < EMITTED:
            tokens, parents = TREES[last]
            rows = TARGET[[last, *tokens]].double()  # [n+1, vocab]
            start = len(emitted)
            verdict = walk(lambda r, rows=rows: rows[r], torch.tensor(tokens), parents, vocab,
                           lambda depth, ids, start=start, gumbel=gumbel: gumbel[start + depth, ids])
            new = [tokens[i] for i in verdict.path] + [verdict.next_token]
            emitted.extend(new)
            last = new[-1]
        walked[trial] = emitted[:EMITTED]
        last = START
        for position in range(EMITTED):
            last = gumbel_max(TARGET[last].double(),
                              lambda ids, position=position, gumbel=gumbel: gumbel[position, ids])
            alone[trial, position] = last
    return walked, alone


def first_child_walk(row_probs, draft_tokens, parents, vocab, noise) -> TreeVerdict:
    """Negative control: follows the first child whatever the target's coupled token is."""
    kids = token_tree.children(parents)
    path, node = [], token_tree.ROOT
    while kids[node + 1]:
        node = kids[node + 1][0]
        path.append(node)
    return TreeVerdict(path, gumbel_max(row_probs(node + 1), lambda ids: noise(len(path), ids)))


@pytest.mark.parametrize("walk, lossless", [(verify_tree_coupled, True), (first_child_walk, False)],
                         ids=["coupled-walk", "negative-control"])
def test_coupled_trees_emit_the_seeds_own_tokens_and_the_targets_distribution(walk, lossless):
    walked, alone = coupled_samples(walk, seed=7)
    fit = fit_to_target(walked)
    if lossless:
        assert np.array_equal(walked, alone)  # the same tokens as k = 0, trial by trial
        assert fit.pvalue > 1e-3, fit
        assert fit.tv < fit.tv_bound, fit
    else:
        assert not np.array_equal(walked, alone)
        assert fit.pvalue < 1e-6, fit
