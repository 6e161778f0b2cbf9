"""Llama 3's JSON and Mistral's tool-call formats (``--tool-call-parser llama3_json`` / ``mistral``) with the
official `openai` client against a real server over the tiny models, each with a chat template written as that
family's renders tools, calls and results (Llama 3.1's: the functions in the first user turn, a call as the
assistant's whole reply, results in an ``ipython`` turn; Mistral's: ``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]`` and
``[TOOL_RESULTS]``). A forced call comes back parsed, whole and streamed, greedy speculative equal to target-only;
under ``auto`` the calls the model writes in the format are read whole and streamed; a conversation with a call
and its result is rendered by the template and counted as the prompt.
"""

from __future__ import annotations

import json

import pytest

from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.tool_parsers import FORMATS
from tests.services.test_tools_openai import ASK, MODEL, SCHEMAS, TOOLS, checked_call, create, named

pytestmark = pytest.mark.services

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- set user_seen = namespace(done=false) %}
{%- for message in messages %}
  {%- if message.role == 'user' and tools and not user_seen.done %}
    {%- set user_seen.done = true %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '
        'that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
        'dictionary of argument name and its value}.Do not use variables.\n\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
    {{- message.content + '<|eot_id|>' }}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {%- for call in message.tool_calls %}
      {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
      {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
      {{- '<|eot_id|>' }}
    {%- endfor %}
  {%- elif message.role == 'tool' or message.role == 'ipython' %}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
  {%- else %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content or '') + '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
  {%- if message.role == 'user' %}
    {%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
    {{- '[INST] ' + message.content + '[/INST]' }}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {{- '[TOOL_CALLS] [' }}
    {%- for call in message.tool_calls %}
      {{- '{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson }}
      {{- ', "id": "' + call.id[-9:] + '"}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
    {%- endfor %}
    {{- ']' + eos_token }}
  {%- elif message.role == 'tool' %}
    {{- '[TOOL_RESULTS] {"content": ' + message.content + ', "call_id": "' + message.tool_call_id[-9:] + '"}' }}
    {{- '[/TOOL_RESULTS]' }}
  {%- else %}
    {{- (message.content or '') + eos_token }}
  {%- endif %}
{%- endfor %}
"""

FAMILIES = {"llama3_json": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
# Under "auto" the text is free; this is what each format's model writes for two calls, made the only text by a
# grammar so that the tiny model writes it.
WRITTEN = {
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
    "mistral": 'Ok. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "a1b2c3d4e"}, '
               '{"name": "add", "arguments": {"a": 3, "b": 4}}]',
}
CONTENT = {"llama3_json": None, "mistral": "Ok."}
WRITTEN_CALLS = [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
RESULT_TEXT = {"llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>',
               "mistral": '[TOOL_RESULTS] {"content": {"temperature": 21}, "call_id": "000000001"}[/TOOL_RESULTS]'}


class Api:
    def __init__(self, name: str, url: str, orch: Orchestrator) -> None:
        self.name, self.url, self.orch = name, url, orch

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def api(request, tiny_services, tiny_target_dir, background_loop, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / f"{request.param}.jinja"
    template.write_text(FAMILIES[request.param])
    config = OrchestratorConfig(
        target_address=tiny_services.target_address, draft_address=tiny_services.draft_address,
        tokenizer=str(tiny_target_dir), served_model_names=(MODEL,), chat_template=str(template),
        tool_call_parser=request.param, enable_auto_tool_choice=True,
    )
    orch = background_loop.run(Orchestrator.connect(config))
    server = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    yield Api(request.param, f"http://127.0.0.1:{server.port}/v1", orch)
    background_loop.run(server.stop())
    background_loop.run(orch.close())


def _streamed(chunks) -> tuple[str, list[tuple[str, dict]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for part in chunk.choices:
            content += part.delta.content or ""
            for delta in part.delta.tool_calls or ():
                name, arguments = calls.get(delta.index, (delta.function.name, ""))
                calls[delta.index] = (name, arguments + (delta.function.arguments or ""))
            finish = part.finish_reason or finish
    return content, [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())], finish


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_forced_call_in_the_format_is_parsed_whole_and_streamed_and_greedy_is_exact(api, name):
    client = api.client()
    speculative = create(client, tools=TOOLS, tool_choice=named(name), extra_body={"k": 6, "drafter": "model"})
    target_only = create(client, tools=TOOLS, tool_choice=named(name), extra_body={"k": 0})
    call = checked_call(speculative.choices[0], [name])
    assert call == checked_call(target_only.choices[0], [name])
    assert speculative.usage.speculative["forced_tokens"] > 0  # the format's text around the arguments
    content, calls, finish = _streamed(create(client, tools=TOOLS, tool_choice=named(name), stream=True,
                                              extra_body={"k": 0}))
    assert (content, calls, finish) == ("", [call], "tool_calls")


def test_auto_reads_the_calls_the_model_writes_in_the_format_whole_and_streamed(api):
    written = WRITTEN[api.name]
    options = {"tools": TOOLS, "max_tokens": len(written) + 1,
               "extra_body": {"guided_grammar": "root ::= " + json.dumps(written)}}
    choice = create(api.client(), **options).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT[api.name]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == WRITTEN_CALLS
    for call in choice.message.tool_calls:
        assert call.function.name in SCHEMAS
    content, calls, finish = _streamed(create(api.client(), stream=True, **options))
    assert (content.strip() or None, calls, finish) == (CONTENT[api.name], WRITTEN_CALLS, "tool_calls")
    free = create(api.client(), **{**options, "tool_choice": "none"})
    assert free.choices[0].message.content == written and free.choices[0].message.tool_calls is None


def test_a_call_and_its_result_are_rendered_by_the_familys_template(api):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_000000001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_000000001", "content": '{"temperature": 21}'}]
    reply = create(api.client(), turns, tools=TOOLS, tool_choice="none", max_tokens=4)
    rendered = [*turns[:1], {**turns[1], "content": "",
                             "tool_calls": [{**call, "function": {**call["function"], "arguments": json.loads(arguments)}}]},
                turns[2]]
    text = api.orch.tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    fmt = FORMATS[api.name]
    assert RESULT_TEXT[api.name] in text
    assert fmt.parse(text[text.index(fmt.start if not fmt.leading else '{"name": "get_weather"'):])[1][0].name == \
        "get_weather"
    assert reply.usage.prompt_tokens == len(api.orch.tokenizer(text, add_special_tokens=False)["input_ids"])
