"""Tests for lmkit.sampling: SamplingParams checks, logits_to_probs (temperature, top-k, top-p)."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.lmkit.sampling import (
    SamplingParams,
    block_argmax,
    consecutive_runs,
    first_rows,
    logits_to_probs,
    row_argmax,
    rows_when_reached,
    static_probs,
)

pytestmark = pytest.mark.unit


def kept(probs: torch.Tensor) -> list[list[int]]:  # probs: [n, vocab]
    return [row.nonzero().flatten().tolist() for row in probs]


def reference_nucleus(probs: list[float], top_p: float) -> set[int]:
    """Smallest set of most likely tokens (lower id first on ties) whose mass reaches top_p, by a plain loop."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    chosen, mass = set(), 0.0
    for token in order:
        if mass >= top_p:
            break
        chosen.add(token)
        mass += probs[token]
    return chosen


# --- SamplingParams -------------------------------------------------------------


def test_defaults_are_greedy_and_valid():
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.0}, "seed"),
    ],
)
def test_params_reject_out_of_range_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_accept_the_edges_of_their_ranges():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9, seed=2**63 - 1)


# --- logits_to_probs ------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 4
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1), rtol=1e-5, atol=1e-7)


def test_tiny_temperature_does_not_overflow_and_approaches_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, -1e4]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1e-6))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_greedy_params_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(torch.zeros(1, 4), SamplingParams())


def test_top_k_keeps_exactly_the_k_largest_and_renormalises():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(2))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=7))
    for row_logits, row_probs, kept_ids in zip(logits, probs, kept(probs)):
        expected = sorted(torch.topk(row_logits, 7).indices.tolist())
        assert kept_ids == expected
        torch.testing.assert_close(row_probs[expected], torch.softmax(row_logits[expected], dim=0))


def test_top_k_ties_keep_the_lower_token_ids():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert kept(probs) == [[1, 2], [0, 1]]
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]))


def test_top_k_at_least_vocab_changes_nothing():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
    plain = logits_to_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=10)), plain)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=99)), plain)


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.3, [0]), (0.45, [0]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_minimal_nucleus(top_p, expected):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert kept(probs) == [expected]
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])[expected]
    torch.testing.assert_close(probs[0, expected], base / base.sum())


def test_top_p_matches_a_reference_nucleus_on_random_rows():
    generator = torch.Generator().manual_seed(4)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        logits = torch.randn(20, 64, generator=generator) * 2
        probs = logits_to_probs(logits, SamplingParams(temperature=0.8, top_p=top_p))
        full = torch.softmax(logits / 0.8, dim=-1).tolist()
        for row, kept_ids in zip(full, kept(probs)):
            assert set(kept_ids) == reference_nucleus(row, top_p)


def test_top_p_ties_keep_the_lower_token_ids():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0]])  # probs ~ [0.48, 0.17, 0.17, 0.17]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert kept(probs) == [[0, 1]]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert kept(probs) == [[0, 1, 2]]


def test_top_k_is_applied_before_top_p():
    # After top-k = 2 the top token holds 0.4 / 0.75 = 0.53 >= 0.5, so top-p keeps it alone;
    # top-p on the untruncated row (0.4 < 0.5) would keep two tokens.
    logits = torch.tensor([[0.4, 0.35, 0.25]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert kept(probs) == [[0]]


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0, top_p=1e-9))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
])
def test_rows_are_float32_distributions(dtype, params):
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    probs = logits_to_probs(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == (6, 300)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(6), rtol=0, atol=1e-5)


def test_banned_tokens_get_zero_probability_and_vocab_of_one_works():
    logits = torch.tensor([[0.0, -math.inf, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert probs[0, 1] == 0.0
    assert logits_to_probs(torch.tensor([[3.0]]), SamplingParams(temperature=1.0, top_p=0.5)).tolist() == [[1.0]]


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.zeros(4), "2-D"),
        (torch.zeros(2, 3, dtype=torch.int64), "floating"),
        (torch.zeros(2, 0), "vocabulary"),
        (torch.tensor([[0.0, math.nan]]), "NaN"),
        (torch.tensor([[0.0, math.inf]]), r"\+inf"),
        (torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), "row 1 is all -inf"),
    ],
)
def test_bad_logits_are_refused(logits, message):
    with pytest.raises(ValueError, match=message):
        logits_to_probs(logits, SamplingParams(temperature=1.0))


# --- top-p found among candidates equals the full sort ----------------------------


@pytest.mark.parametrize("scale", [0.3, 2.0, 6.0])  # flat rows (wide nucleus: the full sort) to peaked ones
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_nucleus_from_candidates_equals_the_full_sort(monkeypatch, scale, top_p):
    from specsplit.lmkit import sampling

    generator = torch.Generator().manual_seed(int(scale * 10) + int(top_p * 1000))
    scaled = torch.randn(12, 5000, generator=generator) * scale
    scaled[3] = scaled[3].round()  # many exact ties, some straddling the cut
    scaled[5, :4000] = -math.inf  # banned tokens
    fast = sampling._nucleus_mask(scaled, top_p)
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", ())  # every row sorted whole
    assert torch.equal(fast, sampling._nucleus_mask(scaled, top_p))
    probs = torch.softmax(scaled, dim=-1).tolist()
    for row, kept_ids in zip(probs, kept(fast.float())):
        assert abs(len(kept_ids) - len(reference_nucleus(row, top_p))) <= 1  # float rounding at the cut only


def test_a_tie_across_the_cut_keeps_the_lower_ids_whichever_path():
    scaled = torch.full((1, 3000), -20.0)
    scaled[0, [7, 400, 2999]] = 1.0  # three equal top tokens, each ~1/3: top_p 0.5 keeps two of them
    probs = logits_to_probs(scaled, SamplingParams(temperature=1.0, top_p=0.5))
    assert kept(probs) == [[7, 400]]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_p=0.95, seed=1),
                                    SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=1)])
@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [0], [0, 1], [3, 0, 4]])
def test_rows_when_reached_equal_the_eager_blocks_rows(params, order):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 4  # [k+1, vocab]
    eager = logits_to_probs(logits, params)
    row = rows_when_reached(logits, params)
    for i in order:
        assert torch.equal(row(i), eager[i])
        assert row(i) is row(i)  # made once


def test_first_rows_are_each_blocks_row_0_and_a_failing_group_fails_alone():
    gen = torch.Generator().manual_seed(5)
    warm, cool = SamplingParams(temperature=1.2, seed=1), SamplingParams(temperature=0.7, top_p=0.9, seed=2)
    blocks = [(torch.randn(1 + i % 3, 200, generator=gen) * 3, warm if i % 2 else cool) for i in range(6)]
    rows = first_rows(blocks)
    for (logits, params), row in zip(blocks, rows):
        assert torch.equal(row, logits_to_probs(logits[:1], params)[0])
    nan = torch.full((2, 200), math.nan)
    rows = first_rows([*blocks, (nan, SamplingParams(temperature=0.7, top_p=0.9, seed=9))])  # joins cool's group
    assert [row is None for row in rows] == [i % 2 == 0 for i in range(6)] + [True]  # cool's group: None
    assert torch.equal(rows[1], logits_to_probs(blocks[1][0][:1], warm)[0])
    row = rows_when_reached(blocks[0][0], blocks[0][1], first=None)
    assert torch.equal(row(0), logits_to_probs(blocks[0][0][:1], blocks[0][1])[0])
    assert first_rows([]) == []


@pytest.mark.parametrize("top_k", [1, 3, 50, 700])
@pytest.mark.parametrize("top_p", [1.0, 0.3, 0.9, 0.95])
@pytest.mark.parametrize("scale", [0.3, 4.0])
def test_top_k_from_candidates_equals_the_full_sort(top_k, top_p, scale):
    from specsplit.lmkit import sampling

    scaled = torch.randn(8, 5000, generator=torch.Generator().manual_seed(top_k)) * scale
    scaled[2] = (scaled[2] * 4).round()  # many exact ties, some straddling the k-th place or the top-p cut
    scaled[3, 1:200] = scaled[3, 0]  # ties at the top: top-p cuts inside them by id
    scaled[4, :] = 1.0  # a row of ties
    scaled[5, 10:] = -math.inf  # banned tokens: fewer allowed than the wider k
    scaled[6, :4990] = -math.inf
    fast = sampling._truncation_mask(scaled, top_k, top_p)
    assert torch.equal(fast, sampling._sorted_truncation_mask(scaled, top_k, top_p))
    if top_p == 1.0:
        assert fast.sum(dim=-1).tolist() == [top_k] * 8


@pytest.mark.parametrize("top_k", [0, 1, 3, 50, 4999, 5000, 6000])
@pytest.mark.parametrize("top_p", [1.0, 1e-9, 0.3, 0.5, 0.9, 0.999])
def test_static_probs_equal_logits_to_probs_bit_for_bit(top_k, top_p):
    """The settings as tensors, no branch on a value (a captured chain's q): the same bits as logits_to_probs, on
    rows of ties across the k-th place and the top-p cut, banned tokens, flat and peaked rows."""
    logits = torch.randn(8, 5000, generator=torch.Generator().manual_seed(top_k + int(top_p * 100))) * 3
    logits[1] *= 0.1  # flat: a wide nucleus
    logits[2] = (logits[2] * 4).round()  # many exact ties, some straddling the k-th place or the top-p cut
    logits[3, 1:200] = logits[3, 0]  # ties at the top
    logits[4, :] = 1.0  # a row of ties
    logits[5, 10:] = -math.inf  # banned tokens: fewer allowed than the wider k
    logits[6, :4990] = -math.inf
    logits[7] = -math.inf
    logits[7, [3, 9, 4000, 4001]] = 2.0  # four tokens of exactly 1/4: top-p 0.5 cuts where the mass before is 0.5
    for temperature in (0.7, 1.9):
        want = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        for row, expected in zip(logits, want):
            got = static_probs(row, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p,
                               dtype=torch.float64))
            assert torch.equal(got, expected)


@pytest.mark.parametrize("rows,vocab", [(2, 64), (5, 49152), (9, 128 * 3), (3, 100), (1, 49152)])
def test_row_argmax_is_max_with_first_index(rows, vocab):
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    logits[0, vocab // 3] = logits[0, vocab - 1] = 99.0  # a tie across chunks: the lower id wins
    logits[-1, 1] = logits[-1, 2] = 98.0  # a tie within a chunk
    if rows > 2:
        logits[1] = float("-inf")  # a row a mask refused entirely
    best, index = row_argmax(logits)
    want_best, want_index = logits.max(dim=-1)
    assert torch.equal(best, want_best) and torch.equal(index, want_index)
    assert index[0] == vocab // 3


def test_row_argmax_reports_a_nan_row_as_max_does():
    logits = torch.randn(4, 256)
    logits[2, 130] = float("nan")
    best, index = row_argmax(logits)
    assert torch.isnan(best[2]) and not torch.isnan(best[[0, 1, 3]]).any()
    assert torch.equal(index[[0, 1, 3]], logits.max(dim=-1).indices[[0, 1, 3]])
    best, _ = row_argmax(logits[2:3])  # one row alone
    assert torch.isnan(best[0])


def test_block_argmax_decides_consecutive_blocks_together_and_others_alone():
    logits = torch.randn(12, 256, generator=torch.Generator().manual_seed(3))
    logits[5, 7] = float("nan")  # in the second block: it alone gets None
    apart = torch.randn(2, 256)  # rows of another tensor (a block a mask made anew): its own run
    blocks = [logits[0:3], logits[3:6], logits[6:7], apart, logits[7:12]]
    assert consecutive_runs(blocks) == [[0, 1, 2], [3], [4]]
    choices = block_argmax(blocks)
    assert choices[1] is None
    for block, chosen in zip(blocks, choices):
        if chosen is not None:
            assert chosen == block.max(dim=-1).indices.tolist()


def test_a_packed_forwards_blocks_are_one_run(tiny_target_dir):
    """The batch's greedy decision is one argmax only if the packed forward hands out consecutive views."""
    from specsplit.lmkit import models, packed_rows
    from specsplit.lmkit.kvcache import SessionCache
    from specsplit.target_service.batched_forward import Step, forward_batch

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    assert packed_rows.install(model)
    steps = [Step(SessionCache(model), 0, [1 + i, 2, 3][: 1 + i], 1 + i) for i in range(3)]
    blocks = forward_batch(model, steps)
    assert consecutive_runs(blocks) == [[0, 1, 2]]
    assert block_argmax(blocks) == [block.max(dim=-1).indices.tolist() for block in blocks]
