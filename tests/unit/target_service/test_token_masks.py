"""The target verifies under a grammar's mask: every position decides among the allowed tokens only, alone and
in a batched forward alike; a mask of the wrong shape, or one sent in DRAFT_PROBS mode, is refused."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import errors, models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem
from tests.conftest import TINY_PROMPTS, VOCAB

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engine(tiny_target_dir) -> TargetEngine:
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8))


def only(tokens_per_row: list[list[int]]) -> torch.Tensor:  # -> [rows, vocab] bool
    allowed = torch.zeros(len(tokens_per_row), VOCAB, dtype=torch.bool)
    for row, tokens in enumerate(tokens_per_row):
        allowed[row, tokens] = True
    return allowed


def session(engine, gguf_tokenizer, name: str, mode=VerificationMode.GREEDY, sampling: SamplingParams | None = None):
    return engine.open(name, gguf_tokenizer.encode(TINY_PROMPTS[0]), sampling or SamplingParams(), mode)


def test_each_position_decides_among_its_allowed_tokens(engine, gguf_tokenizer):
    s = session(engine, gguf_tokenizer, "greedy")
    # draft 100 then 200; allowed: row 0 {100, 7}, row 1 {200}, row 2 {300, 301}
    outcome = engine.verify(s, len(s.tokens), [100, 200], None, allowed=only([[100, 7], [200], [300, 301]]))
    assert outcome.accepted in (0, 2)  # row 1 allows only the draft token: accepted whenever reached
    assert outcome.next_token in ((7,) if outcome.accepted == 0 else (300, 301))
    sampled = session(engine, gguf_tokenizer, "sampled", VerificationMode.COUPLED, SamplingParams(temperature=1.0))
    for _ in range(5):
        done = engine.verify(sampled, len(sampled.tokens), [], None, allowed=only([[11, 12, 13]]))
        assert done.next_token in (11, 12, 13)


def test_a_batched_forward_masks_each_session_with_its_own_mask(engine, gguf_tokenizer):
    sessions = [session(engine, gguf_tokenizer, f"b{i}") for i in range(3)]
    items = [VerifyItem(s, len(s.tokens), [], None, allowed=only([[40 + i]])) for i, s in enumerate(sessions)]
    results = engine.verify_batch(items)
    assert [r.next_token for r in results] == [40, 41, 42]


def test_a_bad_mask_is_refused(engine, gguf_tokenizer):
    s = session(engine, gguf_tokenizer, "bad")
    with pytest.raises(errors.InvalidArgument, match="a block of 1 draft tokens needs 2 rows of 49152"):
        engine.verify(s, len(s.tokens), [5], None, allowed=only([[5]]))
    probs = session(engine, gguf_tokenizer, "probs", VerificationMode.DRAFT_PROBS, SamplingParams(temperature=1.0))
    with pytest.raises(errors.InvalidArgument, match="DRAFT_PROBS"):
        engine.verify(probs, len(probs.tokens), [], None, allowed=only([[5]]))
