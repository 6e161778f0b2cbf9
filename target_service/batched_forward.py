"""Verification blocks of several sessions in one forward pass (continuous batching).

Each session keeps its own KV cache and position; a batched step computes for every session what
its solo step would, and afterwards each session's cache gets its own new keys/values appended and
nothing else. A model with the packed forward installed (``specsplit.lmkit.packed_rows``) packs the
rows end to end, with no padding and no copy of any past; any other (sliding windows, linear
attention, a sharded model) gathers the pasts into one padded batch (``forward_batch``). Long feeds
(a prompt's prefill) do not join a batch: padding every row to the prompt's length would cost more
than it saves. No grpc here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specsplit.lmkit import graph_step, packed_rows
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.models import cache_kwargs
from specsplit.lmkit.transfer import to_device, to_host


@dataclass(frozen=True)
class Step:
    """One session's share of a forward: crop its cache to ``keep``, feed ``feed``, return ``n_logits`` rows.

    ``parents``: the last len(parents) fed tokens are a token tree (packed forward only).
    """

    cache: SessionCache
    keep: int
    feed: list[int]
    n_logits: int
    parents: tuple[int, ...] | None = None


class _PaddedBatchLayer(DynamicLayer):
    """One layer's keys/values for a batched step: the sessions' pasts, padded to a common length."""

    def __init__(self, pasts: Sequence[tuple[torch.Tensor, torch.Tensor] | None], past_len: int) -> None:
        super().__init__()
        self._pasts = pasts  # per row: ([1, heads, p_i, dim] keys, values) or None when p_i = 0
        self._past_len = past_len
        self.is_initialized = True
        self.new_keys: torch.Tensor | None = None  # [batch, heads, Q, dim] after the forward
        self.new_values: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        return self._past_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [batch, heads, Q, dim]; the result is [batch, heads, P + Q, dim]
        self.new_keys, self.new_values = key_states, value_states
        return self._gather(key_states), self._gather(value_states, values=True)

    def _gather(self, new: torch.Tensor, values: bool = False) -> torch.Tensor:
        batch, heads, width, dim = new.shape
        out = new.new_zeros(batch, heads, self._past_len + width, dim)
        for row, past in enumerate(self._pasts):
            if past is not None:
                tensor = past[1] if values else past[0]
                out[row, :, self._past_len - tensor.shape[-2] : self._past_len] = tensor[0]
        out[:, :, self._past_len :] = new
        return out


def _layer_past(cache: SessionCache, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    layers = cache.cache.layers
    if layer >= len(layers) or not layers[layer].is_initialized or layers[layer].keys is None:
        return None
    if layers[layer].keys.numel() == 0:
        return None
    return layers[layer].keys, layers[layer].values


@torch.inference_mode()
def forward_batch(model, steps: Sequence[Step]) -> list[torch.Tensor]:
    """Run every step in one forward; returns per step its last ``n_logits`` rows [n_logits, vocab] (float32, CPU).

    Afterwards each step's cache holds its kept prefix plus its fed tokens, as
    after ``SessionCache.apply``. Without the packed forward the sessions' pasts
    are gathered into one padded batch:

        row i:  [ pad (P - p_i) | past_i (p_i) | fed_i (n_i) | pad (Q - n_i) ]

    with a mask that hides the pads and position ids p_i + j, so row i attends
    exactly to its own past and, causally, its own fed tokens. Pasts end where the
    fed tokens start, so distances in cache slots equal distances in positions
    (what a sliding-window mask measures: transformers builds masks by slot). A
    pad slot repeats its row's last position, so no position exceeds what the row
    itself reaches (a learned position table ends at the context).
    """
    if not steps:
        return []
    if all(isinstance(step.cache, graph_step.GraphSessionCache) for step in steps):
        return graph_step.forward_steps(steps)
    if all(step.cache.kv is not None for step in steps):
        return _forward_packed(model, steps)
    if any(step.parents is not None for step in steps):
        raise ValueError("token trees need the packed forward")
    device = next(model.parameters()).device
    for step in steps:
        step.cache.crop(step.keep)
    past_len = max(step.keep for step in steps)
    width = max(len(step.feed) for step in steps)
    n_layers = int(model.config.num_hidden_layers)

    input_ids = torch.zeros(len(steps), width, dtype=torch.long)
    positions = torch.zeros(len(steps), width, dtype=torch.long)
    mask = torch.zeros(len(steps), past_len + width, dtype=torch.long)
    for row, step in enumerate(steps):
        n = len(step.feed)
        input_ids[row, :n] = torch.tensor(step.feed, dtype=torch.long)
        positions[row, :n] = torch.arange(step.keep, step.keep + n)
        positions[row, n:] = step.keep + n - 1  # pad slots: the row's own last position, never past it
        mask[row, past_len - step.keep : past_len] = 1
        mask[row, past_len : past_len + n] = 1

    batch_cache = DynamicCache(config=model.config)
    batch_cache.layers = [
        _PaddedBatchLayer([_layer_past(step.cache, layer) for step in steps], past_len) for layer in range(n_layers)
    ]
    out = model(
        input_ids=to_device(input_ids, device),
        attention_mask=to_device(mask, device),
        position_ids=to_device(positions, device),
        **cache_kwargs(model, batch_cache),
        use_cache=True,
        output_hidden_states=any(step.cache.feature_layers for step in steps),
    )
    logits = to_host(out.logits)  # [batch, width, vocab]
    results = []
    for row, step in enumerate(steps):
        n = len(step.feed)
        step.cache.keep_features(out.hidden_states, row, step.keep, n)
        _append(step, batch_cache, row)
        results.append(logits[row, n - step.n_logits : n])
    return results


def padded_tokens(model, widths: Sequence[int]) -> int:
    """Tokens a forward over rows of these widths computes: their sum when packed, else every row at the widest."""
    return sum(widths) if packed_rows.installed(model) else len(widths) * max(widths)


def _forward_packed(model, steps: Sequence[Step]) -> list[torch.Tensor]:
    rows = [step.cache.row_step(step.keep, step.feed, step.n_logits, step.parents) for step in steps]
    for step in steps:
        step.cache.crop(step.keep)
    results, features = packed_rows.forward_rows_with_features(model, rows)
    for step, kept in zip(steps, features):
        step.cache.cached(step.feed)
        if kept is not None:
            step.cache.features, step.cache.features_from = kept, step.keep
    return results


def _append(step: Step, batch_cache: DynamicCache, row: int) -> None:
    """Give a session's cache its own new keys/values from the batched step."""
    n = len(step.feed)
    own = step.cache.cache
    for layer, batched in enumerate(batch_cache.layers):
        keys = batched.new_keys[row : row + 1, :, :n]
        values = batched.new_values[row : row + 1, :, :n]
        own.update(keys.contiguous(), values.contiguous(), layer)
    step.cache.cached(step.feed)


def split_by_width(widths: Sequence[int], overhead_tokens: float) -> list[list[int]]:
    """Rows (indices into ``widths``) grouped into forwards: all together, or narrow rows apart from wide ones.

    Rows are padded to the widest of their forward, so one long block in a
    batch of single-token rows multiplies its tokens. Two forwards cost one
    more forward's fixed part, ``overhead_tokens`` (a / s of t(x) = a + s x, in
    tokens); split where that is cheaper than the padding it saves.
    """
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    best_cost, best_cut = len(order) * widths[order[-1]], 0
    for cut in range(1, len(order)):
        narrow, wide = order[:cut], order[cut:]
        cost = len(narrow) * widths[narrow[-1]] + len(wide) * widths[wide[-1]] + overhead_tokens
        if cost < best_cost:
            best_cost, best_cut = cost, cut
    return [order] if best_cut == 0 else [order[:best_cut], order[best_cut:]]
