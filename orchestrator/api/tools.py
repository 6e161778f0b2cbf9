"""OpenAI tools on the chat API: checked, rendered by the chat template, a forced call made by the grammar.

``plan(tools, tool_choice, fmt, auto_enabled)`` checks a request's ``tools`` and ``tool_choice`` and says what
the generation does (docs/http-api.md, "Tool calls"):

    "none"                      tools rendered, plain text back
    "auto"                      tools rendered, free text, calls parsed out (``--enable-auto-tool-choice``)
    "required"                  one call of any tool, forced by a grammar
    {"type": "function", ...}   one call of that function, forced by a grammar

A forced call's grammar is the format's call text around the function's ``parameters`` schema
(``call_grammar``), sent as ``Grammar.ebnf``: the same masks as every structured output, so greedy output
under speculation is the target's own constrained greedy output. A chat template that renders no tools
gets them written into the conversation instead (``inline_tools``), so any model can be asked for a call.
No I/O.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from specsplit.orchestrator.api.tool_parsers import ToolCallFormat
from specsplit.orchestrator.decode.grammar import xgrammar_reason

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict  # a JSON schema of the arguments object
    strict: bool  # the schema's strict mode: properties it does not name are refused


@dataclass(frozen=True)
class ToolPlan:
    tools_json: str  # the tools as the chat template receives them
    choice: str  # "none", "auto", "required" or "function"
    grammar: str = ""  # the EBNF of the forced call; empty: free text

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"


def plan(tools: Any, tool_choice: Any, fmt: ToolCallFormat, auto_enabled: bool) -> ToolPlan:
    """What a request's tools and tool_choice make of the generation; ToolError for what is wrong with them."""
    functions = parse_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    tools_json = json.dumps(tools, ensure_ascii=False)
    if choice == "none":
        return ToolPlan(tools_json, "none")
    if choice == "auto":
        if not auto_enabled:
            raise ToolError(
                'tool_choice "auto" (the default when tools are sent) needs a server started with '
                '--enable-auto-tool-choice; send tool_choice "required", a named function, or "none"',
                "tool_choice",
            )
        return ToolPlan(tools_json, "auto")
    if choice == "required":
        return ToolPlan(tools_json, "required", call_grammar(functions, fmt))
    name = _named(choice)
    chosen = [f for f in functions if f.name == name]
    if not chosen:
        raise ToolError(
            f"tool_choice names the function {name!r}, which tools does not define "
            f"(it defines {', '.join(f.name for f in functions)})",
            "tool_choice",
        )
    return ToolPlan(tools_json, "function", call_grammar(chosen, fmt, [functions.index(chosen[0])]))


def parse_tools(tools: Any) -> list[Function]:
    """The functions of OpenAI's ``tools``: a non-empty list of ``{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}`` with distinct names."""
    if not isinstance(tools, list) or not tools:
        raise ToolError(
            f'tools must be a non-empty list of {{"type": "function", "function": {{...}}}}, '
            f"got {type(tools).__name__}",
            "tools",
        )
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        functions.append(_function(tool, f"tools[{i}]"))
    names = [f.name for f in functions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"tools define {', '.join(twice)} more than once; give each function one name", "tools")
    return functions


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(
            f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', where
        )
    spec = tool["function"]
    unknown = sorted(set(spec) - _FUNCTION_KEYS)
    if unknown or set(tool) - {"type", "function"}:
        raise ToolError(f"{where} has unknown fields {unknown or sorted(set(tool) - {'type', 'function'})}", where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(
            f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", f"{where}.function.name"
        )
    if not isinstance(spec.get("description", ""), str):
        raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(
            f"{where}.function.parameters must be a JSON schema object, got {type(parameters).__name__}",
            f"{where}.function.parameters",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be a boolean, got {strict!r}", f"{where}.function.strict")
    return Function(name, parameters, True if strict is None else strict)


def _named(choice: Any) -> str:
    """The function a ``{"type": "function", "function": {"name": ...}}`` tool_choice names."""
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}, '
            f"got {choice!r}"[:300],
            "tool_choice",
        )
    return function["name"]


def call_grammar(functions: Sequence[Function], fmt: ToolCallFormat, indices: Sequence[int] | None = None) -> str:
    """The EBNF of exactly one call, in ``fmt``, of one of ``functions`` with arguments that validate against its
    ``parameters``; ToolError naming the schema xgrammar cannot compile (``indices``: the functions' places in
    ``tools``, for the error)."""
    import xgrammar

    calls = []
    for i, function in enumerate(functions):
        try:
            arguments = xgrammar.Grammar.from_json_schema(
                json.dumps(function.parameters), any_whitespace=False, strict_mode=function.strict
            )
        except RuntimeError as exc:
            where = f"tools[{indices[i] if indices is not None else i}].function.parameters"
            raise ToolError(f"the JSON schema {where} does not compile: {xgrammar_reason(exc)}", where) from None
        calls.append(
            xgrammar.Grammar.concat(
                _literal(xgrammar, fmt.call_prefix(function.name)), arguments, _literal(xgrammar, fmt.call_suffix())
            )
        )
    grammar = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
    return str(grammar)


def _literal(xgrammar, text: str):
    return xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


@functools.lru_cache(maxsize=8)  # one template per server, asked for every request with tools
def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` it is given (transformers passes them as that variable; a
    template that never names it drops them without a word)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


TOOLS_INTRO = "You may call one or more functions to assist with the user query."


def inline_tools(turns: Sequence[dict], tools: Sequence[dict], fmt: ToolCallFormat) -> list[dict]:
    """The conversation for a chat template that renders no tools, in the roles every template knows, as the
    Hermes-style templates render it (docs/http-api.md, "Tool calls"): the tools' definitions appended to the
    system turn (one is added when there is none), each assistant call written in ``fmt``'s call text after the
    turn's content, and each run of tool results one user turn of results in ``fmt``'s wrapper (Hermes:
    ``<tool_response>`` blocks)."""
    out: list[dict] = []
    for i, turn in enumerate(turns):
        role, content = turn["role"], turn.get("content") or ""
        if role == "assistant" and turn.get("tool_calls"):
            calls = [fmt.call_prefix(call["function"]["name"]) + json.dumps(call["function"]["arguments"], ensure_ascii=False)
                     + fmt.call_suffix() for call in turn["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        elif role == "tool":
            block = f"{fmt.response[0]}{content}{fmt.response[1]}"
            if i and turns[i - 1]["role"] == "tool":  # a run of results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        example = fmt.call_prefix("<function-name>").replace('"<function-name>"', "<function-name>")
        block = (f"# Tools\n\n{TOOLS_INTRO}\n\nYou are provided with function signatures within <tools></tools> XML "
                 f"tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object with function name "
                 f"and arguments {fmt.where}:\n{example}<args-json-object>{fmt.call_suffix()}")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_calls(tool_calls_json: str) -> list[dict]:
    """An assistant turn's ``tool_calls`` (OpenAI's shape, arguments a JSON text) as chat templates read them:
    each ``function.arguments`` an object (as transformers documents and vLLM passes them). ValueError when the
    text is not a list of calls."""
    calls = json.loads(tool_calls_json)
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a JSON array")
    rendered = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError('each tool call must be {"id", "type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            arguments = json.loads(arguments or "{}")
        rendered.append({**call, "function": {**function, "arguments": arguments}})
    return rendered
