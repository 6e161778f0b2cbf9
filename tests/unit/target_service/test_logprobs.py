"""Log-probabilities of committed tokens: exact on hand-built logits, and the same from solo and batched verifies."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.lmkit import errors, models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem
from specsplit.target_service.logprobs import committed_logprobs

pytestmark = pytest.mark.unit


def test_logprobs_are_the_log_softmax_of_each_row_with_the_top_tokens_first():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0], [2.0, 2.0, 1.0, -1.0], [9.0, 9.0, 9.0, 9.0]])
    out = committed_logprobs(logits, [1, 2], top_n=2)  # two committed tokens: rows 0 and 1 only
    assert [o.token_id for o in out] == [1, 2]
    assert out[0].logprob == pytest.approx(math.log(3 / 6))
    row1 = torch.log_softmax(logits[1], -1)
    assert out[1].logprob == pytest.approx(row1[2].item())
    assert [t for t, _ in out[0].top] == [1, 0] and [t for t, _ in out[1].top] == [0, 1]  # ties: lower id first
    assert out[0].top[0][1] == pytest.approx(out[0].logprob)
    assert committed_logprobs(logits, [3], top_n=0)[0].top == ()
    with pytest.raises(ValueError, match="top_n"):
        committed_logprobs(logits, [1], top_n=21)
    with pytest.raises(ValueError, match="logits"):
        committed_logprobs(logits, [1, 2, 3, 0], top_n=0)


@pytest.fixture(scope="module")
def engine(tiny_target_dir):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8))


def test_verify_returns_one_logprob_per_committed_token_solo_and_batched(engine):
    prompts = [[1, 50, 60, 70], [1, 400, 500], [1, 9, 9, 9, 9, 9]]
    blocks = [[3, 4, 5], [], [9, 9]]

    def run(batched: bool):
        sessions = [engine.open(f"s{batched}{i}", p, SamplingParams(), VerificationMode.GREEDY, top_logprobs=3)
                    for i, p in enumerate(prompts)]
        items = [VerifyItem(s, len(p), b, None) for s, p, b in zip(sessions, prompts, blocks)]
        results = engine.verify_batch(items) if batched else [engine.verify(*vars(i).values()) for i in items]
        for s in sessions:
            engine.close(s.session_id)
        return results

    solo, batched = run(False), run(True)
    for one, many in zip(solo, batched):
        assert len(one.logprobs) == one.accepted + 1 == len(many.logprobs)
        assert [lp.token_id for lp in one.logprobs][-1] == one.next_token
        for a, b in zip(one.logprobs, many.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3
            assert a.top[0][0] == a.token_id  # greedy commits the argmax


def test_no_logprobs_unless_asked_and_the_limit_is_checked(engine):
    session = engine.open("plain", [1, 2, 3], SamplingParams(), VerificationMode.GREEDY)
    assert engine.verify(session, 3, [4], None).logprobs == ()
    engine.close("plain")
    with pytest.raises(errors.InvalidArgument, match="top_logprobs"):
        engine.open("greedy-many", [1, 2], SamplingParams(), VerificationMode.GREEDY, top_logprobs=21)


def test_ranks_count_the_more_likely_tokens_and_equal_ones_of_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 1.0, 1.0]])
    scored = committed_logprobs(logits, [2, 3], top_n=1, ranks=True)
    assert [lp.rank for lp in scored] == [2, 4]  # token 2 ties token 1 (lower id first); token 3 is last of three ties
    assert [lp.rank for lp in committed_logprobs(logits, [1, 0], top_n=0, ranks=True)] == [1, 1]
    assert [lp.rank for lp in committed_logprobs(logits, [1, 0], top_n=0)] == [0, 0]  # not asked: not computed
