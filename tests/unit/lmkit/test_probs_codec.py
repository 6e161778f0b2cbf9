"""Tests for lmkit.probs_codec: the exact fp16 round trip (dense and sparse) and validation of untrusted bytes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from specsplit.lmkit.probs_codec import MAX_DECODED_CELLS, EncodedProbs, decode_probs, encode_probs, quantize_probs

pytestmark = pytest.mark.unit


def bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, so comparisons are bit for bit (torch.equal treats -0.0 == 0.0)."""
    return x.contiguous().view(torch.int32)


def softmax_rows(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:  # [rows, vocab]
    return torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale, dim=-1)


def truncate_top(probs: torch.Tensor, keep: int) -> torch.Tensor:  # [rows, vocab], zero all but the top `keep`
    threshold = probs.topk(keep, dim=-1).values[:, -1:]
    truncated = probs * (probs >= threshold)
    return truncated / truncated.sum(dim=-1, keepdim=True)


def sparse(values: list[float], indices: list[int], row_nnz: tuple[int, ...], vocab: int) -> EncodedProbs:
    return EncodedProbs(
        sparse=True,
        rows=len(row_nnz),
        vocab_size=vocab,
        values=np.asarray(values, dtype="<f2").tobytes(),
        indices=np.asarray(indices, dtype="<i4").tobytes(),
        row_nnz=row_nnz,
    )


def dense(rows: list[list[float]]) -> EncodedProbs:
    return EncodedProbs(
        sparse=False,
        rows=len(rows),
        vocab_size=len(rows[0]) if rows else 1,
        values=np.asarray(rows, dtype="<f2").tobytes(),
        indices=b"",
        row_nnz=(),
    )


# --- the exact round trip -------------------------------------------------------


@pytest.mark.parametrize("vocab, keep, expect_sparse", [(1000, None, False), (5000, 20, True), (49152, 64, True)])
def test_decode_of_encode_of_quantized_is_bit_exact(vocab, keep, expect_sparse):
    probs = softmax_rows(4, vocab, seed=vocab)
    if keep is not None:
        probs = truncate_top(probs, keep)
    quantized = quantize_probs(probs)
    encoded = encode_probs(quantized)
    assert encoded.sparse is expect_sparse
    decoded = decode_probs(encoded)
    assert decoded.dtype == torch.float32 and decoded.shape == probs.shape
    assert torch.equal(bits(decoded), bits(quantized))
    # Encoding the unquantized rows lands on the same bits: the draft may send either.
    assert torch.equal(bits(decode_probs(encode_probs(probs))), bits(quantized))


def test_round_trip_is_exact_over_many_shapes_and_peakiness():
    generator = torch.Generator().manual_seed(11)
    for trial in range(300):
        vocab = int(torch.randint(1, 2000, (1,), generator=generator))
        rows = int(torch.randint(1, 4, (1,), generator=generator))
        scale = float(torch.rand(1, generator=generator)) * 12
        probs = torch.softmax(torch.randn(rows, vocab, generator=generator) * scale, dim=-1)
        if trial % 2 and vocab > 3:
            probs = truncate_top(probs, 3)
        quantized = quantize_probs(probs)
        assert torch.equal(bits(decode_probs(encode_probs(quantized))), bits(quantized)), trial
        assert torch.equal(bits(quantize_probs(quantized)), bits(quantized)), trial


def test_quantized_rows_are_distributions_close_to_the_input():
    probs = softmax_rows(3, 777, seed=3)
    quantized = quantize_probs(probs)
    torch.testing.assert_close(quantized.sum(dim=-1), torch.ones(3), rtol=0, atol=1e-6)
    big = probs > 1e-4  # fp16 keeps ~11 significant bits there
    assert ((quantized[big] - probs[big]).abs() / probs[big]).max() < 2e-3
    assert (quantized.sum(dim=-1) > 0).all()


def test_tiny_probabilities_may_vanish_but_no_row_does():
    probs = torch.tensor([[1.0, 1e-12, 0.0, 1e-9], [1e-30, 1e-30, 2e-30, 0.0]])
    quantized = quantize_probs(probs)
    assert quantized[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # below 2**-25 of the row max: underflows
    torch.testing.assert_close(quantized[1], torch.tensor([0.25, 0.25, 0.5, 0.0]))  # scaled before rounding
    assert torch.equal(bits(decode_probs(encode_probs(quantized))), bits(quantized))


def test_zeros_stay_zero_so_truncated_support_is_kept():
    probs = truncate_top(softmax_rows(2, 300, seed=4), 5)
    quantized = quantize_probs(probs)
    assert torch.equal(quantized > 0, probs > 0)


def test_sparse_is_chosen_only_when_smaller_and_sizes_match():
    probs = truncate_top(softmax_rows(3, 4000, seed=5), 10)
    encoded = encode_probs(probs)
    assert encoded.sparse and encoded.row_nnz == (10, 10, 10)
    assert len(encoded.values) == 2 * 30 and len(encoded.indices) == 4 * 30
    dense_encoded = encode_probs(softmax_rows(2, 50, seed=6))
    assert not dense_encoded.sparse
    assert len(dense_encoded.values) == 2 * 2 * 50 and dense_encoded.indices == b"" and dense_encoded.row_nnz == ()


def test_values_are_little_endian_fp16_scaled_by_the_row_max():
    encoded = encode_probs(torch.tensor([[0.25, 0.5, 0.25]]))
    assert np.frombuffer(encoded.values, dtype="<f2").tolist() == [0.5, 1.0, 0.5]
    decoded = decode_probs(dense([[1.0, 3.0]]))
    assert decoded.tolist() == [[0.25, 0.75]]


def test_empty_block_round_trips():
    decoded = decode_probs(encode_probs(torch.zeros(0, 7)))
    assert decoded.shape == (0, 7)


@pytest.mark.parametrize(
    "probs, message",
    [
        (torch.ones(5), "2-D"),
        (torch.ones(2, 3, dtype=torch.int32), "floating"),
        (torch.tensor([[0.5, -0.1, 0.6]]), ">= 0"),
        (torch.tensor([[0.5, math.nan, 0.5]]), ">= 0"),
        (torch.tensor([[0.5, math.inf, 0.5]]), ">= 0"),
        (torch.tensor([[0.5, 0.5], [0.0, 0.0]]), "row 1"),
    ],
)
def test_encode_and_quantize_refuse_non_distributions(probs, message):
    with pytest.raises(ValueError, match=message):
        encode_probs(probs)
    with pytest.raises(ValueError, match=message):
        quantize_probs(probs)


# --- decoding untrusted bytes ---------------------------------------------------


def test_hand_built_sparse_decodes():
    encoded = sparse([1.0, 1.0, 3.0, 2.0], [0, 4, 2, 3], (2, 2), vocab=5)
    expected = torch.tensor([[0.5, 0, 0, 0, 0.5], [0, 0, 0.6, 0.4, 0]])
    torch.testing.assert_close(decode_probs(encoded), expected, rtol=0, atol=0)


GOOD_SPARSE = sparse([1.0, 0.5, 1.0], [1, 3, 0], (2, 1), vocab=4)
GOOD_DENSE = dense([[1.0, 0.5, 0.0], [0.0, 0.0, 1.0]])


@pytest.mark.parametrize(
    "encoded, message",
    [
        (dataclasses.replace(GOOD_DENSE, values=GOOD_DENSE.values[:-2]), "values has 10 bytes, expected 12"),
        (dataclasses.replace(GOOD_DENSE, values=GOOD_DENSE.values + b"\x00"), "expected 12"),
        (dataclasses.replace(GOOD_DENSE, indices=b"\x00\x00\x00\x00"), "empty indices"),
        (dataclasses.replace(GOOD_DENSE, row_nnz=(1, 1)), "empty indices and row_nnz"),
        (dense([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), "row 1 has no positive value"),
        (dense([[1.0, math.nan]]), "NaN"),
        (dense([[1.0, math.inf]]), "inf"),
        (dense([[1.0, -0.5]]), "negative"),
        (dataclasses.replace(GOOD_DENSE, vocab_size=0), "vocab_size >= 1"),
        (dataclasses.replace(GOOD_DENSE, rows=-1), "rows >= 0"),
        (dataclasses.replace(GOOD_DENSE, rows=True), "rows must be an int"),
        (dataclasses.replace(GOOD_DENSE, sparse=1), "sparse must be a bool"),
        (dataclasses.replace(GOOD_DENSE, values="abc"), "bytes"),
        (dataclasses.replace(GOOD_DENSE, rows=2, vocab_size=MAX_DECODED_CELLS), "limit"),
        (dataclasses.replace(GOOD_SPARSE, row_nnz=(2,)), "row_nnz has 1 entries, expected 2"),
        (dataclasses.replace(GOOD_SPARSE, row_nnz=(3, 0)), "row 1 has 0 non-zeros"),
        (dataclasses.replace(GOOD_SPARSE, row_nnz=(5, 1)), "row 0 has 5 non-zeros, expected an int in 1..4"),
        (dataclasses.replace(GOOD_SPARSE, row_nnz=(1, 2)), r"column indices must strictly increase"),
        (dataclasses.replace(GOOD_SPARSE, values=GOOD_SPARSE.values[:4]), "values needs 6 bytes"),
        (dataclasses.replace(GOOD_SPARSE, indices=GOOD_SPARSE.indices + b"\x00" * 4), "indices 12"),
        (sparse([1.0, 1.0], [0, 4], (2,), vocab=4), "out of range"),
        (sparse([1.0, 1.0], [-1, 2], (2,), vocab=4), "out of range"),
        (sparse([1.0, 1.0], [2, 2], (2,), vocab=4), "strictly increase"),
        (sparse([1.0, 1.0], [3, 1], (2,), vocab=4), "strictly increase"),
        (sparse([0.0, 0.0], [0, 1], (2,), vocab=4), "row 0 has no positive value"),
        (sparse([1.0, math.nan], [0, 1], (2,), vocab=4), "NaN"),
        (sparse([1.0, -1.0], [0, 1], (2,), vocab=4), "negative"),
    ],
)
def test_decode_refuses_malformed_input_saying_what_is_wrong(encoded, message):
    with pytest.raises(ValueError, match=message):
        decode_probs(encoded)


def test_the_malformed_cases_start_from_valid_encodings():
    torch.testing.assert_close(decode_probs(GOOD_SPARSE), torch.tensor([[0, 2 / 3, 0, 1 / 3], [1, 0, 0, 0]]))
    torch.testing.assert_close(decode_probs(GOOD_DENSE), torch.tensor([[2 / 3, 1 / 3, 0], [0, 0, 1]]))
