"""The Responses API (``POST /v1/responses``) with the official `openai` client, ``responses.create`` and
``responses.stream``, against a real server over the tiny models.

Greedy output equals the chat completions path's for the same conversation and the target's own greedy tokens;
the stream's events add up to the whole response; a forced function call and a JSON schema come back as the
Responses API shapes them, and a function call's output fed back as input continues the conversation. What
specsplit does not keep (stored responses) or run (tools other than functions, images) is refused naming it.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from specsplit.lmkit import models
from tests.conftest import openai_http

pytestmark = pytest.mark.services

MODEL = "tiny-llama"
ADD_ARGS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD = {"type": "function", "name": "add", "description": "Add two numbers.", "parameters": ADD_ARGS, "strict": True}


@pytest.fixture(scope="module")
def client(tiny_services, tiny_target_dir, background_loop):
    with openai_http(background_loop, tiny_services, tiny_target_dir, MODEL) as base, \
            openai.OpenAI(base_url=base, api_key="-", max_retries=0) as http:
        yield http


@pytest.fixture(scope="module")
def greedy(tiny_target_dir):
    """The tiny target's own greedy text after a conversation rendered by its chat template."""
    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))

    def text(messages: list[dict], n: int) -> str:
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return text


def test_text_input_and_message_items_give_the_chat_paths_greedy_text(client, greedy):
    whole = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.", temperature=0,
                                    max_output_tokens=12, extra_body={"k": 4})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.store is False
    assert whole.output_text == chat.choices[0].message.content == greedy(messages, 12)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 12
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].role == "assistant"

    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Colour of the sky?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "And grass?"},
    ]
    turns = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Colour of the sky?"},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}]
    again = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=8)
    assert again.output_text == greedy(turns, 8)


def test_the_stream_adds_up_to_the_whole_response(client):
    kwargs = dict(model=MODEL, input="Count to ten.", temperature=0, max_output_tokens=10)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_a_forced_function_call_whole_and_streamed_then_its_output_fed_back(client, greedy):
    kwargs = dict(model=MODEL, input="What is 2 plus 3?", tools=[ADD], temperature=0,
                  tool_choice={"type": "function", "name": "add"})
    whole = client.responses.create(**kwargs)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_") and whole.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD_ARGS)
    with client.responses.stream(**kwargs) as stream:
        deltas = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert "".join(deltas) == streamed.arguments == call.arguments and streamed.name == "add"

    follow = [{"role": "user", "content": "What is 2 plus 3?"},
              {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=[ADD], tool_choice="none", temperature=0,
                                     max_output_tokens=8)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
        messages=[{"role": "user", "content": "What is 2 plus 3?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "5"}])
    assert answer.output_text == chat.choices[0].message.content


def test_a_json_schema_text_format_gives_json_that_validates(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Pick a colour.", temperature=0, text={
        "format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("fields, param, fragment", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"background": True}, "background", "stored responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "text parts"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning' item"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"max_output_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
])
def test_what_cannot_be_served_is_refused_naming_it(client, fields, param, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": "hi", **fields})
    assert info.value.status_code == 400 and fragment in info.value.message, info.value.message
    assert (info.value.body or {}).get("param") == param
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="hi")
