"""Verification of a draft block: which draft tokens the target accepts, and the one token it adds.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"). Row i of the target's output is p_i, its distribution at draft position i (row k
follows the whole block). **Accepted**: the leading draft tokens that pass the mode's test;
**recovered**: at the first rejection, a token drawn so that the one emitted there is distributed
exactly as p_i; **bonus**: when all k pass, one more drawn from p_k. Each call emits
``accepted + 1`` tokens distributed as the target alone samples them (greedy: its argmax), whatever the drafter.

Randomness is passed in: ``uniforms`` [k+1, 2] holds per position the test of its draft token
(column 0) and the draw of its recovered or bonus token (column 1), keyed by absolute position
(``specsplit.lmkit.draws``) so that no draw decides two positions; coupled mode takes Gumbel
noise. ``*_rows`` variants make each target row only when it is reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specsplit.lmkit.draws import ACCEPT, SAMPLE, gumbel_max, inverse_cdf
from specsplit.lmkit.sampling import row_argmax

# Rows of target_probs / draft_probs must sum to 1 within this; catches logits passed by mistake
# while tolerating bf16/fp16 softmax rounding.
ROW_SUM_TOLERANCE = 1e-2


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block: emit ``draft_tokens[:accepted]`` then ``next_token``."""

    accepted: int  # number of draft tokens accepted, 0..k
    next_token: int  # the recovered token at position `accepted` (on rejection) or the bonus token (all k accepted)


def verify_greedy(
    target_logits: torch.Tensor,  # [k+1, vocab] logits (or probabilities: only the argmax matters)
    draft_tokens: torch.Tensor,  # [k] int64
) -> Verdict:
    """Accepts the longest prefix of draft tokens equal to the target argmax; next token = argmax after it.

    Argmax ties go to the lowest token id (``torch.max`` returns the first maximum).
    """
    tokens = _check_block("target_logits", target_logits, draft_tokens)
    best, argmax = row_argmax(target_logits)  # [k+1] each; a NaN anywhere in a row becomes its max
    if any(math.isnan(v) for v in best.tolist()):
        raise ValueError("target_logits contain NaN; check the model output")
    return greedy_verdict(argmax.tolist(), tokens)


def greedy_verdict(choices: Sequence[int], draft_tokens: Sequence[int]) -> Verdict:
    """``verify_greedy`` from the target's argmax of each row ([k+1] ids, e.g. ``sampling.block_argmax``'s)."""
    if len(choices) != len(draft_tokens) + 1:
        raise ValueError(f"{len(choices)} argmax ids for {len(draft_tokens)} draft tokens; expected one per row, k+1")
    accepted = 0
    for drafted, target_choice in zip(draft_tokens, choices):
        if drafted != target_choice:
            break
        accepted += 1
    return Verdict(accepted=accepted, next_token=choices[accepted])


def verify_token_only(
    target_probs: torch.Tensor,  # [k+1, vocab] rows sum to 1
    draft_tokens: torch.Tensor,  # [k] int64
    uniforms: torch.Tensor,  # [k+1, 2] float64 in (0, 1): per position (accept test, sample)
) -> Verdict:
    """Treats each draft token x as a point proposal: accept w.p. p(x), else sample from p with x removed.

    Lossless for any drafter, deterministic ones (n-gram) included: if x came
    from any q, P(emit y) = q(y) p(y) + sum_{x != y} q(x) (1 - p(x)) p(y) / (1 - p(x)) = p(y).
    """
    _check_block("target_probs", target_probs, draft_tokens)
    return verify_token_only_rows(lambda i: target_probs[i], draft_tokens, target_probs.shape[1], uniforms)


def verify_token_only_rows(
    row_probs: Callable[[int], torch.Tensor],  # row i -> [vocab] p_i, rows sum to 1; asked for in order, while needed
    draft_tokens: torch.Tensor,  # [k] int64
    vocab: int,
    uniforms: torch.Tensor,  # [k+1, 2] float64 in (0, 1): per position (accept test, sample)
) -> Verdict:
    """``verify_token_only`` with each row's distribution made only when the row is reached (as
    ``verify_coupled_rows``): a block rejected at position j costs j + 1 rows, and decides as the whole block."""
    tokens = _check_tokens(draft_tokens, vocab)

    def residual(i: int, row: torch.Tensor) -> torch.Tensor:  # p with x_i removed
        # An all-zero residual means p(x) == 1 up to rounding: rejection then has probability ~0
        # and the exact answer is x itself, which sampling from p returns.
        left = row.clone()
        left[tokens[i]] = 0.0
        return left

    return _walk(row_probs, tokens, vocab, uniforms, [1.0] * len(tokens), residual)


def verify_draft_probs(
    target_probs: torch.Tensor,  # [k+1, vocab] rows sum to 1
    draft_probs: torch.Tensor,  # [k, vocab] rows sum to 1; row i is the q that x_i was sampled from
    draft_tokens: torch.Tensor,  # [k] int64
    uniforms: torch.Tensor,  # [k+1, 2] float64 in (0, 1): per position (accept test, sample)
) -> Verdict:
    """Standard speculative sampling: accept w.p. min(1, p(x)/q(x)), else sample from norm(max(0, p - q)).

    A draft token with q(x) == 0 could not have been sampled from q: the drafter
    is broken, and the token is rejected (whatever p(x) is) rather than trusted.
    """
    _check_block("target_probs", target_probs, draft_tokens)
    return verify_draft_probs_rows(
        lambda i: target_probs[i], draft_probs, draft_tokens, target_probs.shape[1], uniforms)


def verify_draft_probs_rows(
    row_probs: Callable[[int], torch.Tensor],  # row i -> [vocab] p_i, rows sum to 1; asked for in order, while needed
    draft_probs: torch.Tensor,  # [k, vocab] rows sum to 1; row i is the q that x_i was sampled from
    draft_tokens: torch.Tensor,  # [k] int64
    vocab: int,
    uniforms: torch.Tensor,  # [k+1, 2] float64 in (0, 1): per position (accept test, sample)
) -> Verdict:
    """``verify_draft_probs`` with the target's rows made only when reached; q (sent whole) is checked whole."""
    tokens = _check_tokens(draft_tokens, vocab)
    k = len(tokens)
    if not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must have shape [k, vocab] = {[k, vocab]}, got {_shape(draft_probs)}")
    _check_float("draft_probs", draft_probs)
    _check_row_sums("draft_probs", draft_probs)
    q_drafted = _probs_at("draft_probs", draft_probs, _flat_index(draft_tokens, vocab, draft_probs.device))  # [k]

    def residual(i: int, row: torch.Tensor) -> torch.Tensor:  # max(0, p - q)
        # max(0, p - q) is all zero only if p <= q everywhere, i.e. p == q (both sum to 1). Then
        # min(1, p/q) = 1 at every x with q(x) > 0, so this rejection is reached with probability 0
        # (float rounding, or a broken drafter with q(x) = 0); sampling from p keeps the output exact.
        return (row - _row("draft_probs", draft_probs, i)).clamp_(min=0.0)

    return _walk(row_probs, tokens, vocab, uniforms, q_drafted, residual)


def _walk(
    row_probs: Callable[[int], torch.Tensor],  # row i -> [vocab] p_i, asked for in order, while needed
    tokens: list[int],  # [k] checked draft tokens
    vocab: int,
    uniforms: torch.Tensor,  # [k+1, 2]
    q_drafted: list[float],  # [k] q_i(x_i): 1.0 for a point proposal
    residual: Callable[[int, torch.Tensor], torch.Tensor],  # (i, p_i float64) -> what a rejection at i samples from
) -> Verdict:
    """Accept x_i while u_i < p_i(x_i) / q_i(x_i) (q == 0 rejects); at the first rejection sample the residual
    (falling back to p_i when it has no mass), or with every token accepted the bonus token from p_k."""
    k = len(tokens)
    accept_u, sample_u = _split_uniforms(uniforms, k)
    for i in range(k + 1):
        probs = _reached_row("target_probs", row_probs, i, vocab)  # [vocab]
        if i < k:
            q = q_drafted[i]
            if q > 0.0 and accept_u[i] * q < _prob_at("target_probs", probs, i, tokens[i]):  # u < p/q, no division
                continue
        row = _row("target_probs", probs[None], 0, i)  # [vocab] float64: the row sampled from
        if i == k:
            return Verdict(accepted=k, next_token=inverse_cdf(row, sample_u[k]))
        return Verdict(accepted=i, next_token=inverse_cdf(residual(i, row), sample_u[i], fallback=row))
    raise AssertionError("unreachable: the loop returns at row k")


def verify_coupled(
    target_probs: torch.Tensor,  # [k+1, vocab] rows sum to 1
    draft_tokens: torch.Tensor,  # [k] int64
    noise: Callable[[int, torch.Tensor], torch.Tensor],  # (row i, token ids [n] int64) -> Gumbel noise [n] float64
) -> Verdict:
    """Gumbel-max coupling: row i's token is argmax(log p_i + G_i); accept draft token i iff it equals it.

    Each emitted token is argmax(log p_i + G_i), a sample from p_i, so the
    output is exactly the target's sampling whatever the drafter proposed.
    A drafter that proposes argmax(log q_i + G_i) with the same noise is
    accepted often when q is close to p. Rows past the first mismatch are never
    evaluated (their noise is not asked for).
    """
    _check_block("target_probs", target_probs, draft_tokens)
    return verify_coupled_rows(lambda i: target_probs[i], draft_tokens, target_probs.shape[1], noise)


def verify_coupled_rows(
    row_probs: Callable[[int], torch.Tensor],  # row i -> [vocab] p_i, rows sum to 1; asked for in order, while needed
    draft_tokens: torch.Tensor,  # [k] int64
    vocab: int,
    noise: Callable[[int, torch.Tensor], torch.Tensor],  # (row i, token ids [n] int64) -> Gumbel noise [n] float64
) -> Verdict:
    """``verify_coupled`` with each row's distribution made only when the row is reached.

    Row i is asked for only if every draft token before it was accepted, so a
    block rejected at position j costs j + 1 rows of temperature, top-p and
    noise, not k + 1 (the verdict is the same: rows past the first mismatch
    never decide anything).
    """
    tokens = _check_tokens(draft_tokens, vocab)
    for i in range(len(tokens) + 1):
        row = _row("target_probs", _reached_row("target_probs", row_probs, i, vocab)[None], 0, i)  # [vocab] float64
        chosen = gumbel_max(row, lambda ids, i=i: noise(i, ids))
        if i == len(tokens) or tokens[i] != chosen:
            return Verdict(accepted=i, next_token=chosen)
    raise AssertionError("unreachable: the loop returns at row k")


def _reached_row(name: str, row_probs: Callable[[int], torch.Tensor], i: int, vocab: int) -> torch.Tensor:
    """Row i of a lazily made block, its shape and sum checked: -> [vocab]. Values are checked where used:
    p(x) by ``_prob_at``, a row sampled from by ``_row``."""
    probs = row_probs(i)
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (vocab,):
        raise ValueError(f"{name} row {i} must be a tensor [vocab] = [{vocab}], got {_shape(probs)}")
    _check_float(name, probs)
    _check_row_sums(name, probs[None], first=i)
    return probs


def _prob_at(name: str, probs: torch.Tensor, i: int, token: int) -> float:  # probs: [vocab], row i of a block
    value = float(probs[token])
    if not value >= 0.0:  # `not >=` also catches NaN
        raise ValueError(f"{name} row {i} has a negative or NaN probability at draft token {token}")
    return value


def _check_block(name: str, target: torch.Tensor, draft_tokens: torch.Tensor) -> list[int]:
    """Shapes, dtypes and token range of a block; returns the draft tokens as a list."""
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be a 1-D tensor [k], got {_shape(draft_tokens)}")
    k = draft_tokens.shape[0]
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"{name} must be a 2-D tensor [k+1, vocab] with k = {k} draft tokens, got {_shape(target)}")
    _check_float(name, target)
    return _check_tokens(draft_tokens, target.shape[1])


def _check_tokens(draft_tokens: torch.Tensor, vocab: int) -> list[int]:
    """A block's draft tokens [k] int64, each in [0, vocab); returns them as a list."""
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be a 1-D tensor [k], got {_shape(draft_tokens)}")
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64 (use .long()), got {draft_tokens.dtype}")
    if vocab == 0:
        raise ValueError("target_probs must have a non-empty vocabulary dimension")
    tokens = draft_tokens.tolist()
    if any(not 0 <= token < vocab for token in tokens):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab}), got {tokens}")
    return tokens


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {tensor.dtype}")


def _check_row_sums(name: str, probs: torch.Tensor, first: int = 0) -> None:  # probs: [rows, vocab], rows first..
    # One reduction over the block: NaN or inf anywhere makes a sum non-finite, and logits rarely sum to 1.
    for row, total in enumerate(probs.sum(dim=-1, dtype=torch.float32).tolist(), start=first):
        if not abs(total - 1.0) <= ROW_SUM_TOLERANCE:  # `not <=` also catches NaN
            raise ValueError(
                f"{name} row {row} sums to {total}, not 1: pass finite probabilities (softmax), not logits"
            )


def _shape(value: object) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _split_uniforms(uniforms: torch.Tensor, k: int) -> tuple[list[float], list[float]]:  # -> [k+1], [k+1]
    """The accept-test and sample columns of ``uniforms`` [k+1, 2], checked to lie in [0, 1)."""
    if not isinstance(uniforms, torch.Tensor) or tuple(uniforms.shape) != (k + 1, 2):
        raise ValueError(
            f"uniforms must be a tensor [k+1, 2] = {[k + 1, 2]} (see lmkit.draws.uniforms), got {_shape(uniforms)}"
        )
    if not uniforms.is_floating_point():
        raise ValueError(f"uniforms must be floating point, got dtype {uniforms.dtype}")
    rows = uniforms.tolist()  # k + 1 pairs: checked in Python, cheaper than tensor reductions this small
    if not all(0.0 <= row[ACCEPT] < 1.0 and 0.0 <= row[SAMPLE] < 1.0 for row in rows):  # also refuses NaN
        raise ValueError("uniforms must lie in [0, 1)")
    return [row[ACCEPT] for row in rows], [row[SAMPLE] for row in rows]


def _flat_index(draft_tokens: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:  # -> [k] int64
    """Positions of (i, x_i) in a row-major [rows, vocab] block, for torch.take."""
    k = draft_tokens.shape[0]
    return torch.arange(0, k * vocab, vocab, device=device) + draft_tokens.to(device)


def _probs_at(name: str, probs: torch.Tensor, flat_index: torch.Tensor) -> list[float]:
    """probs[i, x_i] for each draft position i, checked to be probabilities."""
    values = torch.take(probs, flat_index).tolist()
    if any(not (v >= 0.0) for v in values):  # `not >=` also catches NaN
        raise ValueError(f"{name} has a negative or NaN probability at a draft token")
    return values


def _row(name: str, probs: torch.Tensor, index: int, label: int | None = None) -> torch.Tensor:  # -> [vocab] float64
    """Row ``index`` of probs [rows, vocab] on the CPU in float64 (``label``: its row number in messages)."""
    row = probs[index].to(device="cpu", dtype=torch.float64)
    # Row sums were checked finite, so with no negative value every value is finite too.
    if not float(row.min()) >= 0.0:
        raise ValueError(f"{name} row {index if label is None else label} has negative values")
    return row
