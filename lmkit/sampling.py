"""Logits processing shared by draft and target.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling") is lossless only if the draft distribution
q and the target distribution p are the distributions the user asked for: the
same temperature, top-k and top-p applied the same way. Both services therefore
turn logits into probabilities through the one function here,
``logits_to_probs``, and never through their own copy.

Order of the processors is the one HF transformers uses: temperature, then
top-k, then top-p, each on the output of the previous one. Before them come
the penalties and biases (``specsplit.lmkit.penalties``), which depend on the
tokens before each position: callers adjust a block's raw logits with
``apply_penalties`` first (for greedy as for sampling), and draft and target
call that one function too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from specsplit.lmkit.draws import SEED_LIMIT
from specsplit.lmkit.penalties import apply_penalties, chain_paths

__all__ = ["SamplingParams", "apply_penalties", "chain_paths", "first_rows", "logits_to_probs", "rows_when_reached"]


@dataclass(frozen=True)
class SamplingParams:
    """How a session turns logits into tokens; the same object drives draft and target."""

    temperature: float = 0.0  # 0 means greedy (argmax); must be >= 0 and finite
    top_k: int = 0  # keep the k most likely tokens; 0 disables; must be >= 0
    top_p: float = 1.0  # nucleus mass, must be in (0, 1]; 1 disables
    seed: int = 0  # keys every random draw of the session (lmkit.draws); >= 0, < 2**63
    # Penalties and biases (lmkit.penalties), applied to the raw logits before temperature.
    repetition_penalty: float = 1.0  # transformers': > 0; 1 disables; over the prompt and the generated tokens
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]; over the generated tokens
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]; over the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id >= 0, bias in [-100, 100]), ids increasing
    min_tokens: int = 0  # eos_token_ids are banned until this many tokens are generated; >= 0
    ignore_eos: bool = False  # the orchestrator does not stop at an end-of-sequence token
    eos_token_ids: tuple[int, ...] = ()  # what min_tokens bans (the model's end-of-sequence tokens)
    prompt_length: int = 0  # absolute position of the first generated token; >= 0

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}"
            )
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables top-k), got {self.top_k}")
        _check_real("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 disables top-p), got {self.top_p!r}")
        _check_int("seed", self.seed)
        if not (0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        _check_real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"SamplingParams.repetition_penalty must be a finite number > 0 (1 disables it), "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_real(name, value)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2] (0 disables it), got {value!r}")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"SamplingParams.logit_bias must have distinct token ids >= 0, increasing, got {ids[:8]}")
        for token, bias in self.logit_bias:
            _check_real(f"logit_bias[{token}]", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"SamplingParams.logit_bias[{token}] must be in [-100, 100], got {bias!r}")
        for name in ("min_tokens", "prompt_length"):
            _check_int(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ValueError(f"SamplingParams.{name} must be >= 0, got {getattr(self, name)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"SamplingParams.eos_token_ids must be token ids >= 0, got {list(self.eos_token_ids)[:8]}")

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax of the logits (temperature 0); top-k/top-p then do nothing."""
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """True when ``apply_penalties`` changes logits: a penalty, a bias or min_tokens is set."""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty or self.logit_bias
            or (self.min_tokens and self.eos_token_ids)
        )

    def tokens(self) -> list[int]:
        """The token ids the params name (logit_bias, eos_token_ids), for a check against a vocabulary."""
        return [*(token for token, _ in self.logit_bias), *self.eos_token_ids]


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams.{name} must be a number, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SamplingParams.{name} must be an int, got {value!r}")


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab] floating point; -inf marks banned tokens
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab] float32, each row sums to 1
    """Temperature, then top-k, then top-p; returns float32 probabilities on the logits' device.

    Top-k keeps exactly ``min(top_k, vocab)`` tokens; among tokens with equal
    logits the lower token id ranks first, so ties are cut deterministically.
    Top-p keeps the smallest prefix of that same ranking whose probability mass
    reaches ``top_p`` (at least the top token). Only for sampling: raises
    ValueError when ``params.greedy``, where the caller should take the argmax.
    """
    _check_logits(logits)
    if params.greedy:
        raise ValueError("logits_to_probs is for sampling (temperature > 0); with temperature 0 take the argmax")
    # Subtracting the row max first keeps a tiny temperature from overflowing to inf.
    logits = logits.to(torch.float32)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = scaled.shape[-1]
    if (params.top_k == 0 or params.top_k >= vocab) and params.top_p == 1.0:
        return torch.softmax(scaled, dim=-1)
    if params.top_k == 0 or params.top_k >= vocab:
        keep = _nucleus_mask(scaled, params.top_p)
    else:
        keep = _truncation_mask(scaled, params.top_k, params.top_p)
    return torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)


def static_probs(
    logits: torch.Tensor,  # [..., vocab] float32; -inf marks banned tokens
    temperature: torch.Tensor,  # [] float32 > 0
    top_k: torch.Tensor,  # [] int64; 0 or >= vocab: no top-k
    top_p: torch.Tensor,  # [] float64 in (0, 1]
) -> torch.Tensor:  # [..., vocab] float32
    """``logits_to_probs`` with the settings as tensors, by tensor operations of fixed shapes only (no
    host value read, no branch on a value): what a CUDA graph captures once for every request (``chain_step``).
    Equal to ``logits_to_probs``: its cuts are those of the one sort of the whole row this takes, by the same sums
    (top-p alone over the whole row's softmax, top-k then top-p over the softmax of the k kept)."""
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    truncating = (top_k > 0) & (top_k < vocab)
    in_k = (torch.arange(vocab, device=scaled.device) < top_k) | ~truncating
    by_k = torch.softmax(sorted_logits.masked_fill(~in_k, -math.inf), dim=-1)
    whole = torch.softmax(scaled, dim=-1).gather(-1, order)
    mass = _mass_before(torch.where(truncating, by_k, whole))
    keep_sorted = in_k & ((top_p >= 1.0) | (mass < top_p))
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)


def rows_when_reached(
    logits: torch.Tensor,  # [rows, vocab]
    params: SamplingParams,
    first: torch.Tensor | None = None,  # [vocab]: row 0 already made (``first_rows``), or None
) -> Callable[[int], torch.Tensor]:
    """Row i of ``logits_to_probs(logits, params)`` [rows, vocab] -> [vocab], made when first asked for.

    For verifiers that walk a block's rows in order and stop at the first
    rejection (most sampled blocks stop at row 0): row 0 is made alone, and the
    first question past it makes every later row in one call, so a block
    rejected at once pays one row and one accepted whole pays two calls, not
    k + 1. Each row equals the eager block's (the processing is row-wise).
    """
    made: dict[int, torch.Tensor] = {} if first is None else {0: first}

    def row(i: int) -> torch.Tensor:
        if i not in made:
            if i == 0:
                made[0] = logits_to_probs(logits[:1], params)[0]
            else:
                made.update(enumerate(logits_to_probs(logits[1:], params), start=1))
        return made[i]

    return row


FIRST_ROWS_PER_CALL = 8  # past it a call costs more per row (experiments/sampling_profile/sampling-profile.json)


def first_rows(blocks: Sequence[tuple[torch.Tensor, SamplingParams]]) -> list[torch.Tensor | None]:
    """Row 0 of ``logits_to_probs`` for several blocks (each [rows, vocab] with its params) -> [vocab] each.

    Blocks whose params process logits alike (temperature, top-k, top-p; the
    seed plays no part) share calls of up to ``FIRST_ROWS_PER_CALL`` rows: on a
    CPU a call over a few rows costs far less than a call per row. A call that
    fails (e.g. NaN logits in one block) gives None for each of its blocks, so
    each meets its own failure alone in ``rows_when_reached``.
    """
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, (_, params) in enumerate(blocks):
        groups.setdefault((params.temperature, params.top_k, params.top_p), []).append(i)
    rows: list[torch.Tensor | None] = [None] * len(blocks)
    n = FIRST_ROWS_PER_CALL
    chunks = (group[i : i + n] for group in groups.values() for i in range(0, len(group), n))
    for members in chunks:
        try:
            made = logits_to_probs(torch.stack([blocks[i][0][0] for i in members]), blocks[members[0]][1])
        except ValueError:
            continue
        for i, probs in zip(members, made):
            rows[i] = probs
    return rows


ARGMAX_CHUNK = 64  # vocabulary positions whose maximum one vectorized amax finds together (row_argmax)


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, vocab] -> [rows], [rows]
    """Each row's maximum and the index of its first occurrence: what ``logits.max(dim=-1)`` returns.

    torch's max with indices over rows of a large vocabulary runs an element at a time on the CPU; a
    vectorized amax over chunks of ``ARGMAX_CHUNK``, then the first chunk holding the row's maximum, then
    the first position in it, finds the same index (ties to the lowest id) in a fraction of the time, one
    row too (a k = 0 step's: 60-76 us of max against 11 us of amax in the target's step). A NaN in a row
    makes that row's maximum NaN, as max does. Other shapes and devices use max itself.
    """
    rows, vocab = logits.shape
    if vocab % ARGMAX_CHUNK or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.max(dim=-1)
    chunks = logits.view(rows, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    chunk_max = chunks.amax(dim=-1)  # [rows, vocab / chunk]
    chunk = chunk_max.argmax(dim=-1)  # [rows]: the first chunk holding the row's maximum (a NaN's, if any)
    inner = chunks[torch.arange(rows), chunk]  # [rows, chunk]
    return chunk_max.gather(1, chunk[:, None])[:, 0], chunk * ARGMAX_CHUNK + inner.argmax(dim=-1)


def block_argmax(blocks: Sequence[torch.Tensor]) -> list[list[int] | None]:
    """The argmax id of every row of each block [m_i, vocab] (ties to the lowest id), or None for a block with a
    NaN row: one ``row_argmax`` per run of blocks that are consecutive rows of one tensor, as a packed forward's
    per-session logits are, so a batch's greedy rows are decided by a few ops whatever the number of sessions."""
    choices: list[list[int] | None] = [None] * len(blocks)
    for run, joined in _joined_runs(blocks):
        best, index = row_argmax(joined)
        best, index, start = best.tolist(), index.tolist(), 0
        for i in run:
            end = start + blocks[i].shape[0]
            if not any(math.isnan(v) for v in best[start:end]):
                choices[i] = index[start:end]
            start = end
    return choices


def block_topk(blocks: Sequence[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The ``k`` highest-scoring ids of every row of each block [m_i, vocab], best first: per block [m_i, k] int64,
    one ``topk`` per run of consecutive blocks (``block_argmax``)."""
    chosen: list[torch.Tensor | None] = [None] * len(blocks)
    for run, joined in _joined_runs(blocks):
        ids, start = joined.topk(min(k, joined.shape[1]), dim=-1).indices, 0
        for i in run:
            end = start + blocks[i].shape[0]
            chosen[i] = ids[start:end]
            start = end
    return chosen


def _joined_runs(blocks: Sequence[torch.Tensor]) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Each run of consecutive blocks, and a view of all its rows [sum of m_i, vocab] (no copy)."""
    for run in consecutive_runs(blocks):
        first, rows = blocks[run[0]], sum(blocks[i].shape[0] for i in run)
        yield run, first if len(run) == 1 else first.as_strided((rows, first.shape[1]), first.stride(),
                                                                 first.storage_offset())


def consecutive_runs(blocks: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``blocks`` grouped into runs whose rows follow each other in one contiguous storage."""
    runs: list[list[int]] = []
    end = None  # (storage, element offset) just past the last block of the current run
    for i, block in enumerate(blocks):
        if block.dim() != 2 or not block.is_contiguous():
            runs.append([i])
            end = None
            continue
        storage, offset = block.untyped_storage().data_ptr(), block.storage_offset()
        previous = blocks[runs[-1][-1]] if runs else None
        if end == (storage, offset) and previous.dtype == block.dtype and previous.shape[1] == block.shape[1]:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = (storage, offset + block.numel())
    return runs


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [n, vocab], got {_describe(logits)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    if logits.numel() == 0:
        return
    # One reduction: a row max is NaN if the row has a NaN, +inf if it has +inf, -inf if all are -inf.
    for row, high in enumerate(logits.amax(dim=-1).tolist()):
        if math.isnan(high) or high == math.inf:
            raise ValueError(f"logits row {row} contains NaN or +inf; check the model output")
        if high == -math.inf:
            raise ValueError(f"logits row {row} is all -inf: every token is banned, nothing can be sampled")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__


# Widths of the candidate lists a nucleus is looked for in before the whole row is sorted: at the
# temperatures people use, the top-p cut falls within the first few hundred tokens, and selecting the
# top m of a row (torch.topk) costs far less than sorting all of it.
NUCLEUS_CANDIDATES = (256, 2048)


def _nucleus_mask(
    scaled: torch.Tensor,  # [n, vocab] float32 temperature-scaled logits
    top_p: float,
) -> torch.Tensor:  # [n, vocab] bool, True = token kept
    """Top-p alone: the cut a sort of the whole row gives, found among the top candidates where it lies.

    Row r keeps its c_r most likely tokens, c_r the count whose mass before
    them is below ``top_p``. When that cut lies inside the top m candidates and
    no tie straddles it, the kept set is exactly those candidates (any order of
    equal logits gives the same prefix sums), so the rest of the row is never
    sorted; other rows try a wider list, then the full sort.
    """
    probs = torch.softmax(scaled, dim=-1)  # [n, vocab] float32, the mass every path cuts by
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    pending = torch.arange(scaled.shape[0])  # rows whose cut is not found yet
    for width in NUCLEUS_CANDIDATES:
        if width >= scaled.shape[-1] or pending.numel() == 0:
            break
        values, ids = torch.topk(scaled[pending], width, dim=-1)  # [m, width] descending
        found = _cut_in_candidates(probs[pending].gather(-1, ids), values, top_p)  # [m] count kept, -1: not here
        done = found >= 0
        rows, counts = pending[done], found[done]
        keep[rows] = keep[rows].scatter(-1, ids[done], torch.arange(width) < counts[:, None])
        pending = pending[~done]
    if pending.numel():
        order = torch.sort(scaled[pending], dim=-1, descending=True, stable=True).indices  # [m, vocab]
        mass_before = _mass_before(probs[pending].gather(-1, order))
        keep[pending] = keep[pending].scatter(-1, order, mass_before < top_p)
    return keep


def _mass_before(sorted_probs: torch.Tensor) -> torch.Tensor:  # [m, w] descending -> [m, w] float64
    # float64 cumsum: float32 rounding over ~50k terms could move the cut by a token.
    sorted_probs = sorted_probs.to(torch.float64)
    return torch.cumsum(sorted_probs, dim=-1) - sorted_probs


def _cut_in_candidates(
    candidate_probs: torch.Tensor,  # [m, w] float32, probabilities of the top-w tokens, descending
    candidate_logits: torch.Tensor,  # [m, w] float32, their scaled logits
    top_p: float,
) -> torch.Tensor:  # [m] int64: tokens kept, or -1 where the cut is not decided within the candidates
    kept = (_mass_before(candidate_probs) < top_p).sum(dim=-1)  # a prefix: mass before is non-decreasing
    inside = kept < candidate_probs.shape[-1]
    last = candidate_logits.gather(-1, (kept - 1).clamp(min=0)[:, None])[:, 0]
    first_out = candidate_logits.gather(-1, kept.clamp(max=candidate_probs.shape[-1] - 1)[:, None])[:, 0]
    return torch.where(inside & (last > first_out), kept, torch.full_like(kept, -1))


def _truncation_mask(
    scaled: torch.Tensor,  # [n, vocab] float32 temperature-scaled logits
    top_k: int,
    top_p: float,
) -> torch.Tensor:  # [n, vocab] bool, True = token kept
    """Top-k then top-p as one cut of a single ranking (descending logit, then ascending id).

    A row whose k-th and (k+1)-th largest logits differ has as its first k ranks exactly the k
    tokens torch.topk selects, ranked among themselves; the rest of the row is cut by top-k
    whatever its order, so it is never sorted, and top-p is computed on the same values as after
    a sort of the whole row. Rows where a tie straddles the k-th place are sorted whole.
    """
    if not 0 < top_k < scaled.shape[-1]:
        return _sorted_truncation_mask(scaled, top_k, top_p)
    values, ids = torch.topk(scaled, top_k + 1, dim=-1)  # [n, k+1] descending, ties in any order
    clear = values[:, top_k - 1] > values[:, top_k]  # [n] no tie across the cut
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    if bool(clear.any()):
        by_id, where = torch.sort(ids[clear, :top_k], dim=-1)  # [m, k] candidates in id order
        ranked_logits, rank = torch.sort(values[clear, :top_k].gather(-1, where), dim=-1, descending=True, stable=True)
        keep_ranked = torch.ones_like(ranked_logits, dtype=torch.bool)  # [m, k]
        if top_p < 1.0:
            # The sorted row of the full path, cut by top-k: the k ranked logits, then -inf.
            sorted_logits = torch.full_like(scaled[clear], -math.inf)
            sorted_logits[:, :top_k] = ranked_logits
            keep_ranked &= _mass_before(torch.softmax(sorted_logits, dim=-1))[:, :top_k] < top_p
        keep[clear] = keep[clear].scatter(-1, by_id.gather(-1, rank), keep_ranked)
    if not bool(clear.all()):
        keep[~clear] = _sorted_truncation_mask(scaled[~clear], top_k, top_p)
    return keep


def _sorted_truncation_mask(
    scaled: torch.Tensor,  # [n, vocab] float32 temperature-scaled logits
    top_k: int,
    top_p: float,
) -> torch.Tensor:  # [n, vocab] bool, True = token kept
    """_truncation_mask by a sort of the whole row."""
    # A stable descending sort keeps equal logits in id order, which is the documented tie rule.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < scaled.shape[-1]:
        keep_sorted[:, top_k:] = False
    if top_p < 1.0:
        sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
        keep_sorted &= _mass_before(sorted_probs) < top_p  # position 0 has mass_before 0 < top_p, so the top token stays
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
