"""Verification of a token tree: the longest root path the target accepts, and the one token it adds.

Token trees (SpecInfer, Miao et al. 2024, "SpecInfer: Accelerating Large
Language Model Serving with Tree-based Speculative Inference and
Verification"; Sequoia, Chen et al. 2024; EAGLE-2, Li et al. 2024): the
draft offers several continuations at once, merged into a tree
(``lmkit.token_tree``), and the target scores every node in one forward.
Row 0 of the target's output is p after the context; row i + 1 is p after
node i (the sequence on node i's root path). The walk starts at the context:

* **greedy**: go to the child equal to the target's argmax while there is one;
  the **recovered** token is the argmax where no child matches, the **bonus**
  token the argmax after a leaf. Output equals the target's greedy output.

The answer is the accepted path (node indices, root first) and the next token;
a chain gives the same verdict as ``rejection.verify_greedy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmkit import token_tree


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
