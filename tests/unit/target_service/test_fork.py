"""A session opened with ``fork_from`` starts from a copy of its source's prompt cache and decodes as if alone.

The prompt is computed once: the forks' first steps feed only the prompt's last
token, and their tokens and logits equal a session that prefilled alone, with
the packed-rows forward (``KVBuffer``) and the stock one (``DynamicCache``).
What cannot be shared (a gone session, another caller's, a feature session)
opens as a plain session.
"""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import models
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine
from tests.conftest import TINY_PROMPTS

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=[True, False], ids=["packed-rows", "stock-forward"])
def engine(request, tiny_target_dir) -> TargetEngine:  # one model per forward: the packed one is changed in place
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    return TargetEngine(
        model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8), fast_forward=request.param
    )


def decode(engine: TargetEngine, session, steps: int) -> list[int]:
    """Greedy target-only decoding: ``steps`` tokens."""
    for _ in range(steps):
        engine.verify(session, len(session.tokens), [], None)
    return session.tokens[-steps:]


def test_forks_feed_only_the_prompts_last_token_and_decode_as_alone(engine, gguf_tokenizer):
    prompt = gguf_tokenizer.encode(TINY_PROMPTS[2])
    alone = engine.open("alone", prompt, GREEDY, VerificationMode.GREEDY)
    expected = decode(engine, alone, 6)
    engine.close("alone")

    fed, shared = engine.fed_tokens, engine.shared_tokens
    source = engine.open("source", prompt, GREEDY, VerificationMode.GREEDY)
    forks = [engine.open(f"fork{i}", prompt, GREEDY, VerificationMode.GREEDY, fork_from="source") for i in range(2)]
    assert engine.shared_tokens - shared == 2 * (len(prompt) - 1)
    assert engine.fed_tokens - fed == len(prompt) - 1  # the prompt but its last token, computed once in the source
    for session in (source, *forks):
        assert decode(engine, session, 6) == expected
    # Each of the three then fed the prompt's last token and 5 decoded tokens of its own.
    assert engine.fed_tokens - fed == len(prompt) - 1 + 3 * 6
    for name in ("source", "fork0", "fork1"):
        engine.close(name)


def test_a_fork_of_a_session_past_its_prompt_copies_the_prompt_alone(engine, gguf_tokenizer):
    prompt = gguf_tokenizer.encode(TINY_PROMPTS[0])
    source = engine.open("ahead", prompt, GREEDY, VerificationMode.GREEDY)
    decode(engine, source, 3)  # its cache now holds the prompt and two of its tokens
    fed = engine.fed_tokens
    fork = engine.open("behind", prompt, GREEDY, VerificationMode.GREEDY, fork_from="ahead")
    assert engine.fed_tokens == fed and fork.cache.tokens == prompt[:-1]
    logits = fork.cache.logits(fork.tokens, [])
    alone = engine.open("fresh", prompt, GREEDY, VerificationMode.GREEDY)
    torch.testing.assert_close(logits, alone.cache.logits(alone.tokens, []), rtol=1e-5, atol=1e-5)
    for name in ("ahead", "behind", "fresh"):
        engine.close(name)


@pytest.mark.parametrize("case", ["gone", "other-caller", "features"])
def test_what_cannot_be_shared_opens_a_plain_session(engine, gguf_tokenizer, case):
    prompt = gguf_tokenizer.encode(TINY_PROMPTS[1])
    engine.open("src", prompt, GREEDY, VerificationMode.GREEDY, caller="alice")
    shared, fed = engine.shared_tokens, engine.fed_tokens
    caller, layers, source = {
        "gone": ("alice", (), "nobody"),
        "other-caller": ("bob", (), "src"),
        "features": ("alice", (1,), "src"),
    }[case]
    fork = engine.open(
        "dst", prompt, GREEDY, VerificationMode.GREEDY, caller=caller, feature_layers=layers, fork_from=source
    )
    assert (engine.shared_tokens, engine.fed_tokens, len(fork.cache)) == (shared, fed, 0)
    engine.close("src")
    engine.close("dst")


def test_a_batch_invariant_target_does_not_fork(tiny_target_dir, gguf_tokenizer):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    engine = TargetEngine(
        model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8), batch_invariant=True
    )
    prompt = gguf_tokenizer.encode(TINY_PROMPTS[1])
    engine.open("src", prompt, GREEDY, VerificationMode.GREEDY)
    fork = engine.open("dst", prompt, GREEDY, VerificationMode.GREEDY, fork_from="src")
    assert (engine.shared_tokens, len(fork.cache)) == (0, 0)


def test_forks_that_decode_different_tokens_keep_their_own_keys_and_values(engine, gguf_tokenizer):
    """Forks of one prompt that go different ways, stepped in turn and in shared forwards: each decodes what it
    decodes alone, each token with the logprob it has alone, so none reads or writes another's positions (a
    buffer shared by the copies fails this: the tiny model's argmax barely depends on the context, its logprobs do)."""
    from specsplit.target_service.engine import VerifyItem

    def step(sessions, together: bool) -> list[float]:
        if together:
            outcomes = engine.verify_batch([VerifyItem(s, len(s.tokens), [], None) for s in sessions])
        else:
            outcomes = [engine.verify(s, len(s.tokens), [], None) for s in sessions]
        return [o.logprobs[0].logprob for o in outcomes]

    prompt = gguf_tokenizer.encode(TINY_PROMPTS[2])
    branches = [[*prompt, t] for t in (101, 2024, 7777)]  # the prompt, then a token of each fork's own
    expected = []
    for i, tokens in enumerate(branches):
        alone = engine.open(f"alone{i}", tokens, GREEDY, VerificationMode.GREEDY, top_logprobs=0)
        expected.append((decode(engine, alone, 6), [step([alone], False)[0] for _ in range(6)]))
        engine.close(f"alone{i}")
    assert len({tuple(tokens) for tokens, _ in expected}) == len(branches)  # they really go different ways
    shared = engine.shared_tokens
    engine.open("source", prompt, GREEDY, VerificationMode.GREEDY)
    forks = [engine.open(f"fork{i}", tokens, GREEDY, VerificationMode.GREEDY, top_logprobs=0, fork_from="source")
             for i, tokens in enumerate(branches)]
    assert engine.shared_tokens - shared == len(branches) * len(prompt)  # each took the whole prompt, its token fed
    logprobs = [[] for _ in forks]
    for n in range(12):
        for i, lp in enumerate(step(forks, together=n % 2 == 0)):  # in shared forwards where the engine batches
            logprobs[i].append(lp)
    for fork, got, (tokens, solo) in zip(forks, logprobs, expected):
        assert fork.tokens[len(prompt) + 1 : len(prompt) + 7] == tokens
        assert got[6:] == pytest.approx(solo, abs=1e-5)
    for name in ("source", *(f"fork{i}" for i in range(len(branches)))):
        engine.close(name)
