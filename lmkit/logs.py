"""Log set-up for every specsplit process: text or JSON lines, each tagged with the request it serves.

``REQUEST_ID`` holds the id of the generation the current asyncio task (and
the tasks it starts) works for; ``RequestIdFilter`` copies it onto every
record, so every line a generation logs, in any module, names its request.

    text: 2026-01-05 10:00:00,123 orchestrator INFO [req=chatcmpl-1f2e] finished: ...
    json: {"time": "2026-01-05T10:00:00.123+00:00", "level": "INFO", "component": "orchestrator",
           "logger": "specsplit.orchestrator.api.generation", "request_id": "chatcmpl-1f2e", "message": "finished: ..."}
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
from typing import Iterator

LOG_FORMATS = ("text", "json")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("specsplit_request_id", default="")


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tag the log lines of the current task (and the tasks it starts meanwhile) with ``request_id``."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        # An async generator closed from another task (at garbage collection) runs this in a
        # different context, where the token does not belong: that task's lines end anyway.
        with contextlib.suppress(ValueError):
            REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request_id = request_id
        record.request_tag = f"[req={request_id}] " if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, component, logger, request_id (when set), message, exception."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "component": self.component,
            "logger": record.name,
        }
        if getattr(record, "request_id", ""):
            line["request_id"] = record.request_id
        line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, component: str, log_format: str = "text") -> None:
    """Log to stderr at ``level`` in ``log_format`` (text or json), every line naming ``component``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(component))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {component} %(levelname)s %(request_tag)s%(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def add_log_flags(parser) -> None:
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text lines, or one JSON object per line (with request_id) for log collectors")
