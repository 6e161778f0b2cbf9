"""Tools and tool_choice checked, and the grammar of a forced call: exactly one call, in the template's format,
with arguments that follow the function's schema (xgrammar on the SmolLM2 tokenizer)."""

from __future__ import annotations

import json

import pytest

from specsplit.orchestrator.api import tools
from specsplit.orchestrator.api.tool_parsers import HERMES
from specsplit.orchestrator.decode.grammar import GrammarKind, Grammars, GrammarSpec

pytestmark = pytest.mark.unit

EOS = 2
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def call(name: str, arguments: dict) -> str:
    return HERMES.call_prefix(name) + json.dumps(arguments) + HERMES.call_suffix()


@pytest.fixture(scope="module")
def grammars(gguf_tokenizer) -> Grammars:
    return Grammars(gguf_tokenizer, 49152, [EOS])


def accepts(grammars, gguf_tokenizer, ebnf: str, text: str) -> bool:
    """Whether the compiled grammar takes ``text`` whole (then only the end of sequence)."""
    constraint = grammars.constraint(grammars.compile(GrammarSpec(GrammarKind.EBNF, ebnf)), 32, False)
    try:
        constraint.advance(gguf_tokenizer.encode(text) + [EOS])
    except ValueError:
        return False
    return constraint.terminated


def test_a_named_function_forces_one_call_of_it_with_valid_arguments(grammars, gguf_tokenizer):
    plan = tools.plan([WEATHER, ADD], NAMED_ADD, HERMES, auto_enabled=False)
    assert (plan.choice, plan.parses_calls) == ("function", True)
    assert json.loads(plan.tools_json) == [WEATHER, ADD]
    assert accepts(grammars, gguf_tokenizer, plan.grammar, call("add", {"a": 1, "b": -20}))
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, call("add", {"a": 1, "b": "2"}))  # off the schema
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, call("add", {"a": 1}))  # b is required
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, call("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, "The answer is 3.")
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, call("add", {"a": 1, "b": 2}) * 2)


def test_required_forces_one_call_of_any_tool(grammars, gguf_tokenizer):
    plan = tools.plan([WEATHER, ADD], "required", HERMES, auto_enabled=False)
    assert accepts(grammars, gguf_tokenizer, plan.grammar, call("add", {"a": 1, "b": 2}))
    assert accepts(grammars, gguf_tokenizer, plan.grammar, call("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, call("get_weather", {"city": "Oslo", "unit": "kelvin"}))
    assert not accepts(grammars, gguf_tokenizer, plan.grammar, call("sub", {"a": 1, "b": 2}))


def test_strict_false_lets_arguments_carry_properties_the_schema_does_not_name(grammars, gguf_tokenizer):
    loose = {"type": "function", "function": {**ADD["function"], "strict": False}}
    extra = call("add", {"a": 1, "b": 2, "note": "x"})
    assert not accepts(grammars, gguf_tokenizer, tools.plan([ADD], NAMED_ADD, HERMES, False).grammar, extra)
    assert accepts(grammars, gguf_tokenizer, tools.plan([loose], NAMED_ADD, HERMES, False).grammar, extra)


def test_none_and_auto_leave_the_text_free():
    assert tools.plan([ADD], "none", HERMES, False) == tools.ToolPlan(json.dumps([ADD]), "none")
    assert not tools.plan([ADD], "none", HERMES, False).parses_calls
    auto = tools.plan([ADD], None, HERMES, auto_enabled=True)
    assert (auto.choice, auto.grammar, auto.parses_calls) == ("auto", "", True)


def refusal(tool_list, choice="required", auto_enabled=False) -> tools.ToolError:
    with pytest.raises(tools.ToolError) as caught:
        tools.plan(tool_list, choice, HERMES, auto_enabled)
    return caught.value


def test_auto_needs_the_server_flag():
    error = refusal([ADD], None)
    assert error.param == "tool_choice" and "--enable-auto-tool-choice" in str(error)


@pytest.mark.parametrize(
    "tool_list, param, words",
    [
        ({"type": "function"}, "tools", "non-empty list"),
        ([], "tools", "non-empty list"),
        ([{"type": "retrieval"}], "tools[0]", '"type": "function"'),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name", "letters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            "tools[0].function.parameters",
            "object",
        ),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict", "boolean"),
        ([{"type": "function", "function": {"name": "f", "params": {}}}], "tools[0]", "unknown fields ['params']"),
        ([ADD, ADD], "tools", "more than once"),
        (
            [ADD, {"type": "function", "function": {"name": "g", "parameters": {"type": "objec"}}}],
            "tools[1].function.parameters",
            'does not compile: Unsupported type "objec"',
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tool_list, param, words):
    error = refusal(tool_list)
    assert error.param == param and words in str(error), str(error)


@pytest.mark.parametrize(
    "choice, words",
    [
        ({"type": "function", "function": {"name": "sub"}}, "does not define (it defines add)"),
        ({"type": "function", "name": "add"}, 'must be "none", "auto", "required"'),
        ("always", 'must be "none", "auto", "required"'),
    ],
)
def test_a_bad_tool_choice_is_refused(choice, words):
    error = refusal([ADD], choice)
    assert error.param == "tool_choice" and words in str(error), str(error)


def test_a_template_renders_tools_only_when_it_reads_them():
    assert tools.renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}")
    assert not tools.renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not tools.renders_tools(None)
    assert not tools.renders_tools("{% if %}")


def test_assistant_calls_reach_the_template_with_arguments_as_objects():
    sent = json.dumps([{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}])
    assert tools.template_calls(sent) == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    ]
    for bad in ("{}", '[{"function": "add"}]', '[{"function": {"name": "f", "arguments": "{"}}]'):
        with pytest.raises(ValueError):
            tools.template_calls(bad)


def test_inline_tools_writes_definitions_calls_and_results_into_roles_every_template_knows():
    from specsplit.orchestrator.api.tool_parsers import HERMES
    from specsplit.orchestrator.api.tools import inline_tools

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+?"},
             {"role": "assistant", "content": "Adding.", "tool_calls": [call, call]},
             {"role": "tool", "tool_call_id": "c1", "content": "2"}, {"role": "tool", "tool_call_id": "c1", "content": "3"},
             {"role": "user", "content": "thanks"}]
    out = inline_tools(turns, [tool], HERMES)
    assert [t["role"] for t in out] == ["system", "user", "assistant", "user", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(tool) in out[0]["content"]
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert out[2]["content"] == f"Adding.\n{written}\n{written}"
    assert out[3]["content"] == "<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n</tool_response>"
    assert all(set(t) == {"role", "content"} for t in out)
    alone = inline_tools([{"role": "user", "content": "hi"}], [tool], HERMES)  # no system turn: one is added
    assert [t["role"] for t in alone] == ["system", "user"] and alone[0]["content"].startswith("# Tools")
    assert inline_tools(turns[3:4], [], HERMES) == [{"role": "user", "content": "<tool_response>\n2\n</tool_response>"}]
    assert turns[2]["tool_calls"] == [call, call]  # the request's turns are left as they were
