"""Hidden features of committed positions: what a target sends a feature drafter, fp16 on the wire.

EAGLE drafts from the target's own hidden states (Li et al. 2024, "EAGLE:
Speculative Sampling Requires Rethinking Feature Uncertainty"); EAGLE-3 reads
three of them, a low, a middle and a high layer, concatenated (Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"). A target forward computes them for every position it
feeds; the target returns those of the committed positions, and the draft
consumes them with its next proposal.

A ``FeatureBlock`` holds the features of consecutive positions: row i is the
target's hidden states at committed position ``position + i``. On the wire the
values are fp16, little-endian, row after row. Pure: no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_FP16 = np.dtype("<f2")
# A long prefill sends only its last rows: at most this many bytes of values per message.
MAX_FEATURE_BYTES = 16 * 1024 * 1024


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high feature layers of a target with ``num_layers`` decoder layers."""
    return (min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))


def common_layers(num_layers: int) -> tuple[int, ...]:
    """The hidden states feature drafters read by default: EAGLE-3's three layers and the final norm's output
    (index ``num_layers``; Medusa's heads and EAGLE-1/2 read it)."""
    return tuple(sorted({*eagle3_layers(num_layers), num_layers}))


def parse_layers(value: str, num_layers: int) -> tuple[int, ...]:
    """A --graph-feature-layers value: ``auto`` (``common_layers``), ``none``, or comma-separated indices in
    [0, num_layers]."""
    value = value.strip().lower()
    if value == "auto":
        return common_layers(num_layers)
    if value in ("", "none"):
        return ()
    try:
        layers = tuple(sorted({int(part) for part in value.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"--graph-feature-layers takes auto, none or comma-separated layer indices, got {value!r}") \
            from None
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"--graph-feature-layers {list(layers)}: this model's hidden states are 0 (the embeddings) "
                         f"to {num_layers} (the final norm's output)")
    return layers


@dataclass(frozen=True)
class FeatureBlock:
    """The target's hidden features of positions [position, position + rows)."""

    position: int
    values: torch.Tensor  # [rows, width] float32 (CPU)

    def __post_init__(self) -> None:
        if self.position < 0:
            raise ValueError(f"features position must be >= 0, got {self.position}")
        if self.values.dim() != 2:
            raise ValueError(f"features must be [rows, width], got shape {tuple(self.values.shape)}")

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])

    @property
    def width(self) -> int:
        return int(self.values.shape[1])

    @property
    def end(self) -> int:
        """One past the last position covered."""
        return self.position + self.rows

    def since(self, position: int) -> FeatureBlock:
        """The rows of positions >= ``position`` (all of them when it is before the block)."""
        skip = min(max(position - self.position, 0), self.rows)
        return FeatureBlock(self.position + skip, self.values[skip:])

    def last_rows(self, max_bytes: int = MAX_FEATURE_BYTES) -> FeatureBlock:
        """The block cut to its last rows so that its fp16 values fit ``max_bytes`` (at least one row)."""
        keep = max(max_bytes // max(2 * self.width, 1), 1)
        return self if self.rows <= keep else self.since(self.end - keep)


def encode_features(values: torch.Tensor) -> bytes:  # values: [rows, width]
    """fp16 little-endian bytes, row after row.

    The fp16 rounding runs in numpy (the same round-to-nearest-even bits as
    torch's): servicers call this on their event loop, where a torch kernel
    would start a second OpenMP team (``specsplit.lmkit.grpc_server.ComputeThread``).
    """
    host = values.detach().to("cpu", torch.float32).numpy()  # no copy for fp32 on the CPU
    with np.errstate(over="ignore"):  # beyond fp16's range is inf, as torch rounds it
        return host.astype(_FP16).tobytes()


def decode_features(data: bytes, rows: int, width: int) -> torch.Tensor:  # -> [rows, width] float32
    """Untrusted bytes back to values; ValueError names what does not fit."""
    if rows < 0 or width < 0:
        raise ValueError(f"rows and width must be >= 0, got {rows} and {width}")
    if len(data) != 2 * rows * width:
        raise ValueError(f"{len(data)} bytes of values for {rows} rows of width {width}; expected {2 * rows * width}")
    values = np.frombuffer(data, dtype=_FP16).astype(np.float32).reshape(rows, width)
    if not np.isfinite(values).all():  # numpy, not torch: called on the event loop (encode_features)
        raise ValueError("features hold NaN or infinite values")
    return torch.from_numpy(values)
