"""Tool-call formats: the text a chat template's model writes for a call, and how a completion is read back.

A format gives the text around one call's arguments (``call_prefix`` + the arguments' JSON + ``call_suffix``),
from which ``orchestrator.tools`` builds the grammar of a forced call, and parses a completion into its
content and calls, whole (``parse``) or as it streams (``stream``). ``FORMATS`` is the registry that
``--tool-call-parser`` names; a convention is one ``ToolCallFormat`` and one line there.

Hermes (NousResearch's Hermes 2 Pro, Qwen 2.5 and 3, and the templates copied from them) writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    """One call read from the model's text."""

    name: str
    arguments: str  # a JSON object's text


Piece = str | ParsedCall  # streamed content text, or a whole call


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

    def read_block(self, block: str) -> ParsedCall | None:
        """The call a ``start ... end`` block holds; None when it holds none (bad JSON, no name, arguments not an
        object): the block is then content, as the model wrote it."""
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
        """A whole completion's content (the text outside the calls, stripped; None if empty) and its calls."""
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str)).strip()
        return content or None, [p for p in pieces if isinstance(p, ParsedCall)]


class CallStream:
    """Reads a completion as it streams: content is passed on as soon as it cannot begin a call, a call once its
    end arrives."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.buffer = ""  # text held back: a possible start of a call, or a call not yet ended
        self.inside = False  # the buffer begins with fmt.start

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
            else:
                at = self.buffer.find(self.fmt.end)
                if at < 0:
                    break
                block, self.buffer = self.buffer[: at + len(self.fmt.end)], self.buffer[at + len(self.fmt.end) :]
                self.inside = False
                call = self.fmt.read_block(block)
                pieces.append(call if call is not None else block)
        return _merged(pieces)

    def finish(self) -> list[Piece]:
        """What is held back when the text ends (a call never ended is content)."""
        rest, self.buffer, self.inside = self.buffer, "", False
        return [rest] if rest else []


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
