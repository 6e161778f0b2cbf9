"""Streaming text out of committed tokens: incremental detokenization and stop strings.

All classes keep one promise: text handed to the client is never retracted.
``IncrementalDetokenizer`` withholds text while a multi-byte character is still
incomplete; ``StopMatcher`` withholds text that could be the start of a stop
string; ``TokenTextAlignment`` releases token ids in step with the text they
make, so ids after a stop string are never sent. None imports grpc or
transformers; the tokenizer is passed in (its ``backend_tokenizer`` and ``decode``).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Sequence

from tokenizers.decoders import DecodeStream

# Tokens of the prompt decoded together with the first output tokens, so that
# tokenizers whose decoding depends on the left context (SentencePiece's
# leading-space handling) render the first output token as they would mid-text.
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns committed token ids into text deltas without retracting anything already emitted.

    tokenizers' own incremental decoder (``tokenizers.decoders.DecodeStream``), one step a token: it
    holds a token whose bytes do not make a complete character yet, so text before an incomplete
    character flows and the character follows whole. The last few prompt tokens prime it, so a
    tokenizer whose decoding depends on the left context renders the first output token as it would
    mid-text. ``flush`` hands out what it still holds, incomplete characters as U+FFFD, as ``decode``
    renders them.

    For tokenizers whose ``decode`` is a concatenation of per-token pieces
    (byte-level BPE, SentencePiece with byte fallback),
    ``"".join(add(c) for c in chunks) + flush()`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
        if self._backend is None:
            raise ValueError(f"streaming text needs a fast tokenizer (the tokenizers library); "
                             f"{type(tokenizer).__name__} is not one")
        self._skip_special_tokens = skip_special_tokens
        self._context = [int(t) for t in prompt_ids[max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0) :]]
        self._pending: list[int] = []  # stepped, not emitted yet (an incomplete character)
        self._stream = DecodeStream(self._context, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the newly stable text ("" while a character is incomplete)."""
        out = []
        for token in token_ids:
            token = int(token)
            self._pending.append(token)
            text = self._stream.step(self._backend, token)
            if text is not None:
                out.append(text)
                self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
                self._pending = []
        return "".join(out)

    def flush(self) -> str:
        """Return all text not yet emitted, incomplete characters included (as U+FFFD)."""
        if not self._pending:
            return ""
        both = self._decode(self._context + self._pending)
        text = both[len(self._decode(self._context)) :]
        self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending = []
        self._stream = DecodeStream(self._context, skip_special_tokens=self._skip_special_tokens)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopMatcher:
    """Finds stop strings in streamed text; holds back text that might be the start of a stop string so nothing sent is ever retracted.

    Generation stops at the stop string that *completes* first in the text (as
    a model stopping criterion checked after every token would), ties going to
    the longest one; the result is the same however the text is chunked.
    """

    def __init__(self, stop_strings: Sequence[str]):
        if isinstance(stop_strings, str):
            raise ValueError("stop_strings must be a sequence of strings, not a single string")
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stop_strings = tuple(dict.fromkeys(stop_strings))
        self._pending = ""  # received but not emitted: a possible start of a stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Take the next text; return (text safe to emit now, stopped).

        Once stopped, the emitted text has ended right before the stop string,
        and every later call returns ("", True).
        """
        if self._stopped:
            return "", True
        pending = self._pending + text
        stop_at = self._first_stop(pending)
        if stop_at is not None:
            self._stopped, self._pending = True, ""
            return pending[:stop_at], True
        held = self._partial_stop_length(pending)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], False

    def flush(self) -> str:
        """Return the held-back text when generation ends without a stop ("" after a stop)."""
        text, self._pending = self._pending, ""
        return text

    def _first_stop(self, text: str) -> int | None:
        """Start index of the stop string that ends first in ``text``, or None."""
        best: tuple[int, int] | None = None  # (end, start): earliest end, then longest
        for s in self._stop_strings:
            start = text.find(s)  # the first occurrence of s also ends first
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop_strings:
            # Candidates start where the tail holds s[0]; the first that s starts with is the longest. One
            # C-level comparison per candidate, not a slice and a comparison per length.
            tail = text[len(text) - min(len(s) - 1, len(text)) :]
            start = tail.find(s[0])
            while start >= 0 and len(tail) - start > longest:
                if s.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(s[0], start + 1)
        return longest


class TokenTextAlignment:
    """Which token ids the emitted text covers: ids stream in step with their text, never ahead of it.

    Each token is recorded with the offset in the detokenized text where its
    own text starts. ``release(n)`` hands out the ids, not yet released, of
    every token whose text starts before offset ``n`` (the text emitted so
    far): a token is sent once some of its text is. When a stop string cuts the
    text at a token boundary, the ids sent decode to exactly the text sent; when
    it cuts inside a token, that token is the last one sent.
    """

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._starts: list[int] = []  # text offset where each token's text starts (non-decreasing)
        self._text_len = 0
        self._released = 0

    def add(self, token_id: int, text: str) -> None:
        """A committed token and the text the detokenizer released with it ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        self._starts.append(self._text_len)
        self._text_len += len(text)

    def add_text(self, text: str) -> None:
        """Text released without a new token (the detokenizer's flush)."""
        self._text_len += len(text)

    def release(self, emitted: int) -> list[int]:
        """Ids of the tokens whose text starts before offset ``emitted``, not released before."""
        end = bisect_left(self._starts, emitted, lo=self._released)
        ids, self._released = self._ids[self._released : end], max(end, self._released)
        return ids

    def release_all(self) -> list[int]:
        """Every id not yet released (generation ended without a stop string)."""
        ids, self._released = self._ids[self._released :], len(self._ids)
        return ids

    @property
    def released(self) -> int:
        return self._released
