"""Tool-call formats: the text a chat template's model writes for a call, and how a completion is read back.

A format gives the text around one call's arguments (``call_prefix`` + the arguments' JSON + ``call_suffix``),
from which ``orchestrator.tools`` builds the grammar of a forced call, and parses a completion into its
content and calls as it streams (``stream``) or whole (``parse``: the same scanner over the whole text).
``FORMATS`` is the registry that ``--tool-call-parser`` names; a convention is one ``ToolCallFormat`` and one
line there.

Hermes (NousResearch's Hermes 2 Pro, Qwen 2.5 and 3, and the templates copied from them) writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Pure: no I/O.
"""

from __future__ import annotations

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
    """Calls written as ``start``, a JSON object ``{"name": ..., "arguments": {...}}``, ``end``; between them a
    newline each side."""

    name: str
    start: str
    end: str

    def call_prefix(self, function: str) -> str:
        """The text of a call to ``function`` before its arguments object."""
        return f'{self.start}\n{{"name": {json.dumps(function, ensure_ascii=False)}, "arguments": '

    def call_suffix(self) -> str:
        """The text of a call after its arguments object."""
        return f"}}\n{self.end}"

    def head(self, text: str) -> tuple[str, int] | None:
        """The name and the offset of the arguments object of a call that ``text`` begins, when it is written
        name first (``start {"name": "...", "arguments": {``, as the prefix above and every Hermes model
        writes it); None when ``text`` does not (yet) begin one so."""
        found = re.match(re.escape(self.start) + _NAME_THEN_ARGUMENTS, text)
        return (json.loads(found.group(1)), found.end()) if found else None

    def read_block(self, block: str) -> ParsedCall | None:
        """The call a ``start ... end`` block not written name first holds (``CallStream`` reads a name-first call
        as it streams, keeping the model's text of its arguments); None when it holds none (bad JSON, no name,
        arguments not an object): the block is then content, as the model wrote it. The arguments are written
        again as JSON."""
        body = block[len(self.start) : len(block) - len(self.end)].strip()
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", {})
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
        a block that holds no call is content; a call cut before its end is a call when its name was written
        first (with the arguments written so far), content otherwise."""
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


class CallStream:
    """Reads a completion as it streams: content is passed on as soon as it cannot begin a call. A call written
    name first (``ToolCallFormat.head``) is passed on as it comes: its ``CallHead`` once the name is read, its
    arguments in ``CallArguments`` pieces as they arrive, so a client sees the call grow (OpenAI's deltas); one
    written otherwise is passed on whole once its end arrives. A call whose name has been passed on stands: its
    arguments are what the model wrote, even if it stops before their end."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.buffer = ""  # text held back: a possible start of a call, or a call not yet ended
        self.inside = False  # the buffer begins with fmt.start
        self.arguments: _ObjectScan | None = None  # the arguments being streamed, once the head was read

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.fmt.start)
                if at < 0:
                    cut = len(self.buffer) - _held(self.buffer, self.fmt.start)
                    pieces.append(self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    break
                pieces.append(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at:], True
            elif self.arguments is None and (head := self.fmt.head(self.buffer)) is not None:
                pieces.append(CallHead(head[0]))
                self.arguments = _ObjectScan(head[1])
            elif self.arguments is not None:
                piece = self.arguments.scan(self.buffer)
                if piece:
                    pieces.append(CallArguments(piece))
                if self.arguments.end is None:
                    break
                at = self.buffer.find(self.fmt.end, self.arguments.end)
                if at < 0:
                    break
                self.buffer, self.inside, self.arguments = self.buffer[at + len(self.fmt.end) :], False, None
            else:
                at = self._block_end()
                if at < 0:
                    break
                block, self.buffer = self.buffer[: at + len(self.fmt.end)], self.buffer[at + len(self.fmt.end) :]
                self.inside = False
                call = self.fmt.read_block(block)
                pieces += [CallHead(call.name), CallArguments(call.arguments)] if call is not None else [block]
        return _merged(pieces)

    def _block_end(self) -> int:
        """Where the end tag of the call the buffer begins (not name first) is, or -1: after its JSON object when
        the call holds one (an end tag inside a string is the arguments' text), else its first end tag."""
        offset = len(self.fmt.start)
        offset += len(self.buffer[offset:]) - len(self.buffer[offset:].lstrip())
        if self.buffer[offset : offset + 1] != "{":
            return self.buffer.find(self.fmt.end) if offset < len(self.buffer) else -1
        end = _object_end(self.buffer, offset)
        return -1 if end is None else self.buffer.find(self.fmt.end, end)

    def finish(self) -> list[Piece]:
        """What is held back when the text ends: a call never ended is content, unless its head was passed on."""
        rest, streamed = self.buffer, self.arguments is not None
        self.buffer, self.inside, self.arguments = "", False, None
        return [rest] if rest and not streamed else []


_STRING = r'"(?:[^"\\]|\\.)*"'
_NAME_THEN_ARGUMENTS = rf'\s*\{{\s*"name"\s*:\s*({_STRING})\s*,\s*"arguments"\s*:\s*(?=\{{)'


class _ObjectScan:
    """Finds where a JSON object that begins at ``start`` ends, over text that grows: strings and escapes
    followed, braces counted; ``scan`` hands out the text not handed out before, up to the object's end."""

    def __init__(self, start: int) -> None:
        self.at = self.sent = start
        self.depth, self.in_string, self.escaped = 0, False, False
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


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
FORMATS: dict[str, ToolCallFormat] = {fmt.name: fmt for fmt in (HERMES,)}
