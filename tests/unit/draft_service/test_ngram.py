"""Tests for draft_service.ngram: exact proposals, config checks, and rollback correctness."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.draft_service.drafter import Drafter, MatchQuality
from specsplit.draft_service.ngram import MAX_MATCH, MAX_NGRAM, NgramConfig, NgramDrafter

pytestmark = pytest.mark.unit


def reference_proposal(context: list[int], config: NgramConfig, k: int) -> list[int]:
    """The n-gram proposal by brute-force scan: the specification, written the slow way."""
    length = len(context)
    for n in range(min(config.max_n, length), config.min_n - 1, -1):
        suffix = context[length - n :]
        for end in range(length - 1, n - 1, -1):  # most recent earlier occurrence first
            if context[end - n : end] == suffix:
                return context[end : end + k]
    return []


def reference_quality(context: list[int], config: NgramConfig) -> MatchQuality | None:
    """The quality of the proposal above, the slow way: the longest n, its latest earlier occurrence."""
    length = len(context)
    for n in range(min(config.max_n, length), config.min_n - 1, -1):
        suffix = context[length - n :]
        ends = [end for end in range(n, length) if context[end - n : end] == suffix]
        if ends:
            start, match = ends[-1], n
            while match < min(MAX_MATCH, start) and context[start - match - 1] == context[length - match - 1]:
                match += 1
            return MatchQuality(match, len(ends))
    return None


def proposal(context: list[int], k: int, **config) -> list[int]:
    return NgramDrafter(NgramConfig(**config), context).propose(k).tokens


# --- config -----------------------------------------------------------------


def test_config_defaults_are_valid():
    config = NgramConfig()
    assert (config.min_n, config.max_n) == (1, 4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_n": 0}, "min_n"),
        ({"min_n": -1, "max_n": 2}, "min_n"),
        ({"min_n": 3, "max_n": 2}, "max_n"),
        ({"max_n": MAX_NGRAM + 1}, "max_n"),
        ({"min_n": 1.5}, "min_n"),
        ({"max_n": True}, "max_n"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramConfig(**kwargs)


def test_config_accepts_the_bounds():
    assert NgramConfig(min_n=MAX_NGRAM, max_n=MAX_NGRAM).max_n == MAX_NGRAM


# --- exact proposals -------------------------------------------------------


@pytest.mark.parametrize("k", range(1, 7))
def test_bigram_match_proposes_what_followed(k):
    # suffix (1, 2) occurred at 0..2; what followed is 3, 4, 1, 2 (the last two overlap the suffix).
    assert proposal([1, 2, 3, 4, 1, 2], k, max_n=2) == [3, 4, 1, 2][:k]


def test_longer_match_beats_more_recent_shorter_one():
    context = [5, 1, 2, 7, 9, 2, 8, 1, 2]
    # Bigram (1, 2) last occurred ending at 3; unigram (2,) more recently, ending at 6.
    assert proposal(context, 3, max_n=2) == [7, 9, 2]
    assert proposal(context, 3, max_n=1) == [8, 1, 2]


def test_most_recent_occurrence_wins():
    assert proposal([1, 2, 3, 1, 2, 4, 1, 2], 3, max_n=2) == [4, 1, 2]


def test_no_match_proposes_nothing():
    block = NgramDrafter(NgramConfig(), [1, 2, 3, 4]).propose(5)
    assert block.tokens == []
    assert block.probs is None


def test_min_n_ignores_shorter_matches():
    context = [1, 5, 2, 1]
    assert proposal(context, 2, min_n=1, max_n=2) == [5, 2]
    assert proposal(context, 2, min_n=2, max_n=2) == []


def test_context_shorter_than_min_n_proposes_nothing():
    assert proposal([7], 3, min_n=2, max_n=3) == []
    assert proposal([], 3) == []


def test_proposal_stops_at_the_end_of_the_context():
    # (7, 7) ends at 2 and at 3; only one token follows the earlier one.
    assert proposal([7, 7, 7], 5, max_n=2) == [7]


def test_quality_counts_the_match_past_the_ngram_and_the_earlier_occurrences():
    # suffix (1, 2) occurred twice before; the latest one is preceded by 9, 8, like the context's end
    context = [1, 2, 5, 9, 8, 1, 2, 6, 0, 9, 8, 1, 2]
    block = NgramDrafter(NgramConfig(1, 2), context).propose(3)
    assert block.tokens == [6, 0, 9]
    assert block.quality == MatchQuality(length=4, occurrences=2)
    assert NgramDrafter(NgramConfig(1, 2), [1, 2, 3, 4]).propose(3).quality is None  # no match, no quality


def test_quality_is_capped():
    span = list(range(100, 100 + MAX_MATCH + 10))
    block = NgramDrafter(NgramConfig(), [*span, 7, *span]).propose(2)
    assert block.tokens == [7, 100] and block.quality == MatchQuality(MAX_MATCH, 1)


@pytest.mark.parametrize("seed", range(20))
def test_quality_matches_the_reference_on_random_contexts(seed):
    rng = random.Random(seed)
    config = NgramConfig(min_n=rng.randint(1, 2), max_n=rng.randint(2, 5))
    context = [rng.randint(0, 4) for _ in range(rng.randint(1, 80))]
    assert NgramDrafter(config, context).propose(4).quality == reference_quality(context, config)


def test_is_free_so_it_may_draft_up_to_the_free_bound():
    drafter = NgramDrafter(NgramConfig(), [1, 2, 3, 4, 5, 6, 1, 2])
    assert drafter.free
    assert drafter.propose_within(2, 0).tokens == [3, 4]
    assert drafter.propose_within(0, 5).tokens == [3, 4, 5, 6, 1]


def test_probs_are_always_none():
    block = NgramDrafter(NgramConfig(), [1, 2, 3, 1, 2]).propose(3)
    assert block.tokens == [3, 1, 2]
    assert block.probs is None


def test_k_zero_is_empty_and_negative_k_is_rejected():
    drafter = NgramDrafter(NgramConfig(), [1, 2, 1])
    assert drafter.propose(0).tokens == []
    with pytest.raises(ValueError, match="k >= 0"):
        drafter.propose(-1)


def test_is_a_drafter_and_accepts_non_python_ints():
    drafter = NgramDrafter(NgramConfig(max_n=2), torch.tensor([1, 2, 3, 1, 2]))
    assert isinstance(drafter, Drafter)
    assert drafter.propose(2).tokens == [3, 1]
    assert all(type(t) is int for t in drafter.propose(3).tokens)


# --- rollback / extend / commit ---------------------------------------------


def test_rollback_bounds_are_checked():
    drafter = NgramDrafter(NgramConfig(), [1, 2, 3])
    with pytest.raises(ValueError, match="0..3"):
        drafter.rollback(4)
    with pytest.raises(ValueError, match="0..3"):
        drafter.rollback(-1)
    drafter.rollback(3)  # a no-op
    assert drafter.position == 3


def test_rollback_forgets_the_rolled_back_ngrams():
    drafter = NgramDrafter(NgramConfig(max_n=2), [1, 2, 3])
    drafter.extend([9, 1, 2])
    assert drafter.propose(2).tokens == [3, 9]
    drafter.rollback(4)  # context [1, 2, 3, 9]
    assert drafter.propose(2).tokens == []
    drafter.extend([3])  # context [1, 2, 3, 9, 3]: (3,) ended at 3
    assert drafter.propose(2).tokens == [9, 3]


def test_rollback_to_zero_empties_the_drafter():
    drafter = NgramDrafter(NgramConfig(), [1, 2, 1, 2, 1])
    drafter.rollback(0)
    assert drafter.position == 0
    assert drafter.propose(4).tokens == []
    drafter.extend([4, 4])
    assert drafter.propose(4).tokens == [4]


def test_commit_rolls_back_then_extends():
    drafter = NgramDrafter(NgramConfig(max_n=2), [1, 2, 3, 1])
    drafter.commit(3, [1, 2])  # context [1, 2, 3, 1, 2]
    assert drafter.position == 5
    assert drafter.propose(3).tokens == [3, 1, 2]
    with pytest.raises(ValueError):
        drafter.commit(6, [1])


@pytest.mark.parametrize("seed", range(200))
def test_any_extend_rollback_sequence_matches_a_fresh_drafter(seed):
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    config = NgramConfig(min_n=min_n, max_n=rng.randint(min_n, 6))
    vocab = rng.randint(2, 6)  # small vocabularies make matches, and repeated n-grams, common
    context = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
    drafter = NgramDrafter(config, context)
    for _ in range(30):
        op = rng.random()
        if op < 0.4:
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            drafter.extend(new)
            context += new
        elif op < 0.7:
            position = rng.randint(0, len(context))
            drafter.rollback(position)
            del context[position:]
        else:
            position = rng.randint(0, len(context))
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            drafter.commit(position, new)
            context = context[:position] + new
        assert drafter.position == len(context)
        k = rng.randint(0, 10)
        fresh = NgramDrafter(config, context)
        assert drafter.propose(k).tokens == fresh.propose(k).tokens == reference_proposal(context, config, k)


def test_long_context_proposal():
    rng = random.Random(0)
    config = NgramConfig(max_n=4)
    pattern = [9001, 9002, 9003, 9004, 9005, 9006, 9007, 9008]
    context = [rng.randrange(1000) for _ in range(8192)]
    context[100:108] = pattern  # planted early; the context ends with its first four tokens
    context[-4:] = pattern[:4]
    drafter = NgramDrafter(config, context)
    expected = pattern[4:] + context[108:110]
    assert drafter.propose(6).tokens == expected == reference_proposal(context, config, 6)
    drafter.rollback(0)
    assert drafter.position == 0
    assert drafter.propose(6).tokens == []


def reference_second_guess(context: list[int], config: NgramConfig, k: int, candidates: int = 4):
    """The second guess by brute-force scan: where the most recent other earlier occurrences of the matched
    suffix (then of shorter ones; a few each) go on differently from the proposal, the first such place."""
    length = len(context)
    for n in range(min(config.max_n, length), config.min_n - 1, -1):
        ends = [end for end in range(n, length) if context[end - n : end] == context[length - n :]]
        if ends:
            start = ends[-1]
            break
    else:
        return None
    tokens = context[start : start + k]
    for m in range(n, config.min_n - 1, -1):
        others = [end for end in range(length - 1, m - 1, -1)
                  if context[end - m : end] == context[length - m :] and end != start][:candidates]
        for other in others:
            for i, token in enumerate(tokens[: length - other]):
                if context[other + i] != token:
                    return i, context[other + i]
    return None


def test_the_second_guess_is_where_another_earlier_occurrence_goes_on_differently():
    rng = random.Random(11)
    config = NgramConfig()
    guessed = 0
    for _ in range(400):
        context = [rng.randrange(3) for _ in range(rng.randrange(4, 80))]  # three symbols: many occurrences
        k = rng.randrange(1, 7)
        got = NgramDrafter(config, context).propose(k).second_guess
        assert got == reference_second_guess(context, config, k), (context, k)
        guessed += got is not None
    assert guessed > 100  # most contexts have one
