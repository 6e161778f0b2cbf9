"""Prompt-lookup (n-gram) drafter: model-free proposals copied from the context.

Prompt lookup decoding (Saxena, 2023; HF transformers' ``PromptLookupCandidateGenerator``): outputs
often repeat spans of the prompt or of themselves (code edits, quotes, summaries), so if the last n
committed tokens occurred earlier, the tokens that followed that occurrence are a cheap guess at
what comes next; a wrong guess costs only the rejected tokens. Unlike transformers it takes the
*most recent* earlier occurrence (recent text predicts the continuation better than the prompt's
first mention), and looks it up in an incremental index, so a proposal costs O(max_n) dictionary
lookups whatever the context length.

Each block reports its ``MatchQuality``: how many tokens the context's suffix shares with the text
before the copied span (past the n-gram, up to ``MAX_MATCH``), and how many earlier occurrences the
n-gram has. Acceptance grows with the first and falls with the second, so the orchestrator sizes
the verified block by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specsplit.draft_service.drafter import Drafter, MatchQuality, Proposal
from specsplit.lmkit import token_tree

# Longer suffixes rarely match and each extra n costs one tuple per token in the index.
MAX_NGRAM = 32
_SECOND_GUESS_CANDIDATES = 4  # earlier occurrences per suffix length looked at for a second guess
MAX_MATCH = 32  # a match length is counted up to this many tokens
# Earlier occurrences looked at per suffix length for a tree (a frequent 1-gram can have thousands).
_SCAN_PER_N = 64


@dataclass(frozen=True)
class NgramConfig:
    """Which suffix lengths the n-gram drafter tries, longest first."""

    min_n: int = 1  # shortest suffix n-gram to match, >= 1
    max_n: int = 4  # longest suffix n-gram to match, min_n <= max_n <= MAX_NGRAM

    def __post_init__(self) -> None:
        for name in ("min_n", "max_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"NgramConfig.{name} must be an int, got {value!r}")
        if self.min_n < 1:
            raise ValueError(f"NgramConfig.min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"NgramConfig.max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        if self.max_n > MAX_NGRAM:
            raise ValueError(f"NgramConfig.max_n must be <= {MAX_NGRAM}, got {self.max_n}")


class NgramDrafter(Drafter):
    """Proposes the continuation of the most recent earlier occurrence of the context's suffix.

    ``propose(k)`` tries suffix lengths n = max_n down to min_n; for the first n
    whose suffix n-gram also ends at an earlier position ``e``, it proposes
    ``context[e : e + k]`` (fewer tokens if the context ends first; the copied
    span may overlap the suffix itself). With no match it proposes nothing.
    Proposals are deterministic, so ``probs`` is always None; they cost ~nothing, so the
    drafter is ``free``.
    """

    free = True

    def __init__(self, config: NgramConfig, prompt: Sequence[int]):
        self._config = config
        self._tokens: list[int] = []
        # _ends[n][gram] = ascending end positions e (exclusive) with tokens[e - n : e] == gram.
        # Ascending order makes the most recent occurrence the last entry and lets
        # rollback pop entries from the back.
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(config.min_n, config.max_n + 1)
        }
        self.extend(prompt)

    @property
    def position(self) -> int:
        """Number of committed tokens the drafter holds (prompt included)."""
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index every n-gram that ends at each of them."""
        for token in tokens:
            self._tokens.append(int(token))
            end = len(self._tokens)
            for n, ends_by_gram in self._ends.items():
                if n > end:
                    break  # n ascends: no longer n-gram fits either
                ends_by_gram.setdefault(tuple(self._tokens[end - n : end]), []).append(end)

    def rollback(self, position: int) -> None:
        """Forget every committed token at index >= ``position`` and its n-grams."""
        if not 0 <= position <= len(self._tokens):
            raise ValueError(
                f"rollback to position {position} is outside the drafter's context (0..{len(self._tokens)})"
            )
        for end in range(len(self._tokens), position, -1):
            for n, ends_by_gram in self._ends.items():
                if n > end:
                    break
                gram = tuple(self._tokens[end - n : end])
                ends = ends_by_gram[gram]
                assert ends[-1] == end, "n-gram index out of sync with the context"
                ends.pop()
                if not ends:
                    del ends_by_gram[gram]  # keeps the index the size of the live context
        del self._tokens[position:]

    def propose(self, k: int) -> Proposal:
        """Up to ``k`` tokens following the most recent earlier match of the longest matching suffix."""
        if k < 0:
            raise ValueError(f"propose needs k >= 0, got {k}")
        if k == 0:
            return Proposal(tokens=[])
        length = len(self._tokens)
        for n in range(min(self._config.max_n, length), self._config.min_n - 1, -1):
            ends = self._ends[n].get(tuple(self._tokens[length - n :]))
            # ends[-1] is the suffix itself; the entry before it is the latest earlier occurrence.
            if ends is not None and len(ends) >= 2:
                start = ends[-2]
                quality = MatchQuality(self._match_length(start, n), len(ends) - 1)
                tokens = self._tokens[start : start + k]
                return Proposal(tokens=tokens, quality=quality, second_guess=self._second_guess(start, tokens, n))
        return Proposal(tokens=[])

    def propose_tree(self, k: int, max_branches: int, max_nodes: int) -> Proposal:
        """The continuations of several earlier matches, merged into a token tree.

        Matches are taken in ``propose``'s order of preference: longest suffix
        first, then most recent, so the tree's primary chain is ``propose(k)``
        and every other branch departs from it where an older or shorter match
        continued differently. At most ``max_branches`` continuations and
        ``max_nodes`` tokens; a single continuation is sent as ``propose``
        sends it. The block carries the primary match's quality.
        """
        if k < 0 or max_branches < 1 or max_nodes < 0:
            raise ValueError(f"propose_tree needs k >= 0, max_branches >= 1, max_nodes >= 0; got {k}, {max_branches}, {max_nodes}")
        first = self.propose(min(k, max_nodes))
        sequences = self._continuations(min(k, max_nodes), max_branches) if k and max_nodes else []
        tokens, parents = token_tree.merge(sequences)
        tokens, parents = tokens[:max_nodes], parents[:max_nodes]  # parents come first: a prefix is a tree
        if token_tree.is_chain(parents):
            return first if first.tokens == tokens else Proposal(tokens=tokens, quality=first.quality)
        return Proposal(tokens=tokens, parents=parents, quality=first.quality)

    def _continuations(self, k: int, limit: int) -> list[list[int]]:
        length = len(self._tokens)
        found: list[list[int]] = []
        for n in range(min(self._config.max_n, length), self._config.min_n - 1, -1):
            ends = self._ends[n].get(tuple(self._tokens[length - n :]), [])
            for start in reversed(ends[-1 - _SCAN_PER_N : -1]):  # most recent first; the suffix itself excluded
                continuation = self._tokens[start : start + k]
                if continuation and continuation not in found:
                    found.append(continuation)
                    if len(found) == limit:
                        return found
        return found

    def _match_length(self, start: int, n: int) -> int:
        """Tokens before ``start`` equal to the context's last ones (at least the matched ``n``)."""
        tokens, end, length = self._tokens, len(self._tokens), n
        while length < MAX_MATCH and length < start and tokens[start - length - 1] == tokens[end - length - 1]:
            length += 1
        return length

    def _second_guess(self, start: int, tokens: list[int], n: int) -> tuple[int, int] | None:
        """Where the next most recent earlier occurrence (of this suffix, or of a shorter one) goes on
        differently from ``tokens``: the first index at which the two copies differ, and its token."""
        length = len(self._tokens)
        for m in range(n, self._config.min_n - 1, -1):
            ends = self._ends[m].get(tuple(self._tokens[length - m :]), ())
            tried = 0
            for j in range(len(ends) - 2, -1, -1):  # most recent first; ends[-1] is the suffix itself
                other = ends[j]
                if other == start:
                    continue
                for i, token in enumerate(tokens[: length - other]):
                    if self._tokens[other + i] != token:
                        return i, self._tokens[other + i]
                tried += 1
                if tried == _SECOND_GUESS_CANDIDATES:  # walked without touching every earlier occurrence
                    break
        return None
