"""Conversions between ``specsplit.v1`` messages and domain values, with validation.

Anything that arrives over the wire passes through here; a bad field becomes
``errors.InvalidArgument`` with a message naming the field and what to send.
"""

from __future__ import annotations

import torch

from specsplit.lmkit import errors, token_mask
from specsplit.lmkit.features import FeatureBlock, decode_features, encode_features
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.probs_codec import EncodedProbs, decode_probs, encode_probs
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.successors import Successors
from specsplit.v1 import specsplit_pb2 as pb

MAX_TOP_LOGPROBS = 20  # most likely alternatives a session may ask for per token (OpenAI's limit)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    repetition = msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
    try:
        return SamplingParams(
            temperature=msg.temperature, top_k=msg.top_k, top_p=top_p, seed=msg.seed,
            repetition_penalty=repetition, presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty, logit_bias=tuple(sorted(msg.logit_bias.items())),
            min_tokens=msg.min_tokens, ignore_eos=msg.ignore_eos, eos_token_ids=tuple(msg.eos_token_ids),
            prompt_length=msg.prompt_length,
        )
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


def mode_from_proto(value: int) -> VerificationMode:
    """A ``VerificationMode`` field's value; 0 (unspecified) is refused: callers that allow it check first."""
    try:
        return VerificationMode(value)
    except ValueError:
        names = ", ".join(f"{mode.name} ({mode.value})" for mode in VerificationMode)
        raise errors.InvalidArgument(f"mode {value} is not a verification mode; send one of {names}") from None


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos, eos_token_ids=params.eos_token_ids, prompt_length=params.prompt_length,
    )


def probs_to_proto(probs: torch.Tensor) -> pb.DraftProbs:
    """[k, vocab] draft distributions -> compact fp16 message (sparse when smaller)."""
    enc = encode_probs(probs)
    return pb.DraftProbs(
        rows=enc.rows,
        vocab_size=enc.vocab_size,
        sparse=enc.sparse,
        values=enc.values,
        indices=enc.indices,
        row_nnz=list(enc.row_nnz),
    )


def probs_from_proto(msg: pb.DraftProbs, vocab_size: int) -> torch.Tensor:
    """Decode untrusted draft probabilities into [rows, vocab] float32."""
    if msg.vocab_size != vocab_size:
        raise errors.InvalidArgument(f"draft_probs.vocab_size is {msg.vocab_size}; the target's vocabulary has {vocab_size}")
    enc = EncodedProbs(
        sparse=msg.sparse,
        rows=msg.rows,
        vocab_size=msg.vocab_size,
        values=msg.values,
        indices=msg.indices,
        row_nnz=tuple(msg.row_nnz),
    )
    try:
        return decode_probs(enc)
    except ValueError as exc:
        raise errors.InvalidArgument(f"draft_probs: {exc}") from None


def mask_from_proto(msg: pb.TokenMask, vocab_size: int) -> torch.Tensor:  # -> [rows, vocab] bool
    """Decode an untrusted token mask."""
    try:
        return token_mask.unpack(msg.bits, msg.rows, vocab_size)
    except ValueError as exc:
        raise errors.InvalidArgument(f"allowed: {exc}") from None


def drop_leading_rows(msg: pb.DraftProbs, n: int) -> pb.DraftProbs:
    """The same distributions without their first ``n`` rows (byte slicing; nothing is re-encoded)."""
    if not 0 <= n <= msg.rows:
        raise ValueError(f"cannot drop {n} of {msg.rows} rows")
    if msg.sparse:
        nnz = sum(msg.row_nnz[:n])
        return pb.DraftProbs(
            rows=msg.rows - n, vocab_size=msg.vocab_size, sparse=True,
            values=msg.values[2 * nnz :], indices=msg.indices[4 * nnz :], row_nnz=list(msg.row_nnz[n:]),
        )
    return pb.DraftProbs(rows=msg.rows - n, vocab_size=msg.vocab_size, values=msg.values[2 * n * msg.vocab_size :])


def features_to_proto(block: FeatureBlock) -> pb.HiddenFeatures:
    """Features of committed positions -> fp16 message."""
    return pb.HiddenFeatures(
        position=block.position, rows=block.rows, width=block.width, values=encode_features(block.values)
    )


def features_from_proto(msg: pb.HiddenFeatures, width: int) -> FeatureBlock:
    """Decode untrusted features; ``width`` is what the receiver expects per row."""
    if msg.width != width:
        raise errors.InvalidArgument(f"features.width is {msg.width}; this session expects {width} values per position")
    try:
        return FeatureBlock(msg.position, decode_features(msg.values, msg.rows, msg.width))
    except ValueError as exc:
        raise errors.InvalidArgument(f"features: {exc}") from None


def join_features(held: pb.HiddenFeatures | None, new: pb.HiddenFeatures) -> pb.HiddenFeatures:
    """Features not yet forwarded, followed by newer ones (byte slicing; nothing is re-encoded).

    ``new`` wins where the two overlap; a gap between them (or a change of
    width) drops ``held``: the draft then restarts its context at ``new``.
    """
    if held is None or held.rows == 0 or held.width != new.width or new.position > held.position + held.rows:
        return new
    if new.position <= held.position:
        return new
    keep = new.position - held.position  # rows of ``held`` before ``new`` starts
    return pb.HiddenFeatures(
        position=held.position, rows=keep + new.rows, width=new.width,
        values=held.values[: 2 * keep * held.width] + new.values,
    )


def successors_to_proto(successors: Successors) -> pb.Successors:
    return pb.Successors(k=successors.k, tokens=successors.tokens, ids=successors.ids)


def successors_from_proto(msg: pb.Successors) -> Successors:
    """Raises InvalidArgument when the ids are not one row of k per token."""
    try:
        return Successors(msg.k, tuple(msg.tokens), tuple(msg.ids))
    except ValueError as exc:
        raise errors.InvalidArgument(f"successors: {exc}") from None
