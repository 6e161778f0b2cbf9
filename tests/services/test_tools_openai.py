"""Tool calls with the official `openai` client against a real server over the tiny models.

The tools are rendered by the bundled Hermes-style chat template (``--chat-template hermes-tools``), through
transformers' ``apply_chat_template``. A named ``tool_choice`` (and ``"required"``) forces one call through
the grammar: the reply's ``tool_calls`` parse and their arguments validate against the function's schema,
greedy speculative output equals target-only decoding (k = 0), and the streamed deltas add up to the same
call. ``"none"`` gives plain text. A template that renders no tools (SmolLM2's own) gets them written into
the conversation in the Hermes format, so a forced call works there too. Bad tools, an uncompilable schema
and an unknown function are 400s in OpenAI's shape.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from specsplit.lmkit import models
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator, read_chat_template
from specsplit.orchestrator.api.server import build_parser, config_from_args, start_server
from specsplit.orchestrator.api.tool_parsers import HERMES
from specsplit.orchestrator.api.tools import call_grammar, parse_tools
from specsplit.orchestrator.decode.grammar import GrammarKind, GrammarSpec
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async
from tests.services.masked_reference import masked_greedy

pytestmark = pytest.mark.services

MODEL = "tiny-llama"
TEMPLATE = "hermes-tools"  # the bundled template, by the name --chat-template takes
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_ARGS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_ARGS},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": ADD_ARGS}},
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "add": ADD_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


class Api:
    def __init__(self, url: str, plain_url: str, orch: Orchestrator, grpc_address: str, plain: Orchestrator) -> None:
        self.url, self.plain_url, self.orch, self.grpc_address, self.plain = url, plain_url, orch, grpc_address, plain

    def client(self, plain: bool = False) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.plain_url if plain else self.url, api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def api(tiny_services, tiny_target_dir, background_loop):
    """The HTTP API with the Hermes template and auto tool choice on; beside it one with the tokenizer's own
    template (SmolLM2's, which renders no tools) and the flag off."""
    base = dict(
        target_address=tiny_services.target_address,
        draft_address=tiny_services.draft_address,
        tokenizer=str(tiny_target_dir),
        served_model_names=(MODEL,),
    )
    orch = background_loop.run(
        Orchestrator.connect(OrchestratorConfig(**base, chat_template=TEMPLATE, enable_auto_tool_choice=True))
    )
    plain = background_loop.run(Orchestrator.connect(OrchestratorConfig(**base)))
    servers = [
        background_loop.run(openai_server.start_http_server(openai_server.build_app(o), "127.0.0.1", 0))
        for o in (orch, plain)
    ]
    grpc_server, grpc_port = background_loop.run(start_server(orch))
    yield Api(*(f"http://127.0.0.1:{s.port}/v1" for s in servers), orch, f"127.0.0.1:{grpc_port}", plain)
    background_loop.run(grpc_server.stop(0))
    for server in servers:
        background_loop.run(server.stop())
    for o in (orch, plain):
        background_loop.run(o.close())


def create(client, messages=ASK, **options):
    options = {"max_tokens": 96, "temperature": 0, **options}
    return client.chat.completions.create(model=MODEL, messages=messages, **options)


def checked_call(choice, names) -> tuple[str, dict]:
    """The one call of a reply: its name (one of ``names``) and its arguments, validated against the schema."""
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return call.function.name, arguments


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_function_is_called_with_valid_arguments_and_greedy_is_exact(api, name, drafter):
    client = api.client()
    speculative = create(client, tools=TOOLS, tool_choice=named(name), extra_body={"k": 6, "drafter": drafter})
    target_only = create(client, tools=TOOLS, tool_choice=named(name), extra_body={"k": 0})
    assert checked_call(speculative.choices[0], [name]) == checked_call(target_only.choices[0], [name])
    assert speculative.usage.speculative["forced_tokens"] > 0  # the call's wrapper and keys are free drafts


def test_required_calls_one_of_the_tools(api):
    for seed in (1, 2, 3):
        reply = create(api.client(), tools=TOOLS, tool_choice="required", temperature=0.9, seed=seed)
        checked_call(reply.choices[0], SCHEMAS)


def test_each_of_n_samples_parses_its_own_call_whole_and_streamed(api):
    """n = 3 sampled forced calls: every choice carries one valid call, numbered from 0 within its choice; the
    stream gives each choice the call its whole reply has (same seed, same samples)."""
    options = dict(tools=TOOLS, tool_choice="required", temperature=0.9, seed=5, n=3)
    whole = create(api.client(), **options)
    calls = [checked_call(choice, SCHEMAS) for choice in sorted(whole.choices, key=lambda c: c.index)]
    assert len(calls) == 3 and len(set(map(json.dumps, calls))) > 1  # the samples differ
    streamed: dict[int, list[str]] = {}
    for chunk in create(api.client(), stream=True, **options):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                assert delta.index == 0  # one call in each choice
                if delta.id:
                    streamed[choice.index] = [delta.function.name, ""]
                streamed[choice.index][1] += delta.function.arguments
            if choice.finish_reason:
                assert choice.finish_reason == "tool_calls"
    assert [(streamed[i][0], json.loads(streamed[i][1])) for i in range(3)] == calls


def test_streamed_call_deltas_add_up_to_the_whole_call(api):
    """As OpenAI streams a call: the first delta carries its id and name, the arguments follow in pieces."""
    client = api.client()
    whole = create(client, tools=TOOLS, tool_choice=named("get_weather"), extra_body={"k": 0}).choices[0]
    calls: dict[int, dict] = {}
    finish, content = None, ""
    stream = create(client, tools=TOOLS, tool_choice=named("get_weather"), stream=True, extra_body={"k": 0})
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "ids": [], "pieces": 0})
                call["ids"].append(delta.id)
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                call["pieces"] += bool(delta.function.arguments)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["ids"][0].startswith("call_") and set(calls[0]["ids"][1:]) == {None}
    assert calls[0]["pieces"] > 1, calls  # the arguments came in several deltas
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        whole.message.tool_calls[0].function.name,
        whole.message.tool_calls[0].function.arguments,
    )


def test_an_end_tag_inside_an_argument_is_read_the_same_whole_and_streamed(api):
    """The one value a forced call can take holds the format's end tag: the whole reply and the stream both carry
    the call with that value, no content."""
    echo = {"type": "object", "properties": {"s": {"enum": ["a</tool_call>b"]}}, "required": ["s"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "echo", "parameters": echo}}]
    options = dict(tools=tools, tool_choice=named("echo"), extra_body={"k": 4})
    whole = create(api.client(), **options).choices[0]
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("echo", {"s": "a</tool_call>b"})
    content, name, arguments = "", "", ""
    for chunk in create(api.client(), stream=True, **options):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
    assert (content, name, arguments) == ("", "echo", call.function.arguments)


def test_none_gives_plain_text_with_the_tools_in_the_prompt(api):
    client = api.client()
    with_tools = create(client, tools=TOOLS, tool_choice="none", max_tokens=12)
    without = create(client, max_tokens=12)
    choice = with_tools.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content
    tokenizer = api.orch.tokenizer
    rendered = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert with_tools.usage.prompt_tokens == len(rendered) > without.usage.prompt_tokens


# Under "auto" the text is free; this grammar makes the model write text and then two calls, to parse.
WRITTEN = 'Ok.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' + (
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
)
WRITTEN_GRAMMAR = "root ::= " + json.dumps(WRITTEN)
WRITTEN_CALLS = [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]


def test_auto_parses_the_calls_the_model_writes_whole_and_streamed(api):
    client = api.client()
    # tool_choice unset: "auto"; a random model may spell the text a character a token
    options = {"tools": TOOLS, "max_tokens": len(WRITTEN) + 1, "extra_body": {"guided_grammar": WRITTEN_GRAMMAR}}
    choice = create(client, **options).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Ok."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == WRITTEN_CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2
    content, streamed, finish = "", {}, None
    for chunk in create(client, stream=True, **options):
        for part in chunk.choices:
            content += part.delta.content or ""
            for delta in part.delta.tool_calls or ():
                name, arguments = streamed.get(delta.index, (delta.function.name, ""))
                streamed[delta.index] = (name, arguments + delta.function.arguments)
            finish = part.finish_reason or finish
    streamed = {index: (name, json.loads(arguments)) for index, (name, arguments) in streamed.items()}
    assert (content.strip(), [streamed[i] for i in sorted(streamed)], finish) == (
        "Ok.",
        WRITTEN_CALLS,
        "tool_calls",
    )
    free = create(client, **{**options, "tool_choice": "none"})
    assert free.choices[0].message.content == WRITTEN and free.choices[0].message.tool_calls is None


def test_a_conversation_with_calls_and_results_is_rendered_by_the_template(api):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = create(api.client(), turns, tools=TOOLS, tool_choice="none", max_tokens=4)
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    text = api.orch.tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text and '"city": "Paris"' in text
    assert reply.usage.prompt_tokens == len(api.orch.encode("", True, expected, TOOLS))
    assert reply.usage.prompt_tokens == len(api.orch.tokenizer(text, add_special_tokens=False)["input_ids"])


async def _grpc_generate(address: str, request: pb.GenerateRequest) -> tuple[str, list[int], pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        responses = [r async for r in pb_grpc.GeneratorStub(channel).Generate(request)]
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids], responses[-1]


def test_over_grpc_tool_turns_render_and_a_forced_call_is_the_targets_masked_greedy(api, tiny_target_dir):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    messages = [
        pb.ChatMessage(role="user", content="Add 2 and 3, then 4."),
        pb.ChatMessage(role="assistant", tool_calls=json.dumps(calls)),
        pb.ChatMessage(role="tool", content="5", tool_call_id="call_1"),
    ]
    grammar = call_grammar(parse_tools([TOOLS[1]]), HERMES)
    request = pb.GenerateRequest(
        messages=messages,
        tools=json.dumps(TOOLS),
        max_new_tokens=96,
        return_token_ids=True,
        k=6,
        drafter=pb.DRAFTER_KIND_MODEL,
    )
    request.grammar.ebnf = grammar
    text, ids, last = run_async(_grpc_generate(api.grpc_address, request))
    turns = [
        {"role": "user", "content": "Add 2 and 3, then 4."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**calls[0], "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    ]
    prompt_ids = api.orch.encode("", True, turns, TOOLS)
    assert last.stats.prompt_tokens == len(prompt_ids)
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    compiled = api.orch.compile_grammar(GrammarSpec(GrammarKind.EBNF, grammar))
    assert ids == masked_greedy(model, compiled, prompt_ids, 96) and last.finish_reason == pb.FINISH_REASON_EOS
    content, (call,) = HERMES.parse(text)
    assert content is None and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD_ARGS)
    bad = pb.GenerateRequest(messages=messages[:1], tools='{"type": "function"}')
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run_async(_grpc_generate(api.grpc_address, bad))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-empty list" in caught.value.details()


def refused(call, status: int = 400) -> dict:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    assert caught.value.status_code == status
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_a_template_without_tools_gets_them_written_into_the_conversation(api):
    """SmolLM2's template renders no tools: a named or required call still comes back valid, exact under
    speculation, and the tools, the calls and their results reach the model as the Hermes template writes them."""
    client = api.client(plain=True)
    speculative = create(client, tools=TOOLS, tool_choice=named("add"), extra_body={"k": 6, "drafter": "ngram"})
    target_only = create(client, tools=TOOLS, tool_choice=named("add"), extra_body={"k": 0})
    assert checked_call(speculative.choices[0], ["add"]) == checked_call(target_only.choices[0], ["add"])
    checked_call(create(client, tools=TOOLS, tool_choice="required", temperature=0.9, seed=4).choices[0], SCHEMAS)
    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    text = api.plain.tokenizer.decode(api.plain.encode("", True, turns, TOOLS))
    for tool in TOOLS:
        assert json.dumps(tool) in text  # the definitions, in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    hermes = api.orch.tokenizer.apply_chat_template(
        [*ASK, {**turns[1], "content": ""}, turns[2]], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.split("</tools>")[1] == hermes.split("</tools>")[1]  # from the tools on, as the Hermes template
    call = turns[1]["tool_calls"][0]  # over HTTP the arguments are a JSON text, as OpenAI sends them
    sent = [*ASK, {**turns[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": json.dumps(
        call["function"]["arguments"])}}]}, turns[2]]
    reply = create(client, sent, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert reply.usage.prompt_tokens == len(api.plain.encode("", True, turns, TOOLS))
    error = refused(lambda: create(client, tools=TOOLS))  # auto still needs the flag
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


@pytest.mark.parametrize(
    "options, param, words",
    [
        ({"tools": {"type": "function"}}, "tools", "valid list"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            'Unsupported type \\"objec\\"',
        ),
        ({"tools": TOOLS, "tool_choice": named("sub")}, "tool_choice", "does not define"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": named("add"), "response_format": {"type": "json_object"}},
            "response_format",
            "its own structured output",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "more than once"),
    ],
)
def test_bad_tools_are_400s_in_openai_shape(api, options, param, words):
    error = refused(lambda: create(api.client(), **options))
    assert error["param"] == param and words in json.dumps(error["message"]), error


def test_bad_tool_turns_are_400s(api):
    bad_calls = [
        *ASK,
        {
            "role": "user",
            "content": "x",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    assert (
        "for assistant turns"
        in refused(lambda: create(api.client(), bad_calls, tools=TOOLS, tool_choice="none"))["message"]
    )
    not_json = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
        },
    ]
    assert "not a JSON array of tool calls" in refused(lambda: create(api.client(), not_json))["message"]


def test_the_flags_reach_the_config_and_a_bad_template_file_is_refused(tmp_path, tiny_target_dir):
    args = build_parser().parse_args(
        ["--chat-template", TEMPLATE, "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    )
    config = config_from_args(args)
    assert (config.chat_template, config.tool_call_parser, config.enable_auto_tool_choice) == (
        TEMPLATE,
        "hermes",
        True,
    )
    assert "tools" in read_chat_template(config.chat_template)
    own = tmp_path / "own.jinja"
    own.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(own)) == own.read_text()  # a file of one's own
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if tools %}")
    with pytest.raises(ValueError, match="not a Jinja template"):
        read_chat_template(str(broken))
    with pytest.raises(ValueError, match="cannot read it"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "pythonic"])
    assert build_parser().parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json, mistral"):
        OrchestratorConfig("127.0.0.1:1", tool_call_parser="pythonic")
    assert models.load_tokenizer(str(tiny_target_dir)).chat_template  # the tokenizer's own, which has no tools
