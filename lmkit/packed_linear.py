"""Linear layers with oneDNN-packed weights, for fp32 models on the CPU.

torch's fp32 ``nn.Linear`` on the CPU goes to MKL's sgemm, which for the shapes of a verify pass (a
handful of rows against a large weight) pays again for every extra row, far from the memory bound.
oneDNN's matmul over a weight reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``)
streams the weight once whatever the row count, so verifying a block costs little more than decoding
a token (``experiments/verify_width/`` has the figures).

The products are the same fp32 products summed in a different order: logits move by rounding only,
as between any two BLAS kernels (torch's own path already switches kernels between 1 and 2 rows).
The packed weight replaces the original, so weight memory does not grow; a tied LM head gets its own
packed copy (the embedding keeps the original).

A packed call costs 11-13 us whatever the weight (the oneDNN primitive behind it), where torch's plain
matmul of a small weight takes 3-5 us: below ``PACK_MIN_VALUES`` values a weight stays an ``nn.Linear``
(``bench --suite step --step-parts linears`` measures both by weight shape and row count).
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` through oneDNN with ``W`` reordered once; same input and output shapes as ``nn.Linear``."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # An opaque oneDNN layout, not a [out, in] matrix: only _linear_pointwise reads it.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model) -> bool:
    """True for an fp32 model on the CPU with plain (unsharded) weights, where oneDNN is built in."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    params = list(model.parameters())
    return bool(params) and all(
        type(p.data) is torch.Tensor and p.device.type == "cpu" and p.dtype == torch.float32 for p in params
    )


# Weights with fewer values stay plain. Measured on one core: up to 64 x 64 the plain matmul is faster at
# every row count (1 to 160 rows); at 128 x 128 it is faster through 32 rows and slower at 160; from 128 x 256
# on packing wins from 5 or 32 rows up, by 2x at 160.
PACK_MIN_VALUES = 128 * 128


def packs(module, min_values: int = PACK_MIN_VALUES) -> bool:
    """Whether ``pack_linears`` packs ``module``: an ``nn.Linear`` whose weight has at least ``min_values`` values."""
    return type(module) is torch.nn.Linear and module.weight.numel() >= min_values


@torch.no_grad()
def pack_linears(model, min_values: int = PACK_MIN_VALUES) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose weight has at least ``min_values`` values by a
    ``PackedLinear``; returns how many were replaced.

    A model that ``can_pack`` refuses is left as it is (returns 0).
    """
    if not can_pack(model):
        return 0
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if packs(child, min_values):
                setattr(module, name, PackedLinear(child))
                replaced += 1
    return replaced
