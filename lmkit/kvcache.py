"""A session's KV cache over a token sequence, reused across rounds and cropped on rejection.

Both the target and the model drafter run a model over a context that grows by
a few tokens per round and sometimes loses its tail (rejected draft tokens).
``SessionCache`` keeps the tokens whose keys/values are cached, reuses the
longest common prefix with the next sequence, crops the rest
(``DynamicCache.crop(-n)``: transformers 5.x refuses a positive argument) and
feeds only what is new, so no round re-reads the prompt.
"""

from __future__ import annotations

import functools
import inspect
from typing import Sequence

import torch
from transformers import DynamicCache

from lmkit.transfer import to_device, to_host


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_class: type) -> str:
    """The forward's name for the cache: ``cache`` from transformers 5.2x on, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for ``model(...)``, whichever transformers 5.x runs (GPU images may hold an older one)."""
    return {_cache_kwarg(type(model)): cache}


class SessionCache:
    """KV cache of one session; not thread-safe (one compute thread per service)."""

    def __init__(self, model) -> None:
        self._model = model
        self._device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []  # tokens whose keys/values are in the cache

    def __len__(self) -> int:
        return len(self.tokens)

    def logits(self, context: Sequence[int], block: Sequence[int]) -> torch.Tensor:
        """Logits after ``context[-1]`` and after each token of ``block``.

        Returns [len(block) + 1, vocab] float32 on the CPU: row i predicts the
        token at position len(context) + i. Afterwards the cache holds
        context + block.
        """
        keep, feed = self.plan(context, block)
        return self.apply(keep, feed, len(block) + 1)

    def plan(self, context: Sequence[int], block: Sequence[int]) -> tuple[int, list[int]]:
        """How many cached positions to keep, and which tokens to feed after them."""
        if not context:
            raise ValueError("context must hold at least one token")
        seq = [*context, *block]
        # The last context token is always fed so its logits exist.
        keep = min(common_prefix(self.tokens, seq), len(context) - 1)
        return keep, seq[keep:]

    @torch.inference_mode()
    def apply(self, keep: int, feed: Sequence[int], n_logits: int) -> torch.Tensor:
        """Crop to ``keep`` positions, feed ``feed``, return the last ``n_logits`` rows [n_logits, vocab]."""
        self.crop(keep)
        ids = to_device(torch.tensor([list(feed)], dtype=torch.long), self._device)
        out = self._model(input_ids=ids, **cache_kwargs(self._model, self.cache), use_cache=True, logits_to_keep=n_logits)
        self.tokens = [*self.tokens, *feed]
        return to_host(out.logits[0])  # small: [n_logits, vocab]; verification runs on the CPU

    def release(self) -> None:  # noqa: B027 - a hook; the plain cache is freed by the GC
        """Called once when the session ends (a sharded cache tells the other ranks)."""

    def crop(self, length: int) -> None:
        """Drop cached positions at index >= ``length``."""
        extra = len(self.tokens) - length
        if extra > 0:
            self.cache.crop(-extra)
            self.tokens = self.tokens[:length]
