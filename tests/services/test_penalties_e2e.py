"""Greedy output with penalties and biases through the real services equals a non-speculative reference.

repetition_penalty, logit_bias and min_tokens against transformers' own
``generate`` (repetition_penalty, sequence_bias, min_new_tokens); presence and
frequency penalties against a plain decode loop that applies OpenAI's formula.
With the model and n-gram drafters, chains and token trees, so every verified
position is decided with the draft tokens before it as its context.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from tests.conftest import TINY_PROMPTS, run_async

pytestmark = pytest.mark.services

NEW = 24
PROMPTS = [TINY_PROMPTS[i] for i in (0, 3, 6)]  # prose, a counting list, a repeating pattern (n-gram matches)
EOS = 2  # the tiny models' end-of-sequence token

CASES = {
    # The tiny target points at context tokens: 1.5 moves it off some of them, and its text still repeats (so
    # n-gram drafts are accepted under the penalty); 2 moves it off the context altogether.
    "repetition": (SamplingParams(repetition_penalty=1.5), {"repetition_penalty": 1.5}),
    # Bans the counting prompt's repeated token (28); token 13 gains 9.
    "bias": (SamplingParams(logit_bias=((13, 9.0), (28, -100.0))), {"sequence_bias": {(13,): 9.0, (28,): -100.0}}),
    # A strong EOS bias would end at once; min_tokens holds it back for 5 tokens.
    "min_tokens": (
        SamplingParams(logit_bias=((EOS, 30.0),), min_tokens=5),
        {"sequence_bias": {(EOS,): 30.0}, "min_new_tokens": 5},
    ),
}


@pytest.fixture(scope="module")
def target_model(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


@pytest.fixture(scope="module")
def prompts_ids(gguf_tokenizer):
    return [gguf_tokenizer.encode(p) for p in PROMPTS]


def transformers_greedy(model, prompt_ids: list[int], **settings) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=EOS, **settings
        )
    return out[0, len(prompt_ids) :].tolist()


def openai_penalty_greedy(model, prompt_ids: list[int], presence: float, frequency: float) -> list[int]:
    """One token per forward; logit[t] -= count[t] * frequency + (count[t] > 0) * presence over generated tokens."""
    ids, new = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(NEW):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for token in set(new):
                logits[token] -= new.count(token) * frequency + presence
            token = int(logits.argmax())
            new.append(token)
            ids.append(token)
            if token == EOS:
                break
    return new


async def speculative(services, tokenizer_ref, prompts_ids, sampling, drafter, k, branches) -> tuple[list, list]:
    config = OrchestratorConfig(services.target_address, services.draft_address, tokenizer=tokenizer_ref)
    orch = await Orchestrator.connect(config)
    outputs, trees = [], []
    try:
        for ids in prompts_ids:
            request = GenerationRequest("", False, NEW, sampling, (), k, drafter, False, tree_branches=branches)
            got: list[int] = []
            async for event in orch.generate(request, ids):
                got.extend(event.token_ids)
                if event.stats is not None:
                    trees.append((event.stats.tree_rounds, event.stats.accepted_tokens))
            outputs.append(got)
    finally:
        await orch.close()
    return outputs, trees


SHAPES = [(DrafterKind.NGRAM, 4, 1), (DrafterKind.MODEL, 4, 1), (DrafterKind.NGRAM, 6, 4), (DrafterKind.MODEL, 6, 4)]


@pytest.mark.parametrize("drafter, k, branches", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("case", CASES)
def test_greedy_with_penalties_equals_transformers_generate(
    tiny_services, tiny_target_dir, target_model, prompts_ids, case, drafter, k, branches
):
    sampling, settings = CASES[case]
    expected = [transformers_greedy(target_model, ids, **settings) for ids in prompts_ids]
    assert expected != [transformers_greedy(target_model, ids) for ids in prompts_ids]  # the setting matters here
    got, trees = run_async(
        speculative(tiny_services, str(tiny_target_dir), prompts_ids, sampling, drafter, k, branches)
    )
    assert got == expected
    if drafter is DrafterKind.MODEL and branches > 1:
        assert sum(rounds for rounds, _ in trees) > 0  # rounds did verify token trees
    if drafter is DrafterKind.NGRAM:
        assert sum(accepted for _, accepted in trees) > 0  # positions decided after accepted draft tokens
    if case == "min_tokens":
        assert all(len(out) == 6 and out[-1] == EOS for out in got)  # EOS right after the 5 it was held back for


@pytest.mark.parametrize("drafter, k, branches", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_greedy_with_openai_penalties_equals_a_plain_decode(
    tiny_services, tiny_target_dir, target_model, prompts_ids, drafter, k, branches
):
    sampling = SamplingParams(presence_penalty=0.4, frequency_penalty=0.6)
    expected = [openai_penalty_greedy(target_model, ids, 0.4, 0.6) for ids in prompts_ids]
    got, _ = run_async(speculative(tiny_services, str(tiny_target_dir), prompts_ids, sampling, drafter, k, branches))
    assert got == expected
    unpenalized, _ = run_async(
        speculative(
            tiny_services,
            str(tiny_target_dir),
            prompts_ids,
            replace(sampling, presence_penalty=0.0, frequency_penalty=0.0),
            drafter,
            k,
            1,
        )
    )
    assert unpenalized != got  # the penalties changed the text: the test can tell


def test_ignore_eos_generates_past_eos(tiny_services, tiny_target_dir, prompts_ids):
    sampling = SamplingParams(logit_bias=((EOS, 30.0),), ignore_eos=True)
    got, _ = run_async(
        speculative(tiny_services, str(tiny_target_dir), prompts_ids[:1], sampling, DrafterKind.NGRAM, 4, 1)
    )
    assert got == [[EOS] * NEW]


@pytest.mark.slow
def test_smollm2_greedy_with_repetition_penalty_equals_transformers_generate(background_loop):
    """The real default target, its chat template, the n-gram drafter with token trees."""
    from specsplit.bench.prompts import DEMO_PROMPTS
    from tests.conftest import Services, make_engines

    tokenizer = models.load_tokenizer("smollm2-135m")
    prompts_ids = [
        list(
            tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)[
                "input_ids"
            ]
        )
        for p in DEMO_PROMPTS[:3]
    ]
    model = models.load_model(models.ModelSpec("smollm2-135m"))
    expected = [transformers_greedy(model, ids, repetition_penalty=1.3) for ids in prompts_ids]
    assert expected != [transformers_greedy(model, ids) for ids in prompts_ids]
    services = Services(background_loop, *make_engines("smollm2-135m", None))
    try:
        sampling = SamplingParams(repetition_penalty=1.3)
        got, _ = run_async(speculative(services, "smollm2-135m", prompts_ids, sampling, DrafterKind.NGRAM, 8, 4))
    finally:
        services.stop()
    assert got == expected
