"""lm-evaluation-harness against the OpenAI-compatible API, with the harness's default settings.

``local-completions`` sends its own tokenization as token-id prompts (log-likelihoods through ``echo`` and
``logprobs``, generations through ``max_tokens`` and ``stop``); ``local-chat-completions`` sends messages. Two
small tasks are built here from local JSON files (no download): a multiple-choice one and a generation one.
Every score the harness reads equals the tiny target's own: each continuation's log-likelihood its teacher-forced
log-softmax over the harness's tokens, each generation its greedy output cut at the task's stop string.
"""

from __future__ import annotations

import json

import pytest
import torch

from specsplit.lmkit import models
from tests.conftest import openai_http

pytestmark = pytest.mark.services

MODEL = "tiny-llama"
QUESTIONS = [
    ("The quick brown fox", [" jumps", " sleeps", " brown fox"], 0),
    ("def fibonacci(n):", ["\n    return n", " pass", " fibonacci"], 1),
    ("1, 2, 3, 4, 5, 6,", [" 7", " 8, 9", " 1, 2"], 0),
    ("Paris is the capital of", [" France", " Paris is", " the moon"], 2),
]
PROMPTS = ["Once upon a time, in a land far away,", "a b a b a b a b", "Q: What is two plus two?\nA:"]
GEN_TOKENS = 10


@pytest.fixture(scope="module")
def url(tiny_services, tiny_target_dir, background_loop):
    with openai_http(background_loop, tiny_services, tiny_target_dir, MODEL) as base:
        yield base


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A task manager that knows the two local tasks."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": "x"}) + "\n" for p in PROMPTS))
    (folder / "mc.yaml").write_text(f"""task: specsplit_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (folder / "gen.yaml").write_text(f"""task: specsplit_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir))), models.load_tokenizer(str(tiny_target_dir))


def _evaluate(model: str, model_args: dict, task: str, tasks, **kwargs) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                                   log_samples=True, **kwargs)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_local_completions_with_tokenized_requests_scores_as_the_target(url, tasks, target, tiny_target_dir,
                                                                        monkeypatch):
    """The harness's defaults: token-id prompts, log-likelihoods of each choice and greedy generations."""
    from lm_eval.api.registry import get_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tokenizer = target
    args = {"model": MODEL, "base_url": f"{url}/completions", "tokenizer": str(tiny_target_dir), "max_retries": 1}
    harness = get_model("local-completions")(**args)
    assert harness.tokenized_requests  # the default this test is about
    scored = _evaluate("local-completions", args, "specsplit_mc", tasks)
    samples = scored["samples"]["specsplit_mc"]
    assert len(samples) == len(QUESTIONS)
    right = 0
    for sample in samples:
        lls = []
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = harness._encode_pair(context, continuation)
            with torch.inference_mode():
                logits = model(torch.tensor([context_ids + continuation_ids])).logits[0].float()
            rows = torch.log_softmax(logits[len(context_ids) - 1: -1], -1)
            want = rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum().item()
            assert ll == pytest.approx(want, abs=1e-3), (context, continuation)
            assert greedy == bool((rows.argmax(-1) == torch.tensor(continuation_ids)).all())
            lls.append(want)
        right += int(max(range(len(lls)), key=lls.__getitem__) == sample["target"])
    assert scored["results"]["specsplit_mc"]["acc,none"] == pytest.approx(right / len(QUESTIONS))

    generated = _evaluate("local-completions", args, "specsplit_gen", tasks)["samples"]["specsplit_gen"]
    assert len(generated) == len(PROMPTS)
    for sample in generated:
        prompt = sample["arguments"][0][0]
        text = tokenizer.decode(_greedy(model, harness.tok_encode(prompt), GEN_TOKENS), skip_special_tokens=True)
        assert sample["resps"][0][0] == text.split("\n\n")[0], prompt


def test_local_chat_completions_generates_the_targets_chat_answer(url, tasks, target, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tokenizer = target
    args = {"model": MODEL, "base_url": f"{url}/chat/completions", "max_retries": 1}
    generated = _evaluate("local-chat-completions", args, "specsplit_gen", tasks,
                          apply_chat_template=True)["samples"]["specsplit_gen"]
    assert len(generated) == len(PROMPTS)
    for sample in generated:
        messages = sample["arguments"][0][0]
        while isinstance(messages, (tuple, list)) and not isinstance(messages[0], dict):
            messages = messages[0]  # the logged request: the conversation's JSON text, wrapped
        turns = json.loads(messages) if isinstance(messages, str) else messages
        assert turns == [{"role": "user", "content": sample["doc"]["prompt"]}]
        ids = list(tokenizer.apply_chat_template(turns, add_generation_prompt=True)["input_ids"])
        text = tokenizer.decode(_greedy(model, ids, GEN_TOKENS), skip_special_tokens=True)
        assert sample["resps"][0][0] == text.split("\n\n")[0], turns
