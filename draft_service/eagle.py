"""The EAGLE drafter: drafts from the target's hidden features with an EAGLE-3 head, on the draft's device.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty";
EAGLE-3, Li et al. 2025) runs one decoder layer over the target's own hidden states: row j of the
head reads the features f_j of committed position j and the embedding of token t_{j+1}, and predicts
t_{j+2} (``specsplit.draft_service.eagle_head``). The target sends the features of the positions it
commits with each verification and this drafter takes them with the next proposal
(``add_features``), so the head runs on the draft's device, not in the target's process. A session's
first proposal has no features yet, so its first round decodes target-only.

Greedy drafts take the argmax over the draft vocabulary; sampled drafts come from q, the head's
distribution over the target vocabulary (zero outside the draft vocabulary) processed by the same
``logits_to_probs`` as the target's p, with the uniform of the token's absolute position
(``specsplit.lmkit.draws``); coupled verification takes argmax(log q + G), the target's Gumbel noise.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from specsplit.draft_service.drafter import Proposal
from specsplit.draft_service.eagle_head import EagleHead
from specsplit.draft_service.model_drafter import SamplingDrafter
from specsplit.lmkit.features import FeatureBlock
from specsplit.lmkit.kvcache import common_prefix
from specsplit.lmkit.sampling import SamplingParams


class HeadCache:
    """The head's keys, values and outputs for one session's rows, in growing buffers; cropped by length."""

    def __init__(self, head: EagleHead) -> None:
        c = head.config
        weight = head.fc.weight
        self._keys = weight.new_zeros(1, c.num_key_value_heads, 64, c.head_dim)
        self._values = torch.zeros_like(self._keys)
        self._outputs = weight.new_zeros(64, c.hidden_size)
        self.length = 0

    def past(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.length == 0:
            return None
        return self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def output(self, row: int) -> torch.Tensor:  # [H] the output of cached row ``row`` (0-based in the cache)
        return self._outputs[row]

    def append(self, keys: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> None:
        # keys, values: [1, kv_heads, m, head_dim]; outputs: [m, H]
        m = outputs.shape[0]
        if self.length + m > self._outputs.shape[0]:
            grow = max(2 * self._outputs.shape[0], self.length + m)
            self._keys = torch.cat([self._keys, self._keys.new_zeros(*self._keys.shape[:2], grow - self._keys.shape[2],
                                                                     self._keys.shape[3])], 2)
            self._values = torch.cat([self._values, torch.zeros_like(self._keys[:, :, self._values.shape[2]:])], 2)
            self._outputs = torch.cat([self._outputs, self._outputs.new_zeros(grow - self._outputs.shape[0],
                                                                               self._outputs.shape[1])])
        end = self.length + m
        self._keys[:, :, self.length:end] = keys
        self._values[:, :, self.length:end] = values
        self._outputs[self.length:end] = outputs
        self.length = end

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class EagleDrafter(SamplingDrafter):
    """Per session, the head's own KV cache over rows [start, start + cached).

    Rows computed from the target's features are *true* rows; rows past the features the draft has
    (its own drafted tokens, or tokens it was told before their features arrived) are *provisional*:
    they chain the previous row's output in place of fc(f_j), as EAGLE does when drafting several
    tokens, and are recomputed when their features arrive. Rolled-back tokens are dropped lazily: a
    proposal keeps the longest prefix of cached rows whose tokens still match the committed context.
    """

    needs_features = True

    def __init__(
        self,
        head: EagleHead,
        prompt: Sequence[int],
        sampling: SamplingParams,
        return_probs: bool,
        coupled: bool = False,
    ) -> None:
        super().__init__(prompt, sampling, return_probs, coupled)
        self._head = head
        self._draft_ids = head.draft_ids()  # [draft_vocab] the target ids of the head's outputs
        self._cache = HeadCache(head)
        self._start: int | None = None  # position of the head's row 0; None until features arrive
        self._row_tokens: list[int] = []  # cached row j holds token t_{start + j + 1}
        self._true_rows = 0  # leading cached rows computed from the target's features
        self._pending = head.fc.weight.new_zeros(0, head.feature_width)  # features of rows not yet true

    # -- context ---------------------------------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        return self._cache.length

    @property
    def features_end(self) -> int:
        """One past the last position whose features the drafter has (0 before any)."""
        if self._start is None:
            return 0
        return self._start + self._true_rows + self._pending.shape[0]

    def rollback(self, position: int) -> None:
        super().rollback(position)
        if self._start is None:
            return
        true_end = self._start + self._true_rows
        if position < true_end + 1:  # a true row's token went: never in the protocol (committed tokens stay)
            self._restart()
            return
        self._pending = self._pending[: max(position - true_end, 0)]

    def add_features(self, block: FeatureBlock) -> None:
        """The target's features of committed positions; rows already held are skipped, a gap restarts the context."""
        if block.width != self._head.feature_width:
            raise ValueError(f"features of width {block.width}; the head reads {self._head.feature_width}")
        if block.end > len(self._tokens):
            raise ValueError(f"features up to position {block.end} are past the context ({len(self._tokens)} tokens)")
        if self._start is None or block.position > self.features_end:
            self._restart()
            self._start = block.position
        new = block.since(self.features_end).values.to(self._pending)
        self._pending = torch.cat([self._pending, new])

    def _restart(self) -> None:
        self._start = None
        self._cache.crop(0)
        self._row_tokens = []
        self._true_rows = 0
        self._pending = self._pending[:0]

    # -- drafting --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        last_row = len(self._tokens) - 2  # the row that predicts the next token
        if k == 0 or self._start is None or last_row < self._start:
            return Proposal(tokens=[])
        self._keep_valid_rows(last_row)
        self._add_true_rows(last_row)
        if not self._add_chained_rows(last_row):
            return Proposal(tokens=[])
        out = self._cache.output(last_row - self._start)
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            token, probs = self._draw(self._head.logits(out), len(self._tokens) + i)
            drafted.append(token)
            if probs is not None:
                rows.append(probs)
            if i + 1 < k:
                out = self._run_rows(out[None], [token], last_row + 1 + i)[0]
        probs = torch.cat(rows) if self._return_probs and rows else None
        return Proposal(tokens=drafted, probs=probs)

    def _keep_valid_rows(self, last_row: int) -> None:
        """Crop the cache to the rows whose tokens still match and that no newer features replace."""
        start = self._start
        keep = common_prefix(self._row_tokens, self._tokens[start + 1 : last_row + 2])
        if self._pending.shape[0]:
            keep = min(keep, self._true_rows)  # provisional rows with features now are recomputed
        self._cache.crop(keep)
        del self._row_tokens[keep:]
        self._true_rows = min(self._true_rows, keep)

    def _add_true_rows(self, last_row: int) -> None:
        """Rows from the target's features, in one forward of the head."""
        first = self._start + self._true_rows
        m = min(self._pending.shape[0], last_row + 1 - first)
        if m <= 0:
            return
        hidden = self._head.fc(self._pending[:m])  # [m, H]
        self._run_rows(hidden, self._tokens[first + 1 : first + 1 + m], first)
        self._true_rows += m
        self._pending = self._pending[m:]

    def _add_chained_rows(self, last_row: int) -> bool:
        """Rows without features yet, each from the previous row's output; False when there is none to chain."""
        while self._start + self._cache.length <= last_row:
            row = self._start + self._cache.length
            if self._cache.length == 0:
                return False
            previous = self._cache.output(self._cache.length - 1)
            self._run_rows(previous[None], [self._tokens[row + 1]], row)
        return True

    def _run_rows(self, hidden: torch.Tensor, tokens: Sequence[int], first: int) -> torch.Tensor:
        """Run rows [first, first + m) (hidden [m, H], tokens t_{j+1}) through the head; cache them; return outputs."""
        m = hidden.shape[0]
        device = hidden.device
        positions = torch.arange(first, first + m, device=device)[None]  # [1, m]
        emb = self._head.embed(torch.tensor([list(tokens)], device=device))  # [1, m, H]
        past = self._cache.past()
        held = self._cache.length
        mask = None
        if m > 1:  # causal among the new rows; every cached row is visible
            mask = torch.ones(m, held + m, dtype=torch.bool, device=device).tril(held)
        out, keys, values = self._head.midlayer(emb, hidden[None], self._head.rope(positions), past, mask)
        self._cache.append(keys, values, out[0])
        self._row_tokens.extend(tokens)
        return out[0]

    def _draw(self, draft_logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token (a target id) at absolute ``position`` from [draft_vocab] logits, and the [1, vocab]
        distribution it came from."""
        if self._sampling.greedy:
            return int(self._draft_ids[draft_logits.argmax()]), None
        full = draft_logits.new_full((1, self._head.config.vocab_size), -math.inf)  # q is 0 outside the draft vocab
        full[0, self._draft_ids] = draft_logits
        return self._next(full.float(), position)
