"""Token masks: packed bits round-trip in xgrammar's layout, bad masks are refused, refused logits go to -inf."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.lmkit import token_mask

pytestmark = pytest.mark.unit


def test_pack_and_unpack_round_trip_in_xgrammars_layout():
    allowed = torch.rand(3, 70, generator=torch.Generator().manual_seed(0)) < 0.3
    allowed[:, 69] = True  # the last, partial word
    bits = token_mask.pack(allowed)
    assert len(bits) == 3 * 3 * 4  # ceil(70 / 32) int32 words a row
    assert torch.equal(token_mask.unpack(bits, 3, 70), allowed)
    words = torch.frombuffer(bytearray(bits), dtype=torch.int32).view(3, 3)
    assert bool((int(words[0, 2]) >> (69 - 64)) & 1)  # bit b of word w is token 32 w + b


def test_a_mask_of_the_wrong_size_or_with_an_empty_row_is_refused():
    allowed = torch.ones(2, 40, dtype=torch.bool)
    with pytest.raises(ValueError, match="2 rows of a 40-token vocabulary take 16"):
        token_mask.unpack(token_mask.pack(allowed)[:-4], 2, 40)
    allowed[1] = False
    with pytest.raises(ValueError, match=r"rows \[1\] allow no token"):
        token_mask.unpack(token_mask.pack(allowed), 2, 40)


def test_apply_sets_refused_logits_to_minus_infinity():
    logits = torch.randn(2, 5)  # [rows, vocab]
    allowed = torch.tensor([[True, False, True, False, False], [False, False, False, False, True]])
    masked = token_mask.apply(logits, allowed)
    assert torch.equal(masked[allowed], logits[allowed])
    assert all(math.isinf(v) and v < 0 for v in masked[~allowed].tolist())
    assert masked.argmax(-1).tolist()[1] == 4
    assert token_mask.apply(logits, None) is logits
    with pytest.raises(ValueError, match="shape"):
        token_mask.apply(logits, allowed[:1])
