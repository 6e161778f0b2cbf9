"""The model drafter: a causal LM sharing the target's vocabulary, with its own KV cache.

It drafts autoregressively (greedy argmax, or sampling from q processed by the
same ``logits_to_probs`` as the target's p, the token at absolute position n
drawn with the session's ``lmkit.draws`` uniform for (DRAFT, n)). In coupled
verification it proposes argmax(log q_n + G(seed, n)) with the target's own
Gumbel noise at n, so it is accepted whenever q and p pick the same token under
the same noise. Rolled-back tokens are dropped
lazily: the session cache keeps the longest prefix shared with the committed
context and crops the rest on the next proposal. ``SamplingDrafter`` is what it
shares with the EAGLE drafter: the committed context and drawing one token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draft_service.drafter import DraftBlock, Drafter
from lmkit import draws
from lmkit.kvcache import SessionCache
from lmkit.probs_codec import quantize_probs
from lmkit.sampling import SamplingParams, logits_to_probs


class SamplingDrafter(Drafter):
    """A drafter over a committed context that draws each token from logits: the argmax when greedy, else a
    sample from q = ``logits_to_probs(logits)`` (fp16-rounded first when q travels, DRAFT_PROBS mode) with the
    session's uniform for the token's absolute position; in coupled verification argmax(log q + G) with the
    target's Gumbel noise at that position."""

    def __init__(
        self, prompt: Sequence[int], sampling: SamplingParams, return_probs: bool, coupled: bool = False
    ) -> None:
        if not prompt:
            raise ValueError(f"{type(self).__name__} needs a non-empty context")
        self._tokens = list(prompt)
        self._sampling = sampling
        self._return_probs = return_probs and not sampling.greedy
        self._coupled = coupled and not sampling.greedy

    @property
    def position(self) -> int:
        return len(self._tokens)

    def rollback(self, position: int) -> None:
        if not 0 <= position <= len(self._tokens):
            raise ValueError(f"rollback to {position} is outside the context [0, {len(self._tokens)}]")
        del self._tokens[position:]

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def _next(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at absolute ``position`` from [1, vocab] logits, and the distribution it came from."""
        if self._sampling.greedy:
            return int(logits[0].argmax()), None
        q = logits_to_probs(logits, self._sampling)  # [1, vocab]
        seed = self._sampling.seed
        if self._coupled:
            return draws.gumbel_max(q[0], lambda ids: draws.gumbel(seed, draws.Stream.COUPLED, position, ids)), None
        if self._return_probs:
            # Sample from exactly what the target will decode from the wire.
            q = quantize_probs(q)
        u = float(draws.uniforms(seed, draws.Stream.DRAFT, [position], 1)[0, 0])
        token = draws.inverse_cdf(q[0].to(torch.float64), u)
        return token, (q if self._return_probs else None)


class ModelDrafter(SamplingDrafter):
    def __init__(
        self, model, prompt: Sequence[int], sampling: SamplingParams, return_probs: bool, coupled: bool = False
    ) -> None:
        super().__init__(prompt, sampling, return_probs, coupled)
        self._cache = SessionCache(model)

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    def propose(self, k: int) -> DraftBlock:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._cache.logits([*self._tokens, *drafted], [])  # [1, vocab]
            token, probs = self._next(logits, len(self._tokens) + len(drafted))
            drafted.append(token)
            if probs is not None:
                rows.append(probs)
        probs = torch.cat(rows) if self._return_probs and rows else None
        return DraftBlock(tokens=drafted, probs=probs)
