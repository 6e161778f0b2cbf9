"""The OpenAI Responses API (``POST /v1/responses``) over the chat completions path.

A Responses request is a conversation with another spelling: ``input`` (a string, or items: messages with text
parts, ``function_call`` and ``function_call_output``), ``instructions`` (a system turn before them),
``max_output_tokens``, function ``tools`` given flat (``{"type": "function", "name", "parameters"}``),
``tool_choice`` and ``text.format`` (text, json_object, json_schema). ``chat_body`` rewrites it as the chat
completion request it stands for, so validation, the chat template, tool calls, structured output, admission and
the speculative loop are the chat path's; ``ResponseView`` turns the chat answer back into a Response object
(``output``: a message with ``output_text``, then ``function_call`` items; ``usage`` with input and output tokens),
or the chat stream's chunks into the Responses stream's events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ... ``response.completed``).

Stateless: nothing is stored. ``store`` is accepted and every response says ``"store": false``;
``previous_response_id`` and ``background`` are refused (send the conversation as input), as is any tool but a
function.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import Field

from specsplit.orchestrator.api.openai_schema import RequestError, Speculation, Strict

# The chat request's extensions a Responses request may carry, passed as they are.
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k", "repetition_penalty", "min_tokens",
           "ignore_eos", "k", "speculation", "drafter", "adaptive_k", "overlap")


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None  # accepted for reasoning models' clients; nothing is reasoned apart
    # extensions, as on the chat endpoint
    seed: int | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    k: int | None = None
    speculation: Speculation | None = None
    drafter: str | None = None
    adaptive_k: bool | None = None
    overlap: bool | None = None


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completion request (a JSON body) that ``req`` stands for; a RequestError names what cannot be."""
    if req.previous_response_id is not None:
        raise RequestError("specsplit stores no responses, so previous_response_id cannot be followed: send the "
                           "conversation so far as input", "previous_response_id")
    if req.background:
        raise RequestError("background responses need stored responses, which specsplit does not keep: send "
                           "background false", "background")
    if req.include:
        raise RequestError(f"include {req.include} is not supported: send no include", "include")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in _PASSED:
        value = getattr(req, name)
        if value is not None:
            body[name] = value.model_dump(exclude_none=True) if isinstance(value, Speculation) else value
    if req.tools is not None:
        body["tools"] = [_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None and (response_format := _response_format(req.text)) is not None:
        body["response_format"] = response_format
    return body


def _messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat messages: function calls join the assistant turn before them, outputs become tool turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise RequestError(f"input[{i}].role must be system, developer, user or assistant, got {role!r}",
                                   f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the turn's text, then its calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": _text(output, f"input[{i}].output")})
        else:
            raise RequestError(f"input[{i}] is a {kind!r} item; specsplit takes message, function_call and "
                               "function_call_output items", f"input[{i}].type")
    return messages


def _field(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"input[{i}].{name} must be a string, got {value!r}", f"input[{i}].{name}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                shown = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}[{j}] is {shown!r}; specsplit reads text parts (input_text, "
                                   "output_text) only", where)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where} must be a string or a list of text parts", where)


def _tool(i: int, tool: dict) -> dict:
    """A flat Responses function tool as the chat API's ``{"type": "function", "function": {...}}``."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise RequestError(f"tools[{i}] is a {tool.get('type')!r} tool; specsplit runs function tools "
                           "({\"type\": \"function\", \"name\", \"parameters\"}) only", f"tools[{i}]")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice must be auto, none, required or {{\"type\": \"function\", \"name\"}}, got "
                       f"{choice!r}", "tool_choice")


def _response_format(text: dict) -> dict | None:
    """``text.format`` as the chat API's ``response_format`` (None: free text)."""
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                       "text.format")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseView:
    """One request's Response object, whole (``whole``) or as stream events (``start``, ``events``, ``finish``)."""

    def __init__(self, response_id: str, req: ResponsesRequest) -> None:
        self.id, self.req = response_id, req
        self.created = int(time.time())
        self.sequence = 0
        self.output: list[dict] = []  # the items so far, each as the stream left it
        self.message: dict | None = None  # the open message item (streaming)
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item (streaming)
        self.usage: dict | None = None
        self.incomplete = False

    def response(self, status: str) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": req.model, "output": self.output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "previous_response_id": None, "metadata": req.metadata or {}, "user": req.user, "reasoning": req.reasoning,
            "usage": self.usage,
        }

    # -- whole ------------------------------------------------------------------------------------------------
    def whole(self, chat: dict) -> dict:
        """The Response of a whole chat completion."""
        choice = chat["choices"][0]
        message = choice["message"]
        if message.get("content"):
            self.output.append(self._message_item(message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            self.output.append(self._call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                               "completed"))
        self.usage = _usage(chat["usage"])
        return self.response("incomplete" if choice["finish_reason"] == "length" else "completed")

    # -- streamed ---------------------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def events(self, chunk: dict) -> list[dict]:
        """The events of one chat stream chunk (a text delta, tool-call deltas, a finish, the usage, an error)."""
        if "error" in chunk:
            error = chunk["error"]
            return [self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))]
        if chunk.get("usage") is not None:
            self.usage = _usage(chunk["usage"])
        out: list[dict] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.incomplete = choice["finish_reason"] == "length"
                out += self._close()
        return out

    def finish(self) -> list[dict]:
        """The last event, once the chat stream has ended (its usage read)."""
        status = "incomplete" if self.incomplete else "completed"
        return [self._event(f"response.{status}", response=self.response(status))]

    def _text_delta(self, text: str) -> list[dict]:
        out = []
        if self.message is None:
            self.message = self._message_item("", "in_progress")
            self.message["content"] = []
            self.output.append(self.message)
            index = len(self.output) - 1
            out.append(self._event("response.output_item.added", output_index=index, item=_copy(self.message)))
            self.message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            out.append(self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                   content_index=0, part=_copy(self.message["content"][0])))
        index = self.output.index(self.message)
        self.message["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.message["id"], output_index=index,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _call_delta(self, call: dict) -> list[dict]:
        out = []
        item = self.calls.get(call["index"])
        if item is None:
            out += self._close_message()
            function = call.get("function", {})
            item = self._call_item(call["id"], function.get("name", ""), "", "in_progress")
            self.calls[call["index"]] = item
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item)))
        arguments = call.get("function", {}).get("arguments")
        if arguments:
            item["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=arguments))
        return out

    def _close_message(self) -> list[dict]:
        if self.message is None or self.message["status"] == "completed":
            return []
        index, part = self.output.index(self.message), self.message["content"][0]
        self.message["status"] = "completed"
        return [
            self._event("response.output_text.done", item_id=self.message["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=self.message["id"], output_index=index, content_index=0,
                        part=_copy(part)),
            self._event("response.output_item.done", output_index=index, item=_copy(self.message)),
        ]

    def _close(self) -> list[dict]:
        out = self._close_message()
        for item in self.calls.values():
            if item["status"] != "completed":
                item["status"] = "completed"
                index = self.output.index(item)
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                       name=item["name"], arguments=item["arguments"]))
                out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    @staticmethod
    def _message_item(text: str, status: str) -> dict:
        return {"id": _item_id("msg"), "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"id": _item_id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
                "arguments": arguments}


def _copy(item: dict) -> dict:
    """A snapshot of an item as an event carries it (the item itself keeps changing)."""
    return {key: ([dict(part) for part in value] if isinstance(value, list) else value) for key, value in item.items()}


def _usage(chat: dict) -> dict:
    """The chat usage as the Responses API counts it (specsplit's speculative stats kept)."""
    usage = {
        "input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }
    if "speculative" in chat:
        usage["speculative"] = chat["speculative"]
    return usage
