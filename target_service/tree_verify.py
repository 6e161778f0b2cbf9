"""Verification of a token tree: the longest root path the target accepts, and the one token it adds.

Token trees (SpecInfer, Miao et al. 2024, "SpecInfer: Accelerating Large Language Model Serving
with Tree-based Speculative Inference and Verification"; Sequoia, Chen et al. 2024; EAGLE-2, Li et
al. 2024): the draft offers several continuations merged into a tree (``specsplit.lmkit.token_tree``)
and the target scores every node in one forward. Row 0 of its output is p after the context, row
i + 1 is p after node i. Greedy follows the target's argmax; sampling (token-only: the children are
point proposals, as from an n-gram drafter) tries each node's children against the residual, so
every emitted token is distributed exactly as p whatever the candidates; coupled sampling follows, at
each depth, the child carrying the target's Gumbel-max token, so the output is the target's own coupled
sampling for the seed.

The answer is the accepted path (node indices, root first) and the next token; a chain gets the
same verdict as from the chain verifiers of ``rejection``. Randomness is passed in
(``specsplit.lmkit.draws``), indexed by depth, i.e. by absolute position, so no draw decides two
positions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specsplit.lmkit import token_tree
from specsplit.lmkit.draws import ACCEPT, SAMPLE, gumbel_max, inverse_cdf
from specsplit.lmkit.sampling import row_argmax

ROW_SUM_TOLERANCE = 1e-2  # as the chain verifiers: catches logits passed as probabilities


@dataclass(frozen=True)
class TreeVerdict:
    """Emit the tokens of ``path`` (node indices, root first), then ``next_token``."""

    path: list[int]
    next_token: int

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(
    target_logits: torch.Tensor,  # [n+1, vocab]: row 0 after the context, row i+1 after node i
    draft_tokens: torch.Tensor,  # [n] int64
    parents: list[int],  # [n], see lmkit.token_tree
) -> TreeVerdict:
    """Follow the target's argmax down the tree; ties go to the lowest token id, as in ``verify_greedy``.

    The **recovered** token is the argmax where no child matches, the **bonus** token the argmax after
    a leaf, so the output equals the target's own greedy output.
    """
    tokens = _check_tree(target_logits, draft_tokens, parents)
    best, argmax = row_argmax(target_logits)  # [n+1] each
    if any(math.isnan(v) for v in best.tolist()):
        raise ValueError("target_logits contain NaN; check the model output")
    return greedy_tree_verdict(argmax.tolist(), tokens, parents)


def greedy_tree_verdict(choices: Sequence[int], draft_tokens: Sequence[int], parents: list[int]) -> TreeVerdict:
    """``verify_tree_greedy`` from the target's argmax of each row ([n+1] ids, e.g. ``sampling.block_argmax``'s)."""
    if len(choices) != len(draft_tokens) + 1:
        raise ValueError(f"{len(choices)} argmax ids for a tree of {len(draft_tokens)} nodes; expected n+1")
    kids = token_tree.children(parents)
    path, node = [], token_tree.ROOT
    while True:
        choice = choices[node + 1]
        following = next((child for child in kids[node + 1] if draft_tokens[child] == choice), None)
        if following is None:
            return TreeVerdict(path, choice)
        path.append(following)
        node = following


def uniform_columns(parents: list[int]) -> int:
    """Draws per position a tree's sampling verification uses: ACCEPT, SAMPLE and one per later sibling."""
    return max([2, *(1 + len(siblings) for siblings in token_tree.children(parents))])


def verify_tree_token_only(
    target_probs: torch.Tensor,  # [n+1, vocab] rows sum to 1: row 0 after the context, row i+1 after node i
    draft_tokens: torch.Tensor,  # [n] int64
    parents: list[int],  # [n], see lmkit.token_tree
    uniforms: torch.Tensor,  # [depth + 2, uniform_columns(parents)] float64 in (0, 1), row d for depth d
) -> TreeVerdict:
    """Walk down the tree trying each node's children in turn against the residual; lossless for any tree.

    At a node with target distribution p, children c_1, c_2, ... are tried in rank order: with r the
    residual left by those rejected so far (p without them), c_j is accepted with probability
    r(c_j) / sum(r); if every child is rejected the **recovered** token is sampled from r normalised,
    and after a leaf the **bonus** token from p. Each test asks "is the target's token c_j, given that it
    is none of c_1..c_{j-1}?", so every emitted token is distributed exactly as p (SpecInfer's
    multi-step speculative sampling for deterministic proposals; with one child it is
    ``rejection.verify_token_only``). ``uniforms[d]`` decides the d-th position after the context:
    column ``ACCEPT`` tests the first child, ``SAMPLE`` draws the recovered or bonus token, ``1 + j``
    tests the child of rank j >= 1.
    """
    tokens = _check_tree(target_probs, draft_tokens, parents)
    depth = max(token_tree.depths(parents), default=-1) + 2  # rows: every position the walk can decide
    columns = uniform_columns(parents)
    if not isinstance(uniforms, torch.Tensor) or tuple(uniforms.shape) != (depth, columns):
        shape = list(uniforms.shape) if isinstance(uniforms, torch.Tensor) else type(uniforms).__name__
        raise ValueError(f"uniforms must be [{depth}, {columns}] for this tree (see uniform_columns), got {shape}")
    draws = uniforms.tolist()
    if not all(0.0 <= u < 1.0 for row in draws for u in row):  # also refuses NaN
        raise ValueError("uniforms must lie in [0, 1)")
    for row, total in enumerate(target_probs.sum(dim=-1, dtype=torch.float32).tolist()):
        if not abs(total - 1.0) <= ROW_SUM_TOLERANCE:
            raise ValueError(f"target_probs row {row} sums to {total}, not 1: pass probabilities, not logits")
    kids = token_tree.children(parents)
    path, node = [], token_tree.ROOT
    while True:
        u = draws[len(path)]
        p = target_probs[node + 1].to(device="cpu", dtype=torch.float64)  # [vocab]
        if not float(p.min()) >= 0.0:
            raise ValueError(f"target_probs row {node + 1} has negative or NaN values")
        if not kids[node + 1]:
            return TreeVerdict(path, inverse_cdf(p, u[SAMPLE]))
        residual, mass = p.clone(), 1.0  # rows sum to 1: the first test is the chain's u < p(x)
        following = None
        for rank, child in enumerate(kids[node + 1]):
            share = float(residual[tokens[child]])
            if u[ACCEPT if rank == 0 else 1 + rank] * mass < share:  # u < r(c) / sum(r), without dividing
                following = child
                break
            residual[tokens[child]] = 0.0
            mass -= share
        if following is None:
            # An all-zero residual means the children held all of p up to rounding: reached with
            # probability ~0, and sampling from p keeps the output exact.
            return TreeVerdict(path, inverse_cdf(residual, u[SAMPLE], fallback=p))
        path.append(following)
        node = following


def verify_tree_coupled(
    row_probs: Callable[[int], torch.Tensor],  # row r -> [vocab] p_r, rows sum to 1: r = 0 after the context, i+1 after node i
    draft_tokens: torch.Tensor,  # [n] int64
    parents: list[int],  # [n], see lmkit.token_tree
    vocab: int,
    noise: Callable[[int, torch.Tensor], torch.Tensor],  # (depth d, token ids [m] int64) -> Gumbel noise [m] float64
) -> TreeVerdict:
    """Gumbel-max coupling down a tree: at each depth the target's token is argmax(log p + G(depth)) of the node
    reached; follow the child that carries it, else emit it (**recovered**), and after a leaf emit the
    leaf's (**bonus**).

    Every emitted token is the target's coupled token for its absolute position given the tokens before
    it, so the output is the target's own coupled sampling, the same whatever the tree (or K, or drafter)
    for a seed. Only the rows on the walked path are asked for, and only their depths' noise.
    """
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 1 or draft_tokens.dtype != torch.int64:
        raise ValueError("draft_tokens must be a 1-D int64 tensor [n]")
    tokens = draft_tokens.tolist()
    token_tree.check_parents(parents, len(tokens))
    if any(not 0 <= token < vocab for token in tokens):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab})")
    kids = token_tree.children(parents)
    path, node = [], token_tree.ROOT
    while True:
        p = row_probs(node + 1)
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != (vocab,):
            raise ValueError(f"row {node + 1} must be a tensor [vocab] = [{vocab}]")
        p = p.to(device="cpu", dtype=torch.float64)
        if not float(p.min()) >= 0.0 or not abs(float(p.sum()) - 1.0) <= ROW_SUM_TOLERANCE:
            raise ValueError(f"row {node + 1} is not a distribution (negative, NaN, or not summing to 1)")
        chosen = gumbel_max(p, functools.partial(noise, len(path)))  # this depth's noise for token ids
        following = next((child for child in kids[node + 1] if tokens[child] == chosen), None)
        if following is None:
            return TreeVerdict(path, chosen)
        path.append(following)
        node = following


def _check_tree(target: torch.Tensor, draft_tokens: torch.Tensor, parents: list[int]) -> list[int]:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 1 or draft_tokens.dtype != torch.int64:
        raise ValueError("draft_tokens must be a 1-D int64 tensor [n]")
    tokens = draft_tokens.tolist()
    n = len(tokens)
    token_tree.check_parents(parents, n)
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] != n + 1:
        shape = list(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"target_logits must be [n+1, vocab] with n = {n} tree tokens, got {shape}")
    if not target.is_floating_point():
        raise ValueError(f"target_logits must be floating point, got {target.dtype}")
    vocab = target.shape[1]
    if any(not 0 <= token < vocab for token in tokens):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab})")
    kids = token_tree.children(parents)
    for siblings in kids:
        if len({tokens[i] for i in siblings}) != len(siblings):
            raise ValueError("two siblings carry the same token; merge them (lmkit.token_tree.merge)")
    return tokens
