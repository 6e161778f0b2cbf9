"""Compact, exact wire encoding of draft distributions q for probability-mode verification.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling")
accepts x with probability min(1, p(x)/q(x)) and is lossless only if q is *exactly* the
distribution x was sampled from. q travels as fp16, so the draft samples from the fp16-rounded q:

    q_wire = quantize_probs(q)           # draft samples x from q_wire
    decode_probs(encode_probs(q_wire))   # == q_wire, bit for bit, on the target

Each row is divided by its maximum before rounding (the top token is exactly 1.0, so no row rounds
to all zeros), and the decoder sums each row in float64, exact in any order on any device, before
dividing by it. A row with few non-zeros (top-k / top-p truncated) is sent sparse: fp16 values plus
int32 column indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Refuse to allocate more than this many decoded cells from an untrusted header (256 MiB of float32).
MAX_DECODED_CELLS = 1 << 26

_FP16 = np.dtype("<f2")
_INT32 = np.dtype("<i4")


@dataclass(frozen=True)
class EncodedProbs:
    """A [rows, vocab_size] block of probabilities as it travels on the wire."""

    sparse: bool
    rows: int
    vocab_size: int
    values: bytes  # fp16 little-endian; dense: rows*vocab_size values; sparse: the non-zeros row after row
    indices: bytes  # int32 little-endian column indices of the sparse values (empty when dense)
    row_nnz: tuple[int, ...]  # non-zeros per row (sparse only; empty when dense)


def quantize_probs(probs: torch.Tensor) -> torch.Tensor:  # probs: [k, vocab] -> [k, vocab] float32
    """The distribution the draft must sample from: ``probs`` rounded through fp16, renormalised in float32.

    Equals ``decode_probs(encode_probs(probs))`` and is a fixed point of that
    round trip: re-encoding a decoded row divides by its maximum again, which lands
    within a few float32 ulps of the same fp16 values and so rounds back to them
    exactly. Probabilities below 2**-25 of the row's maximum underflow to 0 on both
    sides alike. Rows need not be normalised on input, only non-negative with a
    positive entry.
    """
    return _renormalise(_round_fp16(probs))


def quantize_unchecked(probs: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [..., vocab] float32
    """``quantize_probs`` without its checks, which read values on the host: tensor operations only, for a step a
    CUDA graph captures (``chain_step``). The caller vouches for the rows (softmax outputs)."""
    return _renormalise(_scale_fp16(probs.to(torch.float32)))


def encode_probs(probs: torch.Tensor) -> EncodedProbs:  # probs: [k, vocab]
    """Rounds ``probs`` to fp16 (as ``quantize_probs`` does) and packs the smaller of dense and sparse."""
    scaled = _round_fp16(probs).cpu()
    rows, vocab = scaled.shape
    nnz = int(torch.count_nonzero(scaled))
    # Sparse costs 2 (value) + 4 (index) bytes per non-zero plus about 4 bytes of count per row.
    if 6 * nnz + 4 * rows < 2 * rows * vocab:
        row_index, column = scaled.nonzero(as_tuple=True)  # row-major, so columns ascend within a row
        return EncodedProbs(
            sparse=True,
            rows=rows,
            vocab_size=vocab,
            values=scaled[row_index, column].numpy().astype(_FP16, copy=False).tobytes(),
            indices=column.numpy().astype(_INT32).tobytes(),
            row_nnz=tuple(torch.bincount(row_index, minlength=rows).tolist()),
        )
    return EncodedProbs(
        sparse=False,
        rows=rows,
        vocab_size=vocab,
        values=scaled.numpy().astype(_FP16, copy=False).tobytes(),
        indices=b"",
        row_nnz=(),
    )


def decode_probs(enc: EncodedProbs) -> torch.Tensor:  # -> [rows, vocab_size] float32
    """Unpacks and renormalises each row to sum 1; validates everything, since the bytes come off the network.

    The caller still checks that ``enc.vocab_size`` and ``enc.rows`` are the ones it expects.
    """
    _check_header(enc)
    if enc.sparse:
        scaled = _unpack_sparse(enc)
    else:
        scaled = _unpack_dense(enc)
    if enc.rows:
        _check_rows(scaled.to(torch.float32), "encoded probabilities contain NaN, inf or negative values")
    return _renormalise(scaled)


def _round_fp16(probs: torch.Tensor) -> torch.Tensor:  # [k, vocab] -> [k, vocab] float16, row max exactly 1
    _check_probs(probs)
    probs = probs.to(torch.float32)
    if probs.numel() == 0:
        return probs.to(torch.float16)
    return _scale_fp16(probs)


def _scale_fp16(probs: torch.Tensor) -> torch.Tensor:  # float32 [..., vocab] -> float16, row max exactly 1
    # x / max(x) is exactly 1.0 at the argmax, so every row keeps at least its top token.
    return (probs / probs.amax(dim=-1, keepdim=True)).to(torch.float16)


def _renormalise(scaled: torch.Tensor) -> torch.Tensor:  # [k, vocab] float16 -> [k, vocab] float32
    # fp16 values in [0, 1] are multiples of 2**-24, so a float64 sum of fewer than 2**29 of them is
    # exact in any summation order; rounding it to float32 and one IEEE division per value then give
    # draft and target the same bits on any device.
    total = scaled.sum(dim=-1, keepdim=True, dtype=torch.float64).to(torch.float32)
    return scaled.to(torch.float32) / total


def _check_probs(probs: torch.Tensor) -> None:
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"probs must be a 2-D tensor [k, vocab], got {shape}")
    if not probs.is_floating_point():
        raise ValueError(f"probs must be floating point, got dtype {probs.dtype}")
    if probs.shape[1] == 0:
        raise ValueError("probs must have a non-empty vocabulary dimension")
    if probs.numel() == 0:
        return
    _check_rows(probs.to(torch.float32), "probs must be finite and >= 0 (pass probabilities, not logits)")


def _check_rows(probs: torch.Tensor, what: str) -> None:  # probs: [k, vocab]
    """Every value finite and >= 0, every row with a positive value."""
    # Two reductions instead of isfinite/isnan scans: NaN propagates into min and max and fails
    # `>= 0`, +inf shows in the row max. (torch.aminmax(dim=) is far slower on small rows.)
    high = probs.amax(dim=-1)
    if not float(probs.amin()) >= 0 or not bool(torch.isfinite(high).all()):
        raise ValueError(what)
    empty = (high <= 0).nonzero()
    if empty.numel():
        raise ValueError(f"row {int(empty[0])} has no positive value, so it is no distribution")


def _check_header(enc: EncodedProbs) -> None:
    if not isinstance(enc, EncodedProbs):
        raise ValueError(f"expected EncodedProbs, got {type(enc).__name__}")
    for name in ("rows", "vocab_size"):
        value = getattr(enc, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"encoded probabilities: {name} must be an int, got {value!r}")
    if not isinstance(enc.sparse, bool):
        raise ValueError(f"encoded probabilities: sparse must be a bool, got {enc.sparse!r}")
    if enc.rows < 0 or enc.vocab_size < 1:
        raise ValueError(
            f"encoded probabilities: need rows >= 0 and vocab_size >= 1, got {enc.rows} x {enc.vocab_size}"
        )
    if enc.rows * enc.vocab_size > MAX_DECODED_CELLS:
        raise ValueError(
            f"encoded probabilities: {enc.rows} x {enc.vocab_size} exceeds the {MAX_DECODED_CELLS}-cell limit"
        )
    if not isinstance(enc.values, (bytes, bytearray)) or not isinstance(enc.indices, (bytes, bytearray)):
        raise ValueError("encoded probabilities: values and indices must be bytes")


def _unpack_dense(enc: EncodedProbs) -> torch.Tensor:  # -> [rows, vocab] float16
    expected = 2 * enc.rows * enc.vocab_size
    if len(enc.values) != expected:
        raise ValueError(
            f"dense encoded probabilities: values has {len(enc.values)} bytes, "
            f"expected {expected} (2 per fp16 value, {enc.rows} x {enc.vocab_size})"
        )
    if enc.indices or enc.row_nnz:
        raise ValueError("dense encoded probabilities must have empty indices and row_nnz")
    values = np.frombuffer(enc.values, dtype=_FP16).astype(np.float16)
    return torch.from_numpy(values).reshape(enc.rows, enc.vocab_size)


def _unpack_sparse(enc: EncodedProbs) -> torch.Tensor:  # -> [rows, vocab] float16
    row_nnz = _check_row_nnz(enc)
    total = int(row_nnz.sum())
    if len(enc.values) != 2 * total or len(enc.indices) != 4 * total:
        raise ValueError(
            f"sparse encoded probabilities: row_nnz sums to {total}, so values needs {2 * total} bytes "
            f"and indices {4 * total}; got {len(enc.values)} and {len(enc.indices)}"
        )
    values = torch.from_numpy(np.frombuffer(enc.values, dtype=_FP16).astype(np.float16))
    columns = torch.from_numpy(np.frombuffer(enc.indices, dtype=_INT32).astype(np.int64))
    row_index = torch.repeat_interleave(torch.arange(enc.rows), row_nnz)
    _check_columns(columns, row_index, enc.vocab_size)
    scaled = torch.zeros(enc.rows, enc.vocab_size, dtype=torch.float16)
    scaled[row_index, columns] = values
    return scaled


def _check_row_nnz(enc: EncodedProbs) -> torch.Tensor:  # -> [rows] int64
    if not isinstance(enc.row_nnz, (tuple, list)) or len(enc.row_nnz) != enc.rows:
        count = len(enc.row_nnz) if isinstance(enc.row_nnz, (tuple, list)) else type(enc.row_nnz).__name__
        raise ValueError(f"sparse encoded probabilities: row_nnz has {count} entries, expected {enc.rows}")
    for row, nnz in enumerate(enc.row_nnz):
        if isinstance(nnz, bool) or not isinstance(nnz, int) or not (1 <= nnz <= enc.vocab_size):
            raise ValueError(
                f"sparse encoded probabilities: row {row} has {nnz!r} non-zeros, expected an int in 1..{enc.vocab_size}"
            )
    return torch.tensor(enc.row_nnz, dtype=torch.int64)


def _check_columns(
    columns: torch.Tensor,  # [nnz] int64
    row_index: torch.Tensor,  # [nnz] int64, the row of each column
    vocab: int,
) -> None:
    if columns.numel() == 0:
        return
    if int(columns.min()) < 0 or int(columns.max()) >= vocab:
        raise ValueError(f"sparse encoded probabilities: column index out of range [0, {vocab})")
    # Within a row columns must strictly ascend; that also rules out duplicates overwriting each other.
    same_row = row_index[1:] == row_index[:-1]
    if bool((same_row & (columns[1:] <= columns[:-1])).any()):
        raise ValueError("sparse encoded probabilities: column indices must strictly increase within each row")
