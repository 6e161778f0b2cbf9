"""Reading tool calls out of a completion (the Hermes format): whole and streamed, whatever the chunking."""

from __future__ import annotations

import json
import random

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


def test_a_call_cut_before_its_name_is_content_and_after_it_a_call():
    cut = CALL[: CALL.index('"name"') + 4]
    assert HERMES.parse(cut) == (cut, [])
    assert HERMES.parse(CALL[:-3]) == (None, [WEATHER])


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


def test_a_call_cut_in_its_arguments_stands_with_what_was_written_whole_and_streamed():
    """A call whose name was written stays a call, whole or streamed (the reply's finish_reason says it was cut)."""
    cut = CALL[: CALL.index("Paris")]
    assert HERMES.parse(cut) == (None, [ParsedCall("get_weather", '{"city": "')])
    pieces = streamed(cut, 4)
    assert calls_of(pieces) == [ParsedCall("get_weather", '{"city": "')]
    assert not any(isinstance(p, str) for p in pieces)


def test_an_end_tag_inside_a_string_is_part_of_the_arguments_whole_and_streamed():
    text = '<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>b"}}\n</tool_call> after'
    call = ParsedCall("f", '{"s": "a</tool_call>b"}')
    assert HERMES.parse(text) == ("after", [call])
    assert calls_of(streamed(text, 3)) == [call]


def test_a_repeated_name_key_reads_the_same_whole_and_streamed():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}, "name": "g"}</tool_call>'
    assert HERMES.parse(text)[1] == calls_of(streamed(text, 1)) == [ParsedCall("f", '{"a": 1}')]


_ALPHABET = ['a', 'Z', ' ', '\n', '"', '\\', '{', '}', '[', ']', ':', ',', 'é', '日', '🙂', '</tool_call>', '<tool_call>',
             '<tool', '\\"', '\\u00e9', 'name', 'arguments']


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(0, 8)))


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        return _random_text(rng)
    if kind == 1:
        return rng.randrange(-1000, 1000)
    if kind == 2:
        return rng.choice([True, False, None, 1.5])
    if kind == 3:
        return _random_text(rng) + "</tool_call>" + _random_text(rng)
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {_random_text(rng): _random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _random_completion(rng: random.Random) -> tuple[str, list[tuple[str, dict]] | None]:
    """Content and calls as a model may write them: name first or not, arguments as an object or a JSON string,
    compact or spaced, sometimes broken, sometimes cut anywhere; with the calls it holds (name, arguments) when
    none was broken or cut."""
    parts, calls, intact = [], [], True
    for _ in range(rng.randrange(1, 4)):
        parts.append(_random_text(rng).replace("<tool_call>", ""))
        arguments = {_random_text(rng): _random_value(rng) for _ in range(rng.randrange(3))}
        name = rng.choice(["f", "get_weather", "日本", _random_text(rng)])
        body = {"name": name, "arguments": arguments}
        if rng.random() < 0.2:
            body = {"arguments": arguments, "name": name}
        if rng.random() < 0.1:
            body["arguments"] = json.dumps(arguments)
        written = json.dumps(body, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
        if rng.random() < 0.05:
            written, intact = written[:-1] + ', "name": "other"}', False
        if rng.random() < 0.05:
            written, intact = written[: rng.randrange(len(written))], False
        parts.append(f"<tool_call>{rng.choice(['', chr(10)])}{written}{rng.choice(['', chr(10)])}</tool_call>")
        calls.append((name, arguments))
    text = "".join(parts) + _random_text(rng).replace("<tool_call>", "")
    if rng.random() < 0.2:
        text, intact = text[: rng.randrange(len(text) + 1)], False
    return text, calls if intact else None


def test_a_whole_reply_and_the_same_reply_streamed_in_any_chunks_always_agree():
    """10,000 random completions, each streamed in random chunks: the calls and the content are the whole
    parse's; where no call was broken or cut, the calls are exactly those written."""
    rng = random.Random(7)
    checked = 0
    for _ in range(10_000):
        text, written = _random_completion(rng)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(6)))) if len(text) > 1 else []
        stream, pieces = HERMES.stream(), []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            pieces += stream.feed(text[start:end])
        pieces += stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str)).strip() or None
        whole = HERMES.parse(text)
        assert (content, calls_of(pieces)) == whole, text
        if written is not None:
            assert [(call.name, json.loads(call.arguments)) for call in whole[1]] == written, text
            checked += 1
    assert checked > 5_000
