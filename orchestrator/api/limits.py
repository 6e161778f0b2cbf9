"""What one request may cost the orchestrator: a generation slot (in all and per caller) and prompt bytes.

Both are checked before any work: a slot before the request is parsed, the prompt's size before it is
tokenized. Each refusal is counted in ``specsplit_refused_requests_total`` by reason.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Sequence

from specsplit.lmkit import errors
from specsplit.orchestrator.api import metrics

# A prompt of unknown context length (a target that reports none) may be at most this large.
FALLBACK_PROMPT_BYTES = 4 * 1024 * 1024


class Slots:
    """Generation slots: ``limit`` in all, and at most ``per_caller`` for one caller (0: no per-caller bound)."""

    def __init__(self, limit: int, per_caller: int = 0) -> None:
        self.limit = limit
        self.per_caller = per_caller
        self.active = 0
        self._held: dict[str, int] = {}  # caller -> slots it holds (callers holding none are absent)

    def held(self, caller: str) -> int:
        return self._held.get(caller, 0)

    @contextlib.contextmanager
    def hold(self, caller: str = "", count: int = 1, what: str = ""):
        """``count`` slots for ``caller`` for the ``with`` block (a request of ``count`` samples, or ``what``
        says of what), all or none; ResourceExhausted when they are not all free to it."""
        what = what or f"n = {count} samples"
        asked = "" if count == 1 else f" (this request's {what} count as {count} generations)"
        if self.active + count > self.limit:
            metrics.REFUSED.inc(reason="concurrency")
            raise errors.ResourceExhausted(
                f"the orchestrator is serving {self.active} of its maximum of {self.limit} concurrent generations"
                f"{asked}; retry with backoff"
            )
        if self.per_caller and self.held(caller) + count > self.per_caller:
            metrics.REFUSED.inc(reason="caller_quota")
            raise errors.ResourceExhausted(
                f"this caller already has {self.held(caller)} generations in flight and the most one caller may run "
                f"at once is {self.per_caller} (--max-concurrent-per-caller){asked}; wait for one to finish"
            )
        self.active += count
        self._held[caller] = self.held(caller) + count
        metrics.RUNNING.inc(count)
        try:
            yield
        finally:
            self.active -= count
            left = self._held.pop(caller) - count
            if left:
                self._held[caller] = left
            metrics.RUNNING.dec(count)


def caller_of(authorization: str, address: str) -> str:
    """Whom a request counts against: its bearer credential (hashed) when it sends one, else its address."""
    if authorization:
        return "token:" + hashlib.sha256(authorization.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return "address:" + address


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token of ``tokenizer`` stands for.

    The vocabulary's spelling of a token is never shorter than its text: byte-level BPE spells each byte
    as one character of one or two bytes, SentencePiece spells a space as the three-byte U+2581, and a byte
    fallback token (``<0xE2>``) is six characters for one byte.
    """
    return max((len(piece.encode("utf-8", "surrogatepass")) for piece in tokenizer.get_vocab()), default=1)


def prompt_byte_limit(configured: int, max_context: int, longest: int) -> int:
    """The most UTF-8 bytes a prompt may have: ``configured`` if set, else what ``max_context`` tokens of
    ``longest`` bytes (``longest_token_bytes``) spell, so no prompt that fits the context is refused by size."""
    if configured:
        return configured
    if not max_context:
        return FALLBACK_PROMPT_BYTES
    return max_context * longest


def check_prompt_size(prompt: str, messages: Sequence[tuple[str, str]], limit: int) -> None:
    """Refuse a prompt (or conversation; with the request's tools and grammar text) over ``limit`` UTF-8 bytes,
    before it is tokenized."""
    chars = len(prompt) + sum(len(role) + len(content) for role, content in messages)
    if chars > limit:  # a character is at least one byte: no need to encode what is over by characters alone
        size = f"at least {chars}"
    else:
        encoded = len(prompt.encode("utf-8", "surrogatepass")) + sum(
            len(role.encode("utf-8", "surrogatepass")) + len(content.encode("utf-8", "surrogatepass"))
            for role, content in messages
        )
        if encoded <= limit:
            return
        size = str(encoded)
    metrics.REFUSED.inc(reason="prompt_too_large")
    raise errors.InvalidArgument(
        f"the prompt is {size} bytes (with its tools and grammar); at most {limit} are accepted (the model's "
        "context in tokens times the longest token's bytes); shorten the prompt"
    )
