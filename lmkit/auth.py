"""Who may call a draft or target service: bearer tokens read from a file, and client certificates' names.

A token file (a Kubernetes Secret mount) holds one token per line, optionally
named, ``NAME TOKEN``; blank lines and ``#`` comments are skipped. The file is
re-read when it changes (its inode, size or mtime) and at least once a second
(a rewrite within the file system's timestamp tick keeps all three), so a token
rotates without a restart; a token the new file no longer holds stays valid for
``grace_s`` (``--auth-token-grace-s``) so clients that have not yet seen the new
file keep working. A client sends the first token of its own file.

A caller's identity, which per-caller quotas count against: the token's name
when the file names it, else the client certificate's allowed SAN (mTLS), else
``token:<8 hex digits of the token's SHA-256>``, else ``anonymous`` (no check
configured).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("specsplit_caller", default=ANONYMOUS)


def current_caller() -> str:
    """The identity of the caller whose RPC is running (set by the service's caller check)."""
    return CALLER.get()


def _parse(text: str, path: str) -> dict[str, str]:
    """token -> caller name, in file order."""
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) > 2:
            raise ValueError(f"{path}:{number}: expected `TOKEN` or `NAME TOKEN`, got {len(fields)} fields")
        token = fields[-1]
        tokens[token] = fields[0] if len(fields) == 2 else f"token:{hashlib.sha256(token.encode()).hexdigest()[:8]}"
    if not tokens:
        raise ValueError(f"{path} holds no token; write one per line (`TOKEN` or `NAME TOKEN`)")
    return tokens


class Tokens:
    """The tokens a service accepts (or a client sends), from a file kept fresh, or fixed (an environment variable)."""

    def __init__(self, path: str = "", fixed: str = "", grace_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if bool(path) == bool(fixed):
            raise ValueError("Tokens takes a file or a fixed token")
        if grace_s < 0:
            raise ValueError(f"--auth-token-grace-s must be >= 0, got {grace_s}")
        self.path = path
        self._grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._text = ""
        self._read_at = clock()
        self._retired: dict[str, tuple[str, float]] = {}  # token -> (caller, accepted until)
        self._tokens = _parse(fixed, "the token") if fixed else self._read()

    @classmethod
    def load(cls, path: str, env: str, grace_s: float = 120.0) -> "Tokens | None":
        """From ``path`` when given, else from the environment variable ``env``; None when neither is set."""
        if path:
            return cls(path=path, grace_s=grace_s)
        value = os.environ.get(env, "")
        return cls(fixed=value, grace_s=grace_s) if value else None

    def _read(self) -> dict[str, str]:
        try:
            stat = os.stat(self.path)
            text = Path(self.path).read_text()
        except OSError as exc:
            raise ValueError(f"token file {self.path}: {exc.strerror}") from None
        self._stamp, self._text, self._read_at = (stat.st_ino, stat.st_size, stat.st_mtime_ns), text, self._clock()
        return _parse(text, self.path)

    def _refresh(self) -> None:
        """Re-read the file if it changed; a file that cannot be read now keeps the tokens it had."""
        if not self.path:
            return
        try:
            stat = os.stat(self.path)
        except OSError:
            return
        fresh_stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns) != self._stamp
        if not fresh_stamp and self._clock() - self._read_at < 1.0:
            return
        before = self._text
        try:
            fresh = self._read()
        except ValueError as exc:
            log.warning("keeping the current tokens: %s", exc)
            return
        if self._text == before:
            return
        until = self._clock() + self._grace_s
        for token, caller in self._tokens.items():
            if token not in fresh:
                self._retired[token] = (caller, until)
        for token in fresh:
            self._retired.pop(token, None)
        self._tokens = fresh
        log.info("re-read %s: %d token(s), %d retired for %g s", self.path, len(fresh), len(self._retired),
                 self._grace_s)

    def first(self) -> str:
        """The token a client sends: the file's first."""
        with self._lock:
            self._refresh()
            return next(iter(self._tokens))

    def caller(self, offered: str) -> str | None:
        """The caller ``offered`` identifies, or None when it is no valid token (compared in constant time)."""
        offered_bytes = offered.encode()
        with self._lock:
            self._refresh()
            now = self._clock()
            candidates = [*self._tokens.items(),
                          *((token, caller) for token, (caller, until) in self._retired.items() if until > now)]
        found = None
        for token, caller in candidates:  # every candidate is compared: the time does not tell which matched
            if hmac.compare_digest(offered_bytes, token.encode()) and found is None:
                found = caller
        return found

    def bearer_caller(self, authorization: str) -> str | None:
        """The caller an ``authorization`` value (``Bearer <token>``) identifies, or None."""
        return self.caller(authorization[len("Bearer "):]) if authorization.startswith("Bearer ") else None
