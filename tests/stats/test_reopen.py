"""A target that loses its session every round still samples from the target's distribution.

The orchestrator's committed tokens are the truth: when a target session is
lost, it is re-opened from them. If the target's randomness restarted with each
session, every reopened round would decide its token with the draws that already
decided the first one, and consecutive tokens would be correlated. The test
reopens the session before every token (k = 0, T = 1, plain sampling: the exact
joint of two tokens is known) and compares the sampled pairs, over many seeds,
with the target's own joint distribution by chi-square; a negative control
replays the first position's draws in every session and is caught.
"""

from __future__ import annotations

import collections

import pytest
import torch
from scipy import stats

from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams, logits_to_probs
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine

pytestmark = pytest.mark.stats

VOCAB = 8  # small, so the joint of two tokens has 64 cells
PROMPT = [1, 5, 2]
SEEDS = 1200  # each is two real forwards; the bug this catches shows within a few hundred


@pytest.fixture(scope="module")
def engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(13)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # spread logits: no token so likely that the pairs are uninformative
        model.lm_head.weight.mul_(6.0)
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits())


def exact_pairs(engine: TargetEngine, sampling: SamplingParams) -> dict[tuple[int, int], float]:
    with torch.inference_mode():
        p1 = logits_to_probs(engine.model(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0]
        joint = {}
        for t1 in range(VOCAB):
            p2 = logits_to_probs(engine.model(torch.tensor([PROMPT + [t1]])).logits[0, -1:], sampling)[0]
            for t2 in range(VOCAB):
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def pairs_with_a_reopen_per_token(engine: TargetEngine, seeds: range) -> list[tuple[int, int]]:
    """Two tokens per seed, each decided by a freshly opened session holding the committed tokens (k = 0)."""
    pairs = []
    for seed in seeds:
        committed = list(PROMPT)
        for _ in range(2):
            session = engine.open(f"s{seed}", committed, SamplingParams(temperature=1.0, seed=seed),
                                  VerificationMode.TOKEN_ONLY)
            committed.append(engine.verify(session, len(committed), [], None).next_token)
            engine.close(session.session_id)
        pairs.append(tuple(committed[-2:]))
    return pairs


def chi_square(samples: list[tuple[int, int]], exact: dict[tuple[int, int], float]) -> float:
    counts = collections.Counter(samples)
    cells = sorted(exact)
    observed = [counts.get(c, 0) for c in cells]
    expected = [exact[c] * len(samples) for c in cells]
    small = [i for i, e in enumerate(expected) if e < 5]  # pooled, as the test's approximation needs
    big = [i for i in range(len(cells)) if i not in small]
    observed = [observed[i] for i in big] + [sum(observed[i] for i in small)]
    expected = [expected[i] for i in big] + [sum(expected[i] for i in small)]
    scale = sum(observed) / sum(expected)  # float32 probabilities sum to 1 only within rounding
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


def test_reopening_before_every_token_keeps_the_targets_distribution(engine):
    exact = exact_pairs(engine, SamplingParams(temperature=1.0))
    assert max(exact.values()) < 0.2  # the joint is spread over many cells: a weak test would pass anything
    assert chi_square(pairs_with_a_reopen_per_token(engine, range(SEEDS)), exact) > 1e-3


def test_negative_control_replaying_the_first_positions_draws_is_caught(engine, monkeypatch):
    from specsplit.lmkit import draws

    real = draws.uniforms

    def restarted(seed, stream, positions, count):  # a per-session generator: every session starts over
        return real(seed, stream, range(len(positions)), count)

    monkeypatch.setattr(draws, "uniforms", restarted)
    exact = exact_pairs(engine, SamplingParams(temperature=1.0))
    assert chi_square(pairs_with_a_reopen_per_token(engine, range(SEEDS // 3)), exact) < 1e-6
