"""Reading tool calls out of a completion (the Hermes format): whole and streamed, whatever the chunking."""

from __future__ import annotations

import json

import pytest

from specsplit.orchestrator.api.tool_parsers import FORMATS, HERMES, CallArguments, CallHead, ParsedCall

pytestmark = pytest.mark.unit

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 2}')


def test_the_registry_names_hermes():
    assert FORMATS["hermes"] is HERMES


def test_a_call_alone_has_no_content():
    assert HERMES.parse(CALL) == (None, [WEATHER])


def test_text_around_calls_is_content_and_every_call_is_read():
    second = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = HERMES.parse(f"Let me check. {CALL}\n{second} done")
    assert content == "Let me check. \n done"
    assert calls == [WEATHER, ParsedCall("add", '{"a": 1}')]


def test_text_without_calls_is_content_whole():
    assert HERMES.parse("The sky is blue <tool") == ("The sky is blue <tool", [])


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n["f"]\n</tool_call>',
    ],
)
def test_a_block_that_holds_no_call_stays_content(block):
    assert HERMES.parse(block) == (block, [])


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert HERMES.parse(text) == (None, [ParsedCall("f", '{"x": 1}')])


def test_a_call_cut_before_its_end_is_content():
    assert HERMES.parse(CALL[:-3]) == (CALL[:-3], [])


def test_the_prefix_and_suffix_around_arguments_make_a_call_the_parser_reads():
    arguments = {"city": "Zürich"}
    text = HERMES.call_prefix("get_weather") + json.dumps(arguments, ensure_ascii=False) + HERMES.call_suffix()
    assert HERMES.parse(text) == (None, [ParsedCall("get_weather", '{"city": "Zürich"}')])


def calls_of(pieces) -> list[ParsedCall]:
    """The calls a stream's pieces add up to."""
    calls: list[list[str]] = []
    for piece in pieces:
        if isinstance(piece, CallHead):
            calls.append([piece.name, ""])
        elif isinstance(piece, CallArguments):
            calls[-1][1] += piece.text
    return [ParsedCall(name, arguments) for name, arguments in calls]


def streamed(text: str, size: int) -> list:
    stream = HERMES.stream()
    pieces = []
    for start in range(0, len(text), size):
        pieces += stream.feed(text[start : start + size])
    return pieces + stream.finish()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_in_any_chunks_the_pieces_add_up_to_the_whole(size):
    text = f"Sure <b>. {CALL} after <tool"
    pieces = streamed(text, size)
    assert "".join(p for p in pieces if isinstance(p, str)) == "Sure <b>.  after <tool"
    assert calls_of(pieces) == [WEATHER] == HERMES.parse(text)[1]


def test_a_call_written_name_first_streams_its_arguments_as_they_come():
    stream = HERMES.stream()
    assert stream.feed('<tool_call>\n{"name": "get_weather", "arguments": ') == []  # the arguments not begun
    assert stream.feed('{"city": "Pa') == [CallHead("get_weather"), CallArguments('{"city": "Pa')]
    assert stream.feed('ris}", "days": [2') == [CallArguments('ris}", "days": [2')]  # a brace in a string
    assert stream.feed("]}}\n</tool_call> ok") == [CallArguments("]}"), " ok"]
    assert stream.finish() == []


def test_a_call_written_arguments_first_comes_whole_at_its_end():
    text = '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
    pieces = streamed(text, 1)
    assert pieces == [CallHead("add"), CallArguments('{"a": 1}')]
    assert HERMES.parse(text) == (None, [ParsedCall("add", '{"a": 1}')])


def test_arguments_keep_the_models_text_whole_and_streamed():
    text = '<tool_call>{"name":"f","arguments":{ "x" :1.50,"y":"\\u00e9"}}</tool_call>'
    call = ParsedCall("f", '{ "x" :1.50,"y":"\\u00e9"}')
    assert HERMES.parse(text) == (None, [call])
    assert calls_of(streamed(text, 2)) == [call]


def test_a_streamed_call_cut_in_its_arguments_stands_with_what_was_written():
    """Whole, a call never ended is content; streamed, a call whose name went out stays a call (the reply's
    finish_reason says it was cut)."""
    cut = CALL[: CALL.index("Paris")]
    assert HERMES.parse(cut) == (cut, [])
    pieces = streamed(cut, 4)
    assert calls_of(pieces) == [ParsedCall("get_weather", '{"city": "')]
    assert not any(isinstance(p, str) for p in pieces)


def test_content_streams_at_once_unless_it_may_begin_a_call():
    stream = HERMES.stream()
    assert stream.feed("Hello") == ["Hello"]
    assert stream.feed(" <tool_") == [" "]  # "<tool_" may be a call's start: held
    assert stream.feed("x") == ["<tool_x"]
    assert stream.feed("<tool_call>\n{") == []
    assert stream.feed('"name": "f"}</tool_call>') == [CallHead("f"), CallArguments("{}")]
    assert stream.finish() == []
