"""Tool-call formats: the text a chat template's model writes for a call, and how a completion is read back.

A format gives the text around one call's arguments (``call_prefix`` + the arguments' JSON + ``call_suffix``),
from which ``orchestrator.api.tools`` builds the grammar of a forced call, and parses a completion into its
content and calls as it streams (``stream``) or whole (``parse``: the same scanner over the whole text).
``FORMATS`` is the registry that ``--tool-call-parser`` names, with vLLM's names; a convention is one
``ToolCallFormat`` and one line there. Each writes a run of calls, each call a JSON object
``{"name": ..., "arguments": {...}}``, after a start marker:

    hermes        NousResearch's Hermes 2 Pro, Qwen 2.5 and 3, and the templates copied from them: one call a run
                      <tool_call>
                      {"name": "get_weather", "arguments": {"city": "Paris"}}
                      </tool_call>
    llama3_json   Llama 3.1 to 3.3's JSON tool calling: the reply is the calls, "parameters" for the arguments,
                  several joined by "; ", after <|python_tag|> or with none
                      {"name": "get_weather", "parameters": {"city": "Paris"}}
    mistral       Mistral's instruct models (v3 tokenizers and after): the calls as one JSON list
                      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

Pure: no I/O.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    """One call read from the model's text."""

    name: str
    arguments: str  # a JSON object's text: as the model wrote it, or re-written when it wrote a JSON string


@dataclass(frozen=True)
class CallHead:
    """A streamed call begins: its name is known; its arguments follow in ``CallArguments`` pieces."""

    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of the arguments text of the call last begun."""

    text: str


Piece = str | CallHead | CallArguments  # streamed content text, or a call's start or a piece of its arguments


@dataclass(frozen=True)
class ToolCallFormat:
    """Calls written as a run: ``start``, then ``opening``, then call objects ``{"name": ..., KEY: {...}}`` (KEY one
    of ``keys``, the first the one written) joined by ``separator``, then ``end``; with no separator, one call a
    run. ``end`` empty: the run lasts to the text's end. ``leading``: a run may also begin without ``start``, where
    the text begins with an object (after spaces). ``pad`` goes each side of a written call; ``where`` says, for a
    template that renders no tools, how calls are written; ``response`` wraps a tool's result there."""

    name: str
    start: str
    end: str
    opening: str = ""
    separator: str = ""
    keys: tuple[str, ...] = ("arguments",)
    leading: bool = False
    pad: str = ""
    where: str = ""
    response: tuple[str, str] = ("", "")

    def call_prefix(self, function: str) -> str:
        """The text of a call to ``function`` before its arguments object (a leading format's without its start,
        as Llama 3's templates ask for calls)."""
        start = "" if self.leading else self.start
        return f'{start}{self.opening}{self.pad}{{"name": {json.dumps(function, ensure_ascii=False)}, ' \
               f'"{self.keys[0]}": '

    def call_suffix(self) -> str:
        """The text of a call after its arguments object."""
        return f"}}{self.pad}{self.end}"

    def head(self, text: str) -> tuple[str, int] | None:
        """The name and the offset of the arguments object of a call object that ``text`` begins, when it is
        written name first (``{"name": "...", "arguments": {``, as the prefix above and every model of these
        formats writes it); None when ``text`` does not (yet) begin one so."""
        found = _head_pattern(self.keys).match(text)
        return (json.loads(found.group(1)), found.end()) if found else None

    def read_object(self, text: str) -> ParsedCall | None:
        """The call a whole call object not written name first holds (``CallStream`` reads a name-first call as it
        streams, keeping the model's text of its arguments); None when it holds none (bad JSON, no name,
        arguments not an object). The arguments are written again as JSON."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = next((value[key] for key in self.keys if key in value), {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def stream(self) -> "CallStream":
        return CallStream(self)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole completion's content (the text outside the calls, stripped; None if empty) and its calls, read
        by the one scanner a stream reads with (``CallStream``), so a whole reply and a streamed one always agree:
        a run that holds no call is content; a call cut before its end is a call when its name was written first
        (with the arguments written so far), content otherwise."""
        stream = self.stream()
        content, calls = [], []
        for piece in stream.feed(text) + stream.finish():
            if isinstance(piece, str):
                content.append(piece)
            elif isinstance(piece, CallHead):
                calls.append([piece.name, ""])
            else:
                calls[-1][1] += piece.text
        joined = "".join(content).strip()
        return joined or None, [ParsedCall(name, arguments) for name, arguments in calls]


_OUTSIDE, _RUN, _ARGUMENTS, _TAIL, _AFTER, _CONTENT, _DROP = range(7)


class CallStream:
    """Reads a completion as it streams: content is passed on as soon as it cannot begin a call. A call written
    name first (``ToolCallFormat.head``) is passed on as it comes: its ``CallHead`` once the name is read, its
    arguments in ``CallArguments`` pieces as they arrive, so a client sees the call grow (OpenAI's deltas); one
    written otherwise is passed on whole once its object ends. A call whose name has been passed on stands: its
    arguments are what the model wrote, even if it stops before their end. A run whose text is not a call is
    content up to the run's end, as the model wrote it."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.buffer = ""  # text held back: a possible start of a run, or a part of a run not yet read
        self.state = _OUTSIDE
        self.raw = ""  # the run's text read before the buffer and not passed on: content if the run holds no call
        self.opened = False  # the run's opening was read
        self.begun = False  # text other than spaces was passed on or read (a leading run can no longer begin)
        self.arguments: _ObjectScan | None = None  # the arguments being streamed, once the head was read
        self.call: _ObjectScan | None = None  # the call object they are in

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return _merged(pieces)

    def _step(self, pieces: list[Piece]) -> bool:
        """Read what the buffer allows in the current state; False when it needs more text."""
        fmt, buffer = self.fmt, self.buffer
        if self.state == _OUTSIDE:
            spaces = len(buffer) - len(buffer.lstrip())
            if fmt.leading and not self.begun and buffer[spaces:spaces + 1] == "{":
                self._enter(pieces, spaces, spaces)
                return True
            if fmt.leading and not self.begun and spaces == len(buffer):
                return False  # spaces alone: a leading run may follow
            self.begun = True
            at = buffer.find(fmt.start)
            if at < 0:
                cut = len(buffer) - _held(buffer, fmt.start)
                pieces.append(buffer[:cut])
                self.buffer = buffer[cut:]
                return False
            self._enter(pieces, at, at + len(fmt.start))
            return True
        if self.state == _RUN:
            spaces = len(buffer) - len(buffer.lstrip())
            rest = buffer[spaces:]
            if not rest:
                return False
            if not self.opened:
                if fmt.opening.startswith(rest[: len(fmt.opening)]) and len(rest) < len(fmt.opening):
                    return False
                if not rest.startswith(fmt.opening):
                    self.state = _CONTENT
                    return True
                self._read(spaces + len(fmt.opening))
                self.opened = True
                return True
            if not rest.startswith("{"):
                self.state = _CONTENT
                return True
            head = fmt.head(rest)
            if head is not None:
                self._read(spaces)
                pieces.append(CallHead(head[0]))
                self.raw = ""
                self.arguments = _ObjectScan(head[1])
                self.state = _ARGUMENTS
                return True
            end = _object_end(rest, 0)
            if end is None:
                return False
            call = fmt.read_object(rest[:end])
            if call is None:
                self.state = _CONTENT
                return True
            pieces += [CallHead(call.name), CallArguments(call.arguments)]
            self.buffer, self.raw, self.state = rest[end:], "", _AFTER
            return True
        if self.state == _ARGUMENTS:
            piece = self.arguments.scan(buffer)
            if piece:
                pieces.append(CallArguments(piece))
            if self.arguments.end is None:
                return False
            self.call, self.state = _ObjectScan(self.arguments.end, depth=1), _TAIL  # inside the call object
            return True
        if self.state == _TAIL:  # the call object's other keys, up to its end, or the run's end where it never ends
            self.call.scan(buffer)
            closed = buffer.find(fmt.end, self.arguments.end) if fmt.end else -1
            if self.call.end is not None and (closed < 0 or self.call.end <= closed):
                self.buffer, self.state = buffer[self.call.end:], _AFTER
            elif closed >= 0:
                self.buffer, self.state = buffer[closed + len(fmt.end):], _OUTSIDE
            else:
                return False
            self.arguments = self.call = None
            return True
        if self.state == _AFTER:
            rest = buffer.lstrip()
            for mark, state in ((fmt.separator, _RUN), (fmt.end, _OUTSIDE)):
                if mark and rest.startswith(mark):
                    self.buffer, self.state = rest[len(mark):], state
                    return True
            if not rest or any(mark.startswith(rest) for mark in (fmt.separator, fmt.end) if mark):
                return False
            self.state = _DROP  # what follows a call in its run, neither another call nor the run's end
            return True
        if self.state in (_CONTENT, _DROP):  # to the run's end: content as written, or dropped after a call
            at = buffer.find(fmt.end) if fmt.end else -1
            if at < 0:
                return False
            if self.state == _CONTENT:
                pieces.append(self.raw + buffer[: at + len(fmt.end)])
            self.buffer, self.raw, self.state = buffer[at + len(fmt.end):], "", _OUTSIDE
            return True
        raise AssertionError(self.state)

    def _enter(self, pieces: list[Piece], content: int, run: int) -> None:
        """A run begins: the buffer's first ``content`` characters are content, those up to ``run`` its start."""
        pieces.append(self.buffer[:content])
        self.raw, self.buffer = self.buffer[content:run], self.buffer[run:]
        self.state, self.opened, self.begun = _RUN, not self.fmt.opening, True

    def _read(self, length: int) -> None:
        """The buffer's first ``length`` characters belong to the run."""
        self.raw += self.buffer[:length]
        self.buffer = self.buffer[length:]

    def finish(self) -> list[Piece]:
        """What is held back when the text ends: a run never ended is content, unless a call of it was passed on."""
        held = self.raw + self.buffer if self.state in (_OUTSIDE, _RUN, _CONTENT) else ""
        self.__init__(self.fmt)
        return [held] if held else []


_STRING = r'"(?:[^"\\]|\\.)*"'


@functools.cache
def _head_pattern(keys: tuple[str, ...]) -> re.Pattern:
    """A call object written name first, up to its arguments object (which the lookahead sees begin)."""
    key = "|".join(re.escape(k) for k in keys)
    return re.compile(rf'\{{\s*"name"\s*:\s*({_STRING})\s*,\s*"(?:{key})"\s*:\s*(?=\{{)')


class _ObjectScan:
    """Finds where a JSON object that begins at ``start`` ends, over text that grows: strings and escapes
    followed, braces counted; ``scan`` hands out the text not handed out before, up to the object's end."""

    def __init__(self, start: int, depth: int = 0) -> None:
        self.at = self.sent = start
        self.depth, self.in_string, self.escaped = depth, False, False  # depth: the brackets open before start
        self.end: int | None = None

    def scan(self, text: str) -> str:
        while self.end is None and self.at < len(text):
            char = text[self.at]
            self.at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.at
        piece, self.sent = text[self.sent : self.at], self.at
        return piece


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object that begins at ``start`` of ``text`` ends; None when it does not end there."""
    scan = _ObjectScan(start)
    scan.scan(text)
    return scan.end


def _held(text: str, start: str) -> int:
    """The length of the longest end of ``text`` that begins ``start`` (it may be a call's first characters)."""
    for length in range(min(len(text), len(start) - 1), 0, -1):
        if start.startswith(text[-length:]):
            return length
    return 0


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content joined, empty content dropped."""
    merged: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += piece
                continue
        merged.append(piece)
    return merged


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", pad="\n",
                        where="within <tool_call></tool_call> XML tags", response=("<tool_response>\n",
                                                                                   "\n</tool_response>"))
LLAMA3_JSON = ToolCallFormat("llama3_json", "<|python_tag|>", "", separator=";", keys=("parameters", "arguments"),
                             leading=True, where="as the whole reply, several separated by ;")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "]", opening="[", separator=",",
                         where="as a JSON list after [TOOL_CALLS]", response=("[TOOL_RESULTS]", "[/TOOL_RESULTS]"))
FORMATS: dict[str, ToolCallFormat] = {fmt.name: fmt for fmt in (HERMES, LLAMA3_JSON, MISTRAL)}
