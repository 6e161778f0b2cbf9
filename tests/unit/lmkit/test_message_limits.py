"""Request bounds from a model's shape: each covers the largest message a correct client sends."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import message_limits as limits
from specsplit.lmkit.wire import probs_to_proto
from specsplit.v1 import specsplit_pb2 as pb

pytestmark = pytest.mark.unit


def test_the_target_bound_covers_a_full_prompt_and_a_dense_block():
    context, block, vocab = 512, 8, 1000
    bound = limits.target_request_bytes(context, block, vocab)
    prompt = pb.TargetRequest(open=pb.TargetOpen(session_id="s" * 32, tokens=[2**31 - 1] * (context - 1)))
    dense = pb.VerifyRequest(position=context - block - 1, draft_tokens=[vocab - 1] * block, parents=[-1] * block,
                             draft_probs=probs_to_proto(torch.full((block, vocab), 1.0 / vocab)))
    assert prompt.ByteSize() <= bound and pb.TargetRequest(verify=dense).ByteSize() <= bound
    assert bound < 2 * max(prompt.ByteSize(), dense.ByteSize()) + limits.ENVELOPE_BYTES  # not far above either


def test_the_draft_bound_covers_the_prompts_features():
    context, block, width = 512, 8, 96
    bound = limits.draft_request_bytes(context, block, width)
    features = pb.HiddenFeatures(position=0, rows=context, width=width, values=bytes(context * width * 2))
    propose = pb.DraftRequest(propose=pb.ProposeRequest(position=0, tokens=[7] * (block + 1), k=block,
                                                        features=features))
    assert propose.ByteSize() <= bound
    assert limits.draft_request_bytes(context, block, 0) == context * limits.TOKEN_BYTES + limits.ENVELOPE_BYTES


def test_bounds_stay_under_the_transport_ceiling_and_assume_a_context_when_unknown():
    assert limits.target_request_bytes(1 << 30, 32, 128_256) == limits.CEILING
    assert limits.draft_request_bytes(0, 32, 0) == limits.UNKNOWN_CONTEXT * limits.TOKEN_BYTES + limits.ENVELOPE_BYTES
    assert limits.generate_request_bytes(8192, 64) == 8192 * 64 + limits.ENVELOPE_BYTES
