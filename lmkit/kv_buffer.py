"""One session's keys/values for every layer, in preallocated buffers that grow by doubling.

A ``DynamicCache`` appends by concatenation: every forward copies each
layer's whole past into a fresh tensor, which on a CPU costs more than the
attention itself once the context is a few hundred tokens. Here each layer
holds ``[1, kv_heads, capacity, head_dim]`` buffers; a forward writes its new
keys/values in place at their positions and attention reads a view of the
first ``length`` positions. Cropping is setting ``length``; keeping a tree's
accepted path is one gather per layer (``keep_path``).

A layer that attends within a sliding window (``windows``) keeps only the positions its next queries can see,
plus ``slack`` more so that a session can still be cropped back that far (rejected draft tokens): when its
buffer fills, the positions before (the write's start - window + 1 - slack) are dropped and the rest moved to
the front (``fronts``: the first position each layer holds), so its memory follows the window, not the
context. Cropping below ``floor`` would need dropped positions: only a crop to 0 (feed the context again) is
allowed there.

No transformers import: ``specsplit.lmkit.packed_rows`` connects it to a model's forward.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MIN_CAPACITY = 256  # positions; a prompt's prefill usually fits at once
ROLLBACK = 256  # positions a sliding-window layer keeps beyond its window: how far a session may be cropped back


class KVBuffer:
    def __init__(self, n_layers: int, windows: Sequence[int | None] | None = None, slack: int = ROLLBACK) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0  # positions holding keys/values, the same in every layer
        self.windows = tuple(windows) if windows is not None else (None,) * n_layers  # None: full attention
        if len(self.windows) != n_layers:
            raise ValueError(f"{len(self.windows)} windows for {n_layers} layers")
        self.slack = slack
        self.fronts = [0] * n_layers  # per layer: the position its buffers hold at index 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    @property
    def floor(self) -> int:
        """The shortest length, but 0, this buffer can be cropped to: every sliding layer still holds the window
        its next query sees."""
        return max((front + window - 1 for front, window in zip(self.fronts, self.windows) if front), default=0)

    def held(self, layer: int) -> int:
        """Positions ``layer``'s buffers hold (its window and slack where it slides; every one where not)."""
        return self.length - self.fronts[layer]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` [1, kv_heads, n, head_dim] at positions start..start+n-1 of ``layer``."""
        end = start + keys.shape[2]
        if self.keys[layer] is None or end - self.fronts[layer] > self.keys[layer].shape[2]:
            self._make_room(layer, keys, values, start, end)
        front = self.fronts[layer]
        self.keys[layer][:, :, start - front:end - front] = keys
        self.values[layer][:, :, start - front:end - front] = values

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``fronts[layer]``..end-1 of ``layer`` (views, no copy):
        [1, kv_heads, end - front, head_dim] each."""
        front = self.fronts[layer]
        return self.keys[layer][:, :, :end - front], self.values[layer][:, :, :end - front]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop {self.length} cached positions to {length}")
        if 0 < length < self.floor:
            raise ValueError(f"cannot crop {self.length} cached positions to {length}: its sliding-window layers "
                             f"no longer hold the positions before {self.floor}; crop to 0 and feed them again")
        if length == 0:
            self.fronts = [0] * len(self.fronts)
        self.length = length

    @torch.inference_mode()  # the buffers were made by inference-mode forwards
    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Keep positions start + offsets[0], start + offsets[1], ... as start, start + 1, ...; drop the rest.

        ``offsets`` ascend (a tree's accepted path in its node order), so the
        kept entries only move towards ``start``.
        """
        if list(offsets) != list(range(len(offsets))):
            kept = torch.tensor([start + o for o in offsets], dtype=torch.long, device=self.keys[0].device)
            for layer in range(len(self.keys)):
                at = start - self.fronts[layer]
                for buffers in (self.keys, self.values):
                    picked = buffers[layer].index_select(2, kept - self.fronts[layer])  # a copy: they may overlap
                    buffers[layer][:, :, at : at + len(offsets)] = picked
        self.length = start + len(offsets)

    @torch.inference_mode()
    def prefix_copy(self, length: int) -> "KVBuffer":
        """A new buffer holding a copy of positions 0..length-1 of every layer (room for more after them)."""
        if not 0 <= length <= self.length or 0 < length < self.floor:
            raise ValueError(f"cannot copy {length} of {self.length} cached positions (held from {self.floor})")
        copy = KVBuffer(len(self.keys), self.windows, self.slack)
        if length:
            for layer, front in enumerate(self.fronts):
                copy.fronts[layer] = front
                copy.write(layer, front, *(b[layer][:, :, : length - front] for b in (self.keys, self.values)))
        copy.length = length
        return copy

    def _make_room(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int, end: int) -> None:
        """Room in ``layer``'s buffers for positions up to ``end`` written at ``start`` (positions before it are
        held): a sliding layer drops what its window and slack no longer need and moves the rest to the front,
        allocating afresh only where they would fill more than half its buffers; a full layer grows by doubling."""
        old, front, window = self.keys[layer], self.fronts[layer], self.windows[layer]
        keep = front if window is None else max(front, start - window + 1 - self.slack)
        held = max(self.length - keep, 0)  # positions keep..keep+held-1 move to index 0
        top = max(end, self.length)
        capacity = 0 if old is None else old.shape[2]
        if window is None:
            capacity = max(_MIN_CAPACITY, top, 2 * capacity)
        elif 2 * (top - keep) > capacity:
            capacity = max(_MIN_CAPACITY, 2 * (top - keep))
        for buffers, like in ((self.keys, keys), (self.values, values)):
            source = buffers[layer]
            moved = None if source is None or not held else source[:, :, keep - front : keep - front + held]
            if source is None or source.shape[2] != capacity:
                buffers[layer] = like.new_empty(1, like.shape[1], capacity, like.shape[3])
            elif moved is not None:
                moved = moved.clone()  # the same buffer: source and target overlap
            if moved is not None:
                buffers[layer][:, :, :held] = moved
        self.fronts[layer] = keep
