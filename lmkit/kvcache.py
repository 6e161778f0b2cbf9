"""A session's KV cache over a token sequence, reused across rounds and cropped on rejection.

Both the target and the model drafter run a model over a context that grows by
a few tokens per round and sometimes loses its tail (rejected draft tokens).
``SessionCache`` keeps the tokens whose keys/values are cached, reuses the
longest common prefix with the next sequence, crops the rest
(``DynamicCache.crop(-n)``: transformers 5.x refuses a positive argument) and
feeds only what is new, so no round re-reads the prompt.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache


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


class SessionCache:
    """KV cache of one session; not thread-safe (one compute thread per service)."""

    def __init__(self, model) -> None:
        self._model = model
        self._device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []  # tokens whose keys/values are in the cache
        # Feature drafters (EAGLE): hidden states to keep from each forward, as indices into the
        # model's hidden states (0 = embeddings, i = input of decoder layer i); empty = none.
        self.feature_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None  # [fed, width] of the last forward, row 0 at features_from
        self.features_from = 0

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
        ids = torch.tensor([list(feed)], dtype=torch.long, device=self._device)
        out = self._model(
            input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits,
            output_hidden_states=bool(self.feature_layers),
        )
        self.keep_features(out.hidden_states, 0, keep, len(feed))
        self.tokens = [*self.tokens, *feed]
        return out.logits[0].float().cpu()  # small: [n_logits, vocab]; verification runs on the CPU

    def keep_features(self, hidden_states, row: int, start: int, fed: int) -> None:
        """Keep the chosen layers' hidden states of a forward's ``fed`` positions (row ``row``), from ``start`` on."""
        if self.feature_layers:
            # each hidden state: [batch, width of the forward, hidden]
            self.features = torch.cat([hidden_states[i][row, :fed] for i in self.feature_layers], dim=-1).float().cpu()
            self.features_from = start

    def release(self) -> None:  # noqa: B027 - a hook; the plain cache is freed by the GC
        """Called once when the session ends (a sharded cache tells the other ranks)."""

    def crop(self, length: int) -> None:
        """Drop cached positions at index >= ``length``."""
        extra = len(self.tokens) - length
        if extra > 0:
            self.cache.crop(-extra)
            self.tokens = self.tokens[:length]
