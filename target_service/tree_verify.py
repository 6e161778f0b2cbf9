"""Verification of a token tree: the longest root path the target accepts, and the one token it adds.

Token trees (SpecInfer, Miao et al. 2024, "SpecInfer: Accelerating Large
Language Model Serving with Tree-based Speculative Inference and
Verification"; Sequoia, Chen et al. 2024; EAGLE-2, Li et al. 2024): the
draft offers several continuations at once, merged into a tree
(``specsplit.lmkit.token_tree``), and the target scores every node in one forward.
Row 0 of the target's output is p after the context; row i + 1 is p after
node i (the sequence on node i's root path). The walk starts at the context:

* **greedy**: go to the child equal to the target's argmax while there is one;
  the **recovered** token is the argmax where no child matches, the **bonus**
  token the argmax after a leaf. Output equals the target's greedy output.
* **sampling, token-only** (the children are point proposals, as from an n-gram
  drafter): at a node with target distribution p, try its children c_1, c_2,
  ... in order. With r the residual left by the children rejected so far
  (r = p without them), accept c_j with probability r(c_j) / sum(r); if every
  child is rejected, sample the **recovered** token from r normalised; after a
  leaf, sample the **bonus** token from p. Each test asks "is the target's
  token c_j, given that it is none of c_1..c_{j-1}?", so the token emitted at
  every position is distributed exactly as p, whatever the candidates
  (SpecInfer's multi-step speculative sampling for deterministic proposals).
  With one child this is ``rejection.verify_token_only``.

The answer is the accepted path (node indices, root first) and the next token;
a chain gives the same verdict as the chain verifiers of ``rejection``.

Randomness is passed in (``specsplit.lmkit.draws``): the walk decides one node per
depth, so the uniforms are indexed by depth, i.e. by absolute position:
``uniforms[d]`` decides the token at the d-th position after the context, its
column ``ACCEPT`` tests a node's first child, ``SAMPLE`` samples the
recovered or bonus token, and column ``1 + j`` tests its child of rank j >= 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specsplit.lmkit import token_tree
from specsplit.lmkit.draws import ACCEPT, SAMPLE, inverse_cdf

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
    """Follow the target's argmax down the tree; ties go to the lowest token id, as in ``verify_greedy``."""
    tokens = _check_tree(target_logits, draft_tokens, parents)
    best, argmax = target_logits.max(dim=-1)  # [n+1] each
    if any(math.isnan(v) for v in best.tolist()):
        raise ValueError("target_logits contain NaN; check the model output")
    argmax = argmax.tolist()
    kids = token_tree.children(parents)
    path, node = [], token_tree.ROOT
    while True:
        choice = argmax[node + 1]
        following = next((child for child in kids[node + 1] if tokens[child] == choice), None)
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
    """Walk down the tree trying each node's children in turn against the residual; lossless for any tree."""
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
