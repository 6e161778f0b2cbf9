"""Structured outputs: a request's grammar compiled by xgrammar, and one generation's matcher over its blocks.

The orchestrator owns the committed tokens, so it owns the grammar state: a
``Constraint`` holds an xgrammar matcher advanced by every committed token.
Before a block is verified it walks the matcher through the block: a chain is
cut at the first token the grammar refuses (a tree loses that node and its
subtree), the tokens the grammar forces next are appended as free drafts
(jump-forward), and the tokens allowed at every verified position are packed
into a mask the target applies to its logits there. Then it rolls the matcher
back: only the verdict's committed tokens advance it.

Cutting a refused token is lossless: the masked target gives it probability 0,
so verifying it rejects it for sure, and its position's recovered token is
then drawn from the constrained distribution itself (token-only: p with a
zero-probability token removed is p; coupled and greedy: the same argmax). A
forced token is one the constrained distribution gives probability 1: the
target accepts it. Pure: xgrammar and torch, no I/O.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specsplit.lmkit import token_tree

ALL_ALLOWED = -1  # an int32 word with every bit set


class GrammarKind(enum.Enum):
    JSON_SCHEMA = 1
    JSON_OBJECT = 2
    REGEX = 3
    CHOICE = 4
    EBNF = 5


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must follow."""

    kind: GrammarKind
    source: str = ""  # the schema's JSON text, the regex or the EBNF; empty for JSON_OBJECT and CHOICE
    choices: tuple[str, ...] = ()  # CHOICE's strings
    strict: bool = True  # JSON_SCHEMA: refuse properties and items the schema does not name


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile; the message says why."""


def xgrammar_reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[time] file.cc:line: ", "Check failed: ... is false: ")."""
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())
    return re.sub(r"^Check failed: .*? is false: ", "", text).strip()


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose root is exactly one of ``choices`` (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary (xgrammar caches what it compiled)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; GrammarError with xgrammar's reason when it does not compile."""
        compiler = self._compiler
        try:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=spec.strict)
            if spec.kind is GrammarKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind is GrammarKind.REGEX:
                return compiler.compile_regex(spec.source)
            if spec.kind is GrammarKind.CHOICE:
                return compiler.compile_grammar(choice_ebnf(spec.choices))
            return compiler.compile_grammar(spec.source)
        except RuntimeError as exc:
            raise GrammarError(xgrammar_reason(exc)) from None

    def constraint(self, compiled, max_block: int, jump_forward: bool) -> "Constraint":
        return Constraint(compiled, self.vocab_size, max_block, jump_forward)


@dataclass(frozen=True)
class Masked:
    """A block fitted to the grammar: its tokens, a tree's parents (empty: a chain), and the packed mask of its
    ``len(tokens) + 1`` verified positions (``lmkit.token_mask`` layout)."""

    tokens: list[int]
    parents: list[int]
    bits: bytes = field(repr=False)
    forced: int = 0  # tokens appended because the grammar forces them


class Constraint:
    """One generation's grammar state over its committed tokens."""

    def __init__(self, compiled, vocab_size: int, max_block: int, jump_forward: bool) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.max_block = max_block  # the most draft tokens a block may carry, forced ones included
        self.jump_forward = jump_forward

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def advance(self, tokens: Sequence[int]) -> None:
        """Accept committed tokens (each was verified under this grammar's mask; ValueError if one was not)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return  # tokens past the end-of-sequence token are cut by the loop
            if not self.matcher.accept_token(int(token)):
                raise ValueError(
                    f"the target committed token {token}, which the grammar refuses: it did not apply "
                    "VerifyRequest.allowed (a target older than token masks?); serve a target that does"
                )

    def fit(self, tokens: Sequence[int], parents: Sequence[int], room: int) -> Masked:
        """``tokens`` (a tree when ``parents`` is not empty) fitted to the grammar within ``room`` draft tokens,
        with each verified position's mask; the matcher ends where it began."""
        room = max(min(room, self.max_block), 0)
        if parents:
            return self._fit_tree(list(tokens), list(parents))
        return self._fit_chain(list(tokens)[:room], room)

    def _rows(self, n: int) -> torch.Tensor:  # -> [n, words] int32
        return self._xgr.allocate_token_bitmask(n, self.vocab_size)

    def _fill(self, rows: torch.Tensor, index: int) -> None:
        """Row ``index``: the tokens allowed after the matcher's tokens (all once it has terminated: nothing after
        the end-of-sequence token is kept)."""
        if self.matcher.is_terminated():
            rows[index] = ALL_ALLOWED
        else:
            self.matcher.fill_next_token_bitmask(rows, index)

    @staticmethod
    def _allows(rows: torch.Tensor, index: int, token: int) -> bool:
        return bool((int(rows[index, token >> 5]) >> (token & 31)) & 1)

    def _accept(self, rows: torch.Tensor, index: int, token: int) -> bool:
        """Advance by ``token`` if row ``index`` (the matcher's current position) allows it."""
        return (
            not self.matcher.is_terminated() and self._allows(rows, index, token) and self.matcher.accept_token(token)
        )

    def _fit_chain(self, tokens: list[int], room: int) -> Masked:
        rows = self._rows(room + 1)
        kept: list[int] = []
        for token in tokens:
            self._fill(rows, len(kept))
            if not self._accept(rows, len(kept), token):
                break
            kept.append(token)
        drafted = len(kept)
        if self.jump_forward and not self.matcher.is_terminated():
            for token in self.matcher.find_jump_forward_tokens()[: room - len(kept)]:
                self._fill(rows, len(kept))
                if not self._accept(rows, len(kept), token):
                    break
                kept.append(token)
        self._fill(rows, len(kept))
        self.matcher.rollback(len(kept))
        return Masked(kept, [], _bits(rows[: len(kept) + 1]), forced=len(kept) - drafted)

    def _fit_tree(self, tokens: list[int], parents: list[int]) -> Masked:
        """Nodes the grammar refuses go with their subtrees; row 0 is the context's, row i + 1 node i's."""
        rows = self._rows(len(tokens) + 1)
        self._fill(rows, 0)
        kept: list[int] = []
        for node, parent in enumerate(parents):
            if parent != token_tree.ROOT and parent not in kept:
                continue
            path = token_tree.path_to(parents, node)
            if not self._allows(rows, parent + 1, tokens[node]):
                continue
            accepted = 0
            for step in path:
                if self.matcher.is_terminated() or not self.matcher.accept_token(tokens[step]):
                    break
                accepted += 1
            if accepted == len(path):
                kept.append(node)
                self._fill(rows, node + 1)
            self.matcher.rollback(accepted)
        sub_tokens, sub_parents = token_tree.subtree(tokens, parents, kept)
        order = [0, *(node + 1 for node in sorted(kept))]
        chain = token_tree.is_chain(sub_parents)
        return Masked(sub_tokens, [] if chain else sub_parents, _bits(rows[order]))


def _bits(rows: torch.Tensor) -> bytes:  # rows: [n, words] int32
    return rows.numpy().astype("<i4").tobytes()
