"""The HTTP API's defences against clients that send too much, too slowly, or never read.

``config.HttpLimits`` holds the bounds (``specsplit serve --http-*`` flags). What each guards:

* a request's headers must arrive within ``header_timeout_s`` of the connection (or of the previous
  response): ``guarded_protocol`` closes a connection that trickles them (slowloris);
* its body must arrive within ``body_timeout_s`` (408) and is counted as it streams in, so a chunked
  upload is refused at ``max_body_bytes`` (413) without reading the rest;
* a response whose ``send`` stays blocked ``stalled_send_s`` (a client that stops reading) is abandoned,
  which frees its generation slot (``StalledSendGuard``);
* ``trusted_hosts`` (when given) bound the ``Host`` header; POST bodies must be ``application/json``.

Each refusal is counted in ``specsplit_refused_requests_total`` by reason.
"""

from __future__ import annotations

import asyncio
import json
import re

import h11
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from specsplit.orchestrator.api import metrics
from specsplit.orchestrator.api.config import HttpLimits
from specsplit.orchestrator.api.openai_schema import RequestError


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request body, counted while it streams in: 413 at ``max_body_bytes``, 408 past ``body_timeout_s``."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limits.max_body_bytes:
        raise _too_large(f"the request body is {length} bytes; at most {limits.max_body_bytes} are accepted")
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise _too_large(f"the request body is over {limits.max_body_bytes} bytes, the most accepted")
    except TimeoutError:
        metrics.REFUSED.inc(reason="body_timeout")
        raise RequestError(
            f"the request body did not arrive within {limits.body_timeout_s:g} s", status=408, code="request_timeout"
        ) from None
    return bytes(body)


def _too_large(message: str) -> RequestError:
    metrics.REFUSED.inc(reason="body_too_large")
    return RequestError(message, status=413, code="request_too_large")


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON: a browser's cross-site ``text/plain`` POST is never parsed."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        metrics.REFUSED.inc(reason="media_type")
        raise RequestError(
            f"Content-Type must be application/json, got {media_type or 'none'!r}",
            status=415,
            code="unsupported_media_type",
        )


def check_host(request: Request, trusted: tuple[str, ...]) -> None:
    """400 when ``trusted`` is set and the Host header (with or without its port) is not in it."""
    if not trusted:
        return
    host = request.headers.get("host", "")
    if host not in trusted and host.rpartition(":")[0] not in trusted:
        metrics.REFUSED.inc(reason="untrusted_host")
        raise RequestError(
            f"the Host header {host[:100]!r} is not one this server answers to", status=400, code="invalid_host"
        )


class StalledSendGuard:
    """ASGI middleware: a response write blocked longer than ``stalled_send_s`` abandons the response.

    The app's ``send`` then raises, which ends the streaming body (and the generation behind it, closing
    its sessions and freeing its slot); the connection is closed unanswered.
    """

    def __init__(self, app, stalled_send_s: float) -> None:
        self.app = app
        self.stalled_send_s = stalled_send_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def bounded_send(message) -> None:
            try:
                async with asyncio.timeout(self.stalled_send_s):
                    await send(message)
            except TimeoutError:
                metrics.REFUSED.inc(reason="stalled_send")
                raise SendStalled(f"the client read nothing for {self.stalled_send_s:g} s") from None

        try:
            await self.app(scope, receive, bounded_send)
        except SendStalled:
            pass  # uvicorn closes a connection whose response the app left unfinished


class SendStalled(Exception):
    """The client stopped reading its response."""


def guarded_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take over ``header_timeout_s``.

    uvicorn bounds only the idle time between kept-alive requests, and a byte of data resets even that;
    this bounds the time from the connection (or the previous response) to the end of the headers.
    """

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()  # the headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                metrics.REFUSED.inc(reason="header_timeout")
                self.transport.close()

    return GuardedH11Protocol


def parse_json(body: bytes):
    """A request body as JSON; every way it can be malformed is a 400 that says what is wrong.

    Besides syntax: nesting deeper than the parser's recursion bound, an integer too long to convert
    (more than 4,300 digits), and a lone UTF-16 surrogate escape (``"\\ud800"``), which no UTF-8 text
    can carry.
    """
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("the request body nests arrays or objects too deeply to be a request") from None
    except ValueError as exc:  # int("9" * 5000): the interpreter's digit limit
        raise RequestError(f"the request body holds a number too long to read: {exc}") from None
    if _SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(value)
    return value


# A \uD800-\uDFFF escape: the only way a lone surrogate gets into parsed JSON (UTF-8 input cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    f"a string in the request holds a lone UTF-16 surrogate ({item[:40]!r}); send valid Unicode "
                    "(a surrogate escape must be half of a pair)"
                ) from None
