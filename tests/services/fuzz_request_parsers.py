"""An atheris (libFuzzer) target: the HTTP API's request parsers, from raw body bytes to a GenerateRequest.

Run as a script with libFuzzer's flags, e.g. ``python -m tests.services.fuzz_request_parsers
-max_total_time=20 -seed=1``. Every input must either parse or raise ``RequestError`` (a 400 in OpenAI's
shape); anything else is a crash that libFuzzer reports with the input that caused it.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["specsplit.orchestrator"]):
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.http_guard import parse_json
    from specsplit.orchestrator.api.openai_schema import (
        ChatCompletionRequest,
        CompletionRequest,
        RequestError,
        to_generate_request,
        validate,
    )

CONFIG = OrchestratorConfig("127.0.0.1:1")
# Seeds that reach past the JSON syntax: a chat request, a completion request, a chat request with tools.
SEEDS = (
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 5, "stop": ["x"]}',
    b'{"model": "m", "prompt": "hi", "max_tokens": 4, "k": 3, "logprobs": 2, "seed": 7, "temperature": 0.5}',
    b'{"model": "m", "messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}], "tool_choice": "required",'
    b' "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":'
    b' {"a": {"type": "integer", "maximum": 9}}}}}]}',
)


def parse(data: bytes) -> None:
    """One body through every parser the HTTP API runs before generating."""
    model_cls = ChatCompletionRequest if data[:1] in (b"{", b" ") and b"messages" in data else CompletionRequest
    try:
        message = to_generate_request(validate(model_cls, parse_json(data)), CONFIG, "fuzz")
        message.SerializeToString()  # every field fits its wire type
    except RequestError as exc:
        str(exc.body())  # the error body itself must be printable


def main() -> None:
    atheris.Setup(sys.argv, parse)
    atheris.Fuzz()  # exits the process: 0 when the time is up with no crash


if __name__ == "__main__":
    main()
