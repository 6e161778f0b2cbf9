"""Reading tool calls out of a completion (Hermes, Llama 3's JSON, Mistral's list): whole and streamed, whatever
the chunking."""

from __future__ import annotations

import json
import random

import pytest

from specsplit.orchestrator.api.tool_parsers import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallArguments,
    CallHead,
    ParsedCall,
    ToolCallFormat,
)

pytestmark = pytest.mark.unit

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 2}')


def test_the_registry_names_the_formats_as_vllm_does():
    assert FORMATS == {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL}


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


def streamed(text: str, size: int, fmt: ToolCallFormat = HERMES) -> list:
    stream = fmt.stream()
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


def _random_object(rng: random.Random, fmt: ToolCallFormat) -> tuple[str, str, dict, bool]:
    """One call object as a model may write it: name first or not, arguments as an object or a JSON string,
    compact or spaced, sometimes broken (a second name), sometimes cut; (text, name, arguments, intact)."""
    arguments = {_random_text(rng): _random_value(rng) for _ in range(rng.randrange(3))}
    name = rng.choice(["f", "get_weather", "日本", _random_text(rng)])
    key = rng.choice(fmt.keys)
    body = {"name": name, key: arguments}
    if rng.random() < 0.2:
        body = {key: arguments, "name": name}
    if rng.random() < 0.1:
        body[key] = json.dumps(arguments)
    if rng.random() < 0.1:
        body["id"] = "call9"  # a key after the arguments, as Mistral's templates write them
    written = json.dumps(body, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
    intact = True
    if rng.random() < 0.05:
        written, intact = written[:-1] + ', "name": "other"}', False
    if rng.random() < 0.05:
        written, intact = written[: rng.randrange(len(written))], False
    return written, name, arguments, intact


def _random_completion(rng: random.Random, fmt: ToolCallFormat = HERMES) -> tuple[str, list[tuple[str, dict]] | None]:
    """Content and runs of calls in ``fmt`` as a model may write them, sometimes cut anywhere; with the calls it
    holds (name, arguments) when none was broken or cut."""
    def text() -> str:
        return _random_text(rng).replace(fmt.start, "")

    parts, calls, intact = [], [], True
    runs = rng.randrange(1, 4) if fmt.end and not fmt.separator else 1
    for _ in range(runs):
        if not fmt.leading:
            parts.append(text())
        objects = []
        for _ in range(rng.randrange(1, 3) if fmt.separator else 1):
            written, name, arguments, whole = _random_object(rng, fmt)
            objects.append(written)
            calls.append((name, arguments))
            intact = intact and whole
        space = rng.choice(["", "\n", " "])
        start = fmt.start if not fmt.leading or rng.random() < 0.3 else ""
        parts.append(f"{start}{fmt.opening}{space}{(fmt.separator + space).join(objects)}{space}{fmt.end}")
    text_after = text()
    if fmt.end or not text_after.strip():  # a run to the text's end takes what follows it; content goes before
        parts.append(text_after)
    completion = "".join(parts)
    if rng.random() < 0.2:
        completion, intact = completion[: rng.randrange(len(completion) + 1)], False
    return completion, calls if intact else None


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda fmt: fmt.name)
def test_a_whole_reply_and_the_same_reply_streamed_in_any_chunks_always_agree(fmt):
    """10,000 random completions, each streamed in random chunks: the calls and the content are the whole
    parse's; where no call was broken or cut, the calls are exactly those written."""
    rng = random.Random(7)
    checked = 0
    for _ in range(10_000):
        text, written = _random_completion(rng, fmt)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(6)))) if len(text) > 1 else []
        stream, pieces = fmt.stream(), []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            pieces += stream.feed(text[start:end])
        pieces += stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str)).strip() or None
        whole = fmt.parse(text)
        assert (content, calls_of(pieces)) == whole, text
        if written is not None:
            assert [(call.name, json.loads(call.arguments)) for call in whole[1]] == written, text
            checked += 1
    assert checked > 5_000


WEATHER_ARGS = '{"city": "Paris", "days": 2}'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda fmt: fmt.name)
def test_each_formats_prefix_and_suffix_make_a_call_its_parser_reads(fmt):
    text = fmt.call_prefix("get_weather") + WEATHER_ARGS + fmt.call_suffix()
    assert fmt.parse(text) == (None, [WEATHER])
    assert calls_of(streamed(text, 1, fmt)) == [WEATHER]


def test_llama3_calls_are_the_reply_with_or_without_the_python_tag_and_joined_by_semicolons():
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    two = '{"name": "add", "arguments": {"a": 1}}'
    assert LLAMA3_JSON.call_prefix("f") == '{"name": "f", "parameters": '
    assert LLAMA3_JSON.parse(one) == (None, [WEATHER])
    assert LLAMA3_JSON.parse(f"  <|python_tag|>{one}; {two}") == (None, [WEATHER, ParsedCall("add", '{"a": 1}')])
    assert LLAMA3_JSON.parse(f"\n{one};{two}") == (None, [WEATHER, ParsedCall("add", '{"a": 1}')])
    # text first: no call (a run without the tag only begins the reply); an object that is not a call: content
    assert LLAMA3_JSON.parse(f"Sure: {one}") == (f"Sure: {one}", [])
    assert LLAMA3_JSON.parse('{"answer": 42}') == ('{"answer": 42}', [])
    pieces = streamed(f"{one}; {two}", 3, LLAMA3_JSON)
    assert pieces[0] == CallHead("get_weather") and calls_of(pieces) == [WEATHER, ParsedCall("add", '{"a": 1}')]


def test_mistral_calls_are_one_list_after_its_marker_keys_after_the_arguments_skipped():
    text = ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, '
            '"id": "a1b2c3d4e"}, {"name": "add", "arguments": {"a": 1}}]')
    assert MISTRAL.call_prefix("f") == '[TOOL_CALLS][{"name": "f", "arguments": '
    assert MISTRAL.parse(text) == ("Checking.", [WEATHER, ParsedCall("add", '{"a": 1}')])
    stream = MISTRAL.stream()
    assert stream.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": ') == [
        CallHead("get_weather"), CallArguments('{"city": ')]
    assert stream.feed('"Paris", "days": 2}}, {"arguments": {"a": 1}, "name": "add"}]') == [
        CallArguments('"Paris", "days": 2}'), CallHead("add"), CallArguments('{"a": 1}')]
    assert stream.finish() == []
    assert MISTRAL.parse("[TOOL_CALLS] not a list") == ("[TOOL_CALLS] not a list", [])
