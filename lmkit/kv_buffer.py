"""One session's keys/values for every layer, in preallocated buffers that grow by doubling.

A ``DynamicCache`` appends by concatenation: every forward copies each
layer's whole past into a fresh tensor, which on a CPU costs more than the
attention itself once the context is a few hundred tokens. Here each layer
holds ``[1, kv_heads, capacity, head_dim]`` buffers; a forward writes its new
keys/values in place at their positions and attention reads a view of the
first ``length`` positions. Cropping is setting ``length``; keeping a tree's
accepted path is one gather per layer (``keep_path``).

No transformers import: ``specsplit.lmkit.packed_rows`` connects it to a model's forward.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MIN_CAPACITY = 256  # positions; a prompt's prefill usually fits at once


class KVBuffer:
    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0  # positions holding keys/values, the same in every layer

    @property
    def capacity(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` [1, kv_heads, n, head_dim] at positions start..start+n-1 of ``layer``."""
        end = start + keys.shape[2]
        if self.keys[layer] is None or end > self.keys[layer].shape[2]:
            self._grow(layer, keys, values, end)
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..end-1 of ``layer`` (views, no copy): [1, kv_heads, end, head_dim] each."""
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop {self.length} cached positions to {length}")
        self.length = length

    @torch.inference_mode()  # the buffers were made by inference-mode forwards
    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Keep positions start + offsets[0], start + offsets[1], ... as start, start + 1, ...; drop the rest.

        ``offsets`` ascend (a tree's accepted path in its node order), so the
        kept entries only move towards ``start``.
        """
        if list(offsets) != list(range(len(offsets))):
            index = torch.tensor([start + o for o in offsets], dtype=torch.long, device=self.keys[0].device)
            for layer in range(len(self.keys)):
                for buffers in (self.keys, self.values):
                    picked = buffers[layer].index_select(2, index)  # a copy, so sources and targets may overlap
                    buffers[layer][:, :, start : start + len(offsets)] = picked
        self.length = start + len(offsets)

    @torch.inference_mode()
    def prefix_copy(self, length: int) -> "KVBuffer":
        """A new buffer holding a copy of positions 0..length-1 of every layer (room for more after them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot copy {length} of {self.length} cached positions")
        copy = KVBuffer(len(self.keys))
        if length:
            for layer in range(len(self.keys)):
                copy.write(layer, 0, self.keys[layer][:, :, :length], self.values[layer][:, :, :length])
        copy.length = length
        return copy

    def _grow(self, layer: int, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        old = self.keys[layer]
        capacity = max(_MIN_CAPACITY, needed, 2 * (0 if old is None else old.shape[2]))
        for buffers, like in ((self.keys, keys), (self.values, values)):
            grown = like.new_empty(1, like.shape[1], capacity, like.shape[3])
            if buffers[layer] is not None:
                grown[:, :, : self.length] = buffers[layer][:, :, : self.length]
            buffers[layer] = grown
