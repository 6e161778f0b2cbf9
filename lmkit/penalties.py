"""Penalties and biases: logits adjusted by the tokens before each position.

Speculative verification scores several positions in one pass, so each row of
a block's logits gets the context of its own position: the committed tokens,
then the draft tokens before it (for a token-tree node, its root path). Row i
then holds exactly the logits a one-token-at-a-time decode would have had
there, which keeps greedy output equal to the target's and sampling lossless.

The adjustments, in this order (vLLM's), on the raw logits, before temperature:

- ``logit_bias``: bias[t] is added to token t's logit (OpenAI's ``logit_bias``).
- ``min_tokens``: while fewer than that many tokens are generated, the
  ``eos_token_ids`` are banned (-inf).
- ``repetition_penalty`` r (CTRL, Keskar et al. 2019, as HF transformers applies
  it): every token present in the prompt or the generated tokens has its logit
  l divided by r when l > 0, multiplied by r otherwise.
- ``frequency_penalty`` f and ``presence_penalty`` a (OpenAI's formula):
  l[t] -= c[t] * f + (c[t] > 0) * a, c[t] the count of t among the generated
  tokens only.

Pure: no I/O; torch only.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch


class PenaltyParams(Protocol):
    """What the adjustments read (``specsplit.lmkit.sampling.SamplingParams`` has it)."""

    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    min_tokens: int
    eos_token_ids: tuple[int, ...]
    prompt_length: int

    @property
    def penalizes(self) -> bool: ...


def apply_penalties(
    logits: torch.Tensor,  # [n, vocab] raw logits of n consecutive positions (or tree nodes)
    params: PenaltyParams,
    context: Sequence[int],  # the committed tokens, prompt first, before row 0's position
    paths: Sequence[Sequence[int]],  # [n] the draft tokens between the context and each row's position
) -> torch.Tensor:  # [n, vocab] float32; the input itself when ``params`` adjusts nothing
    """The logits of each row adjusted by the tokens before its position (module docstring)."""
    if not params.penalizes:
        return logits
    if len(paths) != logits.shape[0]:
        raise ValueError(f"{len(paths)} paths for {logits.shape[0]} logits rows; send one per row")
    out = logits.to(torch.float32, copy=True)
    vocab = out.shape[-1]
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        out[:, list(ids)] += torch.tensor(biases, dtype=torch.float32)
    if params.min_tokens and params.eos_token_ids:
        early = [i for i, path in enumerate(paths) if _generated(params, len(context) + len(path)) < params.min_tokens]
        if early:
            out[torch.tensor(early)[:, None], torch.tensor(params.eos_token_ids)[None, :]] = -math.inf
    if params.repetition_penalty == 1.0 and not params.frequency_penalty and not params.presence_penalty:
        return out
    generated = _counts(context[params.prompt_length :], paths, vocab)  # [n, vocab]
    if params.repetition_penalty != 1.0:
        seen = _counts(context[: params.prompt_length], [()], vocab) + generated > 0  # [n, vocab]
        penalty = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * generated
    if params.presence_penalty:
        out -= params.presence_penalty * (generated > 0).to(torch.float32)
    return out


def chain_state(params: PenaltyParams, context: Sequence[int], vocab: int) -> dict[str, torch.Tensor]:
    """What ``adjust`` reads for the positions after ``context`` (the committed tokens, prompt first), as [vocab]
    tensors and scalars: a chain drafted on the device adjusts each next position's logits by them and counts
    each drafted token in (``lmkit.chain_step``). Neutral (``adjust`` changes nothing) where ``params`` adjusts
    nothing."""
    bias = torch.zeros(vocab, dtype=torch.float32)
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        bias[list(ids)] += torch.tensor(biases, dtype=torch.float32)
    eos = torch.zeros(vocab, dtype=torch.bool)
    if params.min_tokens and params.eos_token_ids:
        eos[list(params.eos_token_ids)] = True
    generated = _counts(context[params.prompt_length :], [()], vocab)[0]
    seen = (_counts(context[: params.prompt_length], [()], vocab)[0] + generated > 0) \
        if params.repetition_penalty != 1.0 else torch.zeros(vocab, dtype=torch.bool)
    return {"bias": bias, "eos": eos, "ban_until": torch.tensor(params.prompt_length + params.min_tokens),
            "repetition": torch.tensor(float(params.repetition_penalty), dtype=torch.float32),
            "frequency": torch.tensor(float(params.frequency_penalty), dtype=torch.float32),
            "presence": torch.tensor(float(params.presence_penalty), dtype=torch.float32),
            "generated": generated, "seen": seen}


def adjust(logits: torch.Tensor, state: dict[str, torch.Tensor], position: torch.Tensor) -> torch.Tensor:
    """``apply_penalties`` for one position (absolute ``position``, a [] long tensor) of [vocab] float32 logits by
    tensor operations only, from ``chain_state`` (updated as tokens are drafted): the same operations in the same
    order, so the same values; a neutral state leaves the logits as they are."""
    out = logits + state["bias"]
    out = torch.where(state["eos"] & (position < state["ban_until"]), -math.inf, out)
    penalty = state["repetition"]
    out = torch.where(state["seen"], torch.where(out > 0, out / penalty, out * penalty), out)
    out = out - state["frequency"] * state["generated"]
    return out - state["presence"] * (state["generated"] > 0).to(torch.float32)


def chain_paths(draft_tokens: Sequence[int]) -> list[Sequence[int]]:
    """The paths of a chain's k + 1 rows: row i follows draft_tokens[:i]."""
    return [draft_tokens[:i] for i in range(len(draft_tokens) + 1)]


def _generated(params: PenaltyParams, position: int) -> int:
    """Tokens generated before absolute ``position``."""
    return position - params.prompt_length


def _counts(
    shared: Sequence[int],  # tokens every row counts
    paths: Sequence[Sequence[int]],  # [n] tokens each row adds
    vocab: int,
) -> torch.Tensor:  # [n, vocab] float32: how often each token occurs in shared + paths[i]
    base = torch.bincount(torch.tensor(list(shared), dtype=torch.long), minlength=vocab)[:vocab]
    counts = base.to(torch.float32).expand(len(paths), vocab).clone()
    rows = [i for i, path in enumerate(paths) for _ in path]
    if rows:
        tokens = [token for path in paths for token in path]
        counts.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.ones(len(rows)), accumulate=True)
    return counts
