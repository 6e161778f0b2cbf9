"""The few tensors a forward step moves between host and device: token ids in, logits out.

On CUDA both go through page-locked (pinned) host memory, from PyTorch's
caching host allocator: the ids' copy in is asynchronous (a copy from pageable
memory would first synchronize the stream), and the logits' copy out runs at
full DMA bandwidth and is the one host synchronisation of the step. On the CPU
they are the plain tensors, as before.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (token ids, positions, masks) on ``device``; no stream sync on CUDA."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32 on the CPU (logits for verification), waiting for the device once."""
    if tensor.device.type != "cuda":
        return tensor.float()
    out = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    out.copy_(tensor.float(), non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return out
