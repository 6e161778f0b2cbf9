"""Chat responses with tool calls: the model's text parsed into ``message.tool_calls`` (OpenAI's shape).

Whole: the calls in ``message.tool_calls``, the rest of the text in ``message.content`` (null when there is
none), ``finish_reason: "tool_calls"``. Streamed as OpenAI streams them: content deltas as the text comes,
held back only where it may begin a call; a call's first delta once its name is read,
``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}``, then its
arguments in pieces as they come, ``{"tool_calls": [{"index", "function": {"arguments"}}]}``.
"""

from __future__ import annotations

import secrets

from specsplit.orchestrator.api.openai_schema import ChatShape
from specsplit.orchestrator.api.tool_parsers import CallArguments, CallHead, ParsedCall, ToolCallFormat


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call(call: ParsedCall, index: int | None = None) -> dict:
    shown = {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return shown if index is None else {"index": index, **shown}


class ToolChatShape(ChatShape):
    """A chat response whose text may hold tool calls written in ``fmt``; each choice (sample) parses its own."""

    def __init__(self, response_id: str, model: str, logprobs: bool, fmt: ToolCallFormat) -> None:
        super().__init__(response_id, model, logprobs)
        self.fmt = fmt
        self.streams: dict = {}  # choice index -> its stream parser
        self.calls_sent: dict[int, int] = {}  # choice index -> calls sent so far

    def whole(self, choices, samples) -> dict:
        body = super().whole(choices, samples)
        for choice, made in zip(choices, body["choices"]):
            content, calls = self.fmt.parse(choice.text)
            if calls:
                made["message"] = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [tool_call(call) for call in calls],
                }
                made["finish_reason"] = _finish(choice.finish)
        return body

    def chunk(self, text: str, logprobs, finish: str | None, index: int = 0) -> dict | None:
        """The delta of a streamed event; None when it holds nothing to send yet (text that may begin a call)."""
        stream = self.streams.setdefault(index, self.fmt.stream())
        pieces = stream.feed(text) + (stream.finish() if finish else [])
        delta: dict = {}
        content = "".join(p for p in pieces if isinstance(p, str))
        if content:
            delta["content"] = content
        calls: list[dict] = []
        for piece in pieces:
            if isinstance(piece, CallHead):
                sent = self.calls_sent.get(index, 0)
                calls.append(tool_call(ParsedCall(piece.name, ""), sent))
                self.calls_sent[index] = sent + 1
            elif isinstance(piece, CallArguments):
                number = self.calls_sent[index] - 1
                if calls and calls[-1]["index"] == number:
                    calls[-1]["function"]["arguments"] += piece.text
                else:
                    calls.append({"index": number, "function": {"arguments": piece.text}})
        if calls:
            delta["tool_calls"] = calls
        if not delta and not finish and not (self.logprobs and logprobs):
            return None
        if finish and self.calls_sent.get(index):
            finish = _finish(finish)
        body = super().chunk("", logprobs, finish, index)
        body["choices"][0]["delta"] = delta
        return body


def _finish(finish: str) -> str:
    """A generation that ended by itself with calls ended to call them; one cut at max_tokens stays ``length``."""
    return "tool_calls" if finish == "stop" else finish
