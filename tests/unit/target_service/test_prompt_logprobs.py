"""A session opened with ``prompt_logprobs`` gets its prompt scored by the forward that prefills it.

Every prompt token after the first gets transformers' own log-softmax (fp32, 1e-4) and its most likely
alternatives, on the first verify only, alone or in a batch with other sessions, with the packed-rows
forward and the stock one; the verdict and the tokens committed are those of a session that did not ask.
"""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import errors, models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem
from tests.conftest import TINY_PROMPTS

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=[True, False], ids=["packed-rows", "stock-forward"])
def engine(request, tiny_target_dir) -> TargetEngine:
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8),
                        fast_forward=request.param)


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))

    def logprobs(prompt: list[int]) -> torch.Tensor:  # [len - 1, vocab]: row i scores prompt[i + 1]
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    return logprobs


def check(scored, prompt: list[int], want: torch.Tensor, top: int) -> None:
    assert [lp.token_id for lp in scored] == prompt[1:]
    got = torch.tensor([lp.logprob for lp in scored])
    torch.testing.assert_close(got, want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], rtol=0, atol=1e-4)
    for lp, row in zip(scored, want):
        assert lp.rank == int((row > row[lp.token_id]).sum()) + 1  # 1 = the most likely (no ties here)
        assert len(lp.top) == top
        ids = [t for t, _ in lp.top]
        assert ids == row.topk(top).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), row.topk(top).values, rtol=0, atol=1e-4)


def test_the_first_verify_scores_the_prompt_as_transformers_does(engine, reference, gguf_tokenizer):
    prompt = gguf_tokenizer.encode(TINY_PROMPTS[0])
    plain = engine.open("plain", prompt, GREEDY, VerificationMode.GREEDY)
    scored = engine.open("scored", prompt, GREEDY, VerificationMode.GREEDY, prompt_logprobs=3)
    first = engine.verify(scored, len(prompt), [], None)
    assert first.prompt_logprobs and len(first.prompt_logprobs) == len(prompt) - 1
    check(first.prompt_logprobs, prompt, reference(prompt), 3)
    assert (first.accepted, first.next_token) == ((v := engine.verify(plain, len(prompt), [], None)).accepted, v.next_token)
    assert engine.verify(scored, len(scored.tokens), [], None).prompt_logprobs == ()  # the first verify only
    engine.close("plain")
    engine.close("scored")


def test_a_short_prompt_in_a_batch_is_scored_and_the_others_are_not(engine, reference, gguf_tokenizer):
    prompts = [gguf_tokenizer.encode(p)[:6] for p in TINY_PROMPTS[:3]]  # short: they would share a forward
    sessions = [engine.open(f"b{i}", p, GREEDY, VerificationMode.GREEDY, prompt_logprobs=0 if i == 1 else None)
                for i, p in enumerate(prompts)]
    outcomes = engine.verify_batch([VerifyItem(s, len(s.tokens), [7, 8], None) for s in sessions])
    assert outcomes[0].prompt_logprobs == () and outcomes[2].prompt_logprobs == ()
    check(outcomes[1].prompt_logprobs, prompts[1], reference(prompts[1]), 0)
    for i in range(3):
        engine.close(f"b{i}")


def test_a_scoring_session_is_not_forked_and_a_bad_count_is_refused(engine, reference, gguf_tokenizer):
    prompt = gguf_tokenizer.encode(TINY_PROMPTS[1])
    engine.open("source", prompt, GREEDY, VerificationMode.GREEDY)
    shared = engine.shared_tokens
    fork = engine.open("fork", prompt, GREEDY, VerificationMode.GREEDY, fork_from="source", prompt_logprobs=1)
    assert engine.shared_tokens == shared  # every prompt position is computed, so every one can be scored
    check(engine.verify(fork, len(prompt), [], None).prompt_logprobs, prompt, reference(prompt), 1)
    with pytest.raises(errors.InvalidArgument, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        engine.open("bad", prompt, GREEDY, VerificationMode.GREEDY, prompt_logprobs=21)
    engine.close("source")
    engine.close("fork")
