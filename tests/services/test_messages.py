"""Multi-turn, logprobs and request ids on the gRPC API, and JSON log lines that name their request."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
import torch

from specsplit.client import Client
from specsplit.lmkit import models
from specsplit.lmkit.processes import start_service
from specsplit.target_service.ranks import free_port

pytestmark = pytest.mark.services

TURNS = [("system", "Be brief."), ("user", "Name a colour."), ("assistant", "Red."), ("user", "Another one?")]


def test_a_conversation_is_answered_as_the_target_answers_it_alone(public_api, tiny_target_dir):
    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    prompt = list(tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in TURNS],
                                                add_generation_prompt=True)["input_ids"])
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=2)
    expected = expected[0, len(prompt):].tolist()
    with Client(public_api) as client:
        done = client.complete(messages=TURNS, max_new_tokens=12, k=4, return_token_ids=True, logprobs=True,
                               top_logprobs=2, request_id="conv-1")
    assert done.token_ids == expected
    assert done.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert done.stats.prompt_tokens == len(prompt) and done.stats.request_id == "conv-1"
    assert [lp.token_id for lp in done.logprobs] == expected
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id and lp.logprob <= 0 for lp in done.logprobs)


@pytest.mark.parametrize("request_fields, fragment", [
    ({"prompt": "hi", "messages": [("user", "hi")]}, "one of prompt, prompt_token_ids and messages"),
    ({"messages": [("narrator", "hi")]}, "messages[0].role"),
    ({"prompt": "hi", "top_logprobs": 3}, "top_logprobs needs return_logprobs"),
    ({"prompt": "hi", "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ({"prompt": "hi", "request_id": "has spaces in it"}, "request_id"),
    ({"prompt": "", "messages": []}, "prompt is empty"),
])
def test_bad_conversations_and_options_are_invalid_argument(public_api, request_fields, fragment):
    with Client(public_api) as client, pytest.raises(grpc.RpcError) as info:
        client.complete(**request_fields, max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()


def test_json_log_lines_of_a_generation_carry_its_request_id(tiny_services, tiny_target_dir, tmp_path):
    """Also `serve --http-port` as a process: the OpenAI API beside gRPC, its X-Request-ID in the log lines,
    and SIGTERM stopping both servers cleanly."""
    http_port = free_port()
    orchestrator = start_service(
        "specsplit.orchestrator.api.server", "orchestrator",
        ["--target", tiny_services.target_address, "--draft", tiny_services.draft_address, "--tokenizer",
         str(tiny_target_dir), "--log-format", "json", "--log-level", "DEBUG", "--http-port", str(http_port),
         "--served-model-name", "tiny"], tmp_path, 300,
    )
    try:
        with Client(orchestrator.address) as client:
            for request_id in ("trace-1", "trace-2"):
                client.complete("a b a b a b", chat=False, max_new_tokens=8, k=4, request_id=request_id)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0) as http:
            done = http.completions.create(model="tiny", prompt="a b a b a b", max_tokens=8, temperature=0,
                                           extra_headers={"X-Request-ID": "trace-3"})
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
    finally:
        assert orchestrator.stop(60) == 0, orchestrator.log_tail()
    lines = [json.loads(line) for line in orchestrator.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "component", "logger", "message"} <= set(line) for line in lines)
    for request_id in ("trace-1", "trace-2", "trace-3"):
        own = [line for line in lines if line.get("request_id") == request_id and line["logger"].startswith("specsplit.orchestrator")]
        assert [line["message"].split(":")[0] for line in own] == ["started", "finished (length)"], own
    # grpc's own lines during a generation are tagged too; lines outside any generation are not
    assert any(line.get("request_id") and line["logger"].startswith("grpc") for line in lines)
    assert any(line["message"].startswith("target ") and "request_id" not in line for line in lines)
