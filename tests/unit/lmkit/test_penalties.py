"""Penalties and biases on hand-built logits: exact values, each row with its own context."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.lmkit.sampling import SamplingParams, apply_penalties, chain_paths

pytestmark = pytest.mark.unit

VOCAB = 6


def logits(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_no_penalty_returns_the_logits_themselves():
    raw = logits([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    assert apply_penalties(raw, SamplingParams(), [1, 2], [()]) is raw


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    raw = logits([2.0, -2.0, 4.0, 1.0, -1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, prompt_length=1)
    # prompt [0]; generated [1]; seen: 0, 1 (prompt counts too), not 2..5
    out = apply_penalties(raw, params, [0, 1], [()])
    assert out.tolist() == [[1.0, -4.0, 4.0, 1.0, -1.0, 0.5]]


def test_each_row_of_a_chain_counts_the_draft_tokens_before_it():
    raw = logits(*[[1.0] * VOCAB] * 3)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, prompt_length=2)
    # prompt [3, 3] is not counted by OpenAI's penalties; generated so far [4]; the block drafts 4, 5
    out = apply_penalties(raw, params, [3, 3, 4], chain_paths([4, 5]))
    assert out[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.25, 1.0]  # 4 once: 1 - 0.5 - 0.25
    assert out[1].tolist() == [1.0, 1.0, 1.0, 1.0, -0.25, 1.0]  # 4 twice: 1 - 1.0 - 0.25
    assert out[2].tolist() == [1.0, 1.0, 1.0, 1.0, -0.25, 0.25]  # and 5 once


def test_logit_bias_adds_and_min_tokens_bans_eos_until_reached():
    raw = logits(*[[0.0] * VOCAB] * 3)
    params = SamplingParams(logit_bias=((1, 5.0), (2, -100.0)), min_tokens=2, eos_token_ids=(0,), prompt_length=3)
    # one token generated before the block: rows 0 (1 generated) is banned, rows 1 and 2 (2, 3) are not
    out = apply_penalties(raw, params, [5, 5, 5, 4], chain_paths([3, 3]))
    assert out[0].tolist() == [-math.inf, 5.0, -100.0, 0.0, 0.0, 0.0]
    assert out[1].tolist() == out[2].tolist() == [0.0, 5.0, -100.0, 0.0, 0.0, 0.0]


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    raw = torch.randn(1, 1000) * 5
    ids = torch.randint(0, 1000, (1, 40))
    expected = RepetitionPenaltyLogitsProcessor(1.3)(ids, raw.clone())
    params = SamplingParams(repetition_penalty=1.3, prompt_length=25)
    assert torch.equal(apply_penalties(raw, params, ids[0].tolist(), [()]), expected)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be in [-2, 2]"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "distinct token ids"),
        ({"logit_bias": ((-1, 1.0),)}, "distinct token ids >= 0"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias[3] must be in [-100, 100]"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"eos_token_ids": (-2,)}, "eos_token_ids must be token ids >= 0"),
    ],
)
def test_bad_penalties_are_refused_saying_what_to_send(fields, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**fields)
    assert fragment in str(info.value)
