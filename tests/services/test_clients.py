"""Third-party OpenAI clients against `specsplit serve --http-port` with the default model (SmolLM2) and only
vLLM's tool flags (``--enable-auto-tool-choice --tool-call-parser hermes``): the calls people make from the
official `openai` SDK (``parse`` with a Pydantic model, a Pydantic function tool, the streaming helper's
tool-call events, lm-evaluation-harness's echo), from instructor (its default TOOLS mode and JSON-schema
mode) and from LangChain (``bind_tools`` with ``invoke`` and ``stream``, ``with_structured_output`` by
function calling and by JSON schema). SmolLM2's own chat template renders no tools, so the tools reach the
model written into the conversation; a named tool choice is forced by the grammar.

Each answer is checked the way the client itself would use it (a validated Pydantic object, parsed
arguments); where a tool call is forced, greedy output through the client equals the SDK's target-only
(k = 0) call.
"""

from __future__ import annotations

import json
import math

import instructor
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.services.smollm2_http import smollm2_http

pytestmark = [pytest.mark.services, pytest.mark.slow]

MODEL = "smollm2"
MAX_TOKENS = 96
ASK_WEATHER = "What is the weather in Paris, in celsius?"
ASK_PERSON = "Extract the person: Maria Lopez is 34 years old and lives in Madrid."


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=16)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=24)


@tool
def get_weather(city: str, unit: str) -> str:
    """The weather in a city, in celsius or fahrenheit."""
    return f"21 {unit} in {city}"


class Server:
    def __init__(self, url: str) -> None:
        self.url = url

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="-", max_retries=0, timeout=600)

    def langchain(self, **options) -> ChatOpenAI:
        return ChatOpenAI(
            base_url=self.url, api_key="-", model=MODEL, temperature=0, max_tokens=MAX_TOKENS, max_retries=0, **options
        )


@pytest.fixture(scope="module")
def server(background_loop, tmp_path_factory):
    """`specsplit serve --http-port` over SmolLM2 with the tool flags vLLM users pass and nothing else."""
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with smollm2_http(background_loop, tmp_path_factory.mktemp("clients"), MODEL, *flags) as url:
        yield Server(url)


def target_only_call(server: Server, name: str, parameters: dict, prompt: str) -> tuple[str, dict]:
    """The SDK's forced call of ``name`` decoded by the target alone (k = 0), greedy."""
    tools = [{"type": "function", "function": {"name": name, "parameters": parameters}}]
    reply = server.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": name}},
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"k": 0},
    )
    (call,) = reply.choices[0].message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


# the official SDK


def test_sdk_parse_with_a_pydantic_response_format(server):
    done = server.openai().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": ASK_PERSON}],
        response_format=Person,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="get_weather")
FORCED_WEATHER = dict(  # a forced call of the Pydantic function tool, as the SDK's parse and stream take it
    model=MODEL,
    messages=[{"role": "user", "content": ASK_WEATHER}],
    tools=[WEATHER_TOOL],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    temperature=0,
    max_tokens=MAX_TOKENS,
)


def test_sdk_parse_with_a_pydantic_function_tool_is_the_target_only_call(server):
    done = server.openai().chat.completions.parse(**FORCED_WEATHER)
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and isinstance(call.function.parsed_arguments, Weather)
    expected = target_only_call(server, "get_weather", WEATHER_TOOL["function"]["parameters"], ASK_WEATHER)
    assert (call.function.name, call.function.parsed_arguments.model_dump()) == expected


def test_sdk_stream_helper_sees_the_arguments_grow_and_ends_with_the_parsed_call(server):
    deltas = []
    with server.openai().chat.completions.stream(**FORCED_WEATHER, extra_body={"k": 0}) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append(event.arguments_delta)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)
    assert len(deltas) > 1 and "".join(deltas) == call.function.arguments


def test_sdk_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(server):
    """lm-evaluation-harness's log-likelihood request."""
    done = server.openai().completions.create(
        model=MODEL, prompt="The capital of France is Paris", echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = done.choices[0]
    assert choice.text == "The capital of France is Paris"
    scored = choice.logprobs.token_logprobs
    assert scored[0] is None and len(scored) == len(choice.logprobs.tokens) > 3
    assert all(math.isfinite(value) and value <= 0 for value in scored[1:])
    assert "".join(choice.logprobs.tokens) == choice.text


# instructor


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_extracts_a_validated_model(server, mode):
    client = instructor.from_openai(server.openai(), mode=mode)
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[{"role": "user", "content": ASK_PERSON}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )
    assert isinstance(person, Person) and person.name
    if mode is instructor.Mode.TOOLS:  # a forced call of the tool named after the model
        expected = target_only_call(server, "Person", Person.model_json_schema(), ASK_PERSON)
        assert ("Person", person.model_dump()) == expected


# LangChain


def test_langchain_bind_tools_invoke_is_the_target_only_call(server):
    message = server.langchain().bind_tools([get_weather], tool_choice="get_weather").invoke(ASK_WEATHER)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    schema = get_weather.tool_call_schema.model_json_schema()
    assert (call["name"], call["args"]) == target_only_call(server, "get_weather", schema, ASK_WEATHER)


def test_langchain_bind_tools_stream_adds_up_to_the_call(server):
    bound = server.langchain().bind_tools([get_weather], tool_choice="get_weather")
    chunks = list(bound.stream(ASK_WEATHER))
    whole: AIMessageChunk = sum(chunks[1:], chunks[0])
    (call,) = whole.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    assert sum(bool(chunk.tool_call_chunks) for chunk in chunks) > 1  # the arguments came in pieces
    assert call["args"] == bound.invoke(ASK_WEATHER).tool_calls[0]["args"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server, method):
    person = server.langchain().with_structured_output(Person, method=method).invoke(ASK_PERSON)
    assert isinstance(person, Person) and person.name
