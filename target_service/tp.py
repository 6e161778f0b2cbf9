"""Tensor-parallel target: one logical target over N ranks, rank 0 leading.

The model is sharded by transformers' own plan (``tp_plan="auto"``); each
forward runs collectives inside, so every rank must run the same forward with
the same inputs in the same order. Rank 0 serves gRPC and owns sessions; before
each forward step it broadcasts the step (which session cache, how many cached
positions to keep, which tokens to feed) and the other ranks replay it on
their shard of that session's KV cache. NCCL on GPUs, gloo on CPU.

Wire between ranks: an int64 header ``[op, slot, keep, n_feed, n_logits,
n_released, n_parents]`` then one int64 payload of fed tokens, released slots
and a token tree's parents (a forward step), or of the accepted path's node
offsets in place of the fed tokens (``OP_KEEP_PATH``, after a tree's verdict:
every rank moves the path's keys and values the same way). No pickling. NCCL
moves only CUDA tensors, so on GPUs the two live on the rank's
device (``comm_device``); gloo keeps them on the CPU.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from specsplit.lmkit import errors
from specsplit.lmkit.kvcache import SessionCache

log = logging.getLogger(__name__)

OP_FORWARD = 1
OP_SHUTDOWN = 2
OP_KEEP_PATH = 3
_HEADER = 7


def check_divisible(config, tp: int, model_id: str) -> None:
    """Refuse a degree that does not split the attention heads evenly, naming degrees that do."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", heads) or heads)
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if heads and (heads % tp or kv_heads % tp):
        works = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ValueError(
            f"--tp {tp} does not divide {model_id}'s {heads} attention heads and {kv_heads} key/value heads; "
            f"use --tp in {works}"
        )


def init_process_group(device: str, timeout_s: float) -> tuple[int, int]:
    """Join the group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR in the environment)."""
    import datetime

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def leave_group() -> bool:
    """After a clean shutdown (every rank past the last broadcast): meet the other ranks, then destroy this rank's
    process group while the interpreter is whole. Left to the interpreter's exit, gloo's worker threads can
    outlive what they hold and abort the process ("terminate called without an active exception"). False when
    a rank is gone meanwhile."""
    if not dist.is_initialized():
        return True
    try:
        dist.barrier()
        dist.destroy_process_group()
    except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError) included
        log.error("could not leave the tensor-parallel group cleanly: %s", exc)
        return False
    return True


def comm_device() -> torch.device:
    """Where the step broadcasts live: the rank's GPU under NCCL, the CPU under gloo.

    The rank's GPU is LOCAL_RANK's (the current device is per thread, and rank 0
    broadcasts from its compute thread).
    """
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def weight_bytes(model) -> int:
    """Bytes of parameters this rank holds (its shards, not the logical tensors)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class Leader:
    """Rank 0's side: announces each forward step to the followers, then runs it."""

    def __init__(self, model, on_broken=None) -> None:
        self.model = model
        self.broken: str = ""  # why the group failed; empty while healthy
        self._on_broken = on_broken
        self._slots = itertools.count(1)
        self._released: list[int] = []
        self._lock = threading.Lock()

    def fail(self, exc: BaseException) -> errors.Unavailable:
        """A collective failed: a rank died or hung. The target cannot serve any more."""
        if not self.broken:
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("tensor-parallel group broken (%s); shutting the target down", self.broken)
            if self._on_broken is not None:
                self._on_broken()
        return errors.Unavailable(f"the tensor-parallel target lost a rank ({self.broken}); it is shutting down")

    def new_cache(self) -> "ShardedSessionCache":
        return ShardedSessionCache(self.model, self, next(self._slots))

    def release(self, slot: int) -> None:
        """Followers drop the slot's cache with the next broadcast (closes come from the event loop)."""
        with self._lock:
            self._released.append(slot)

    def announce(self, op: int, slot: int = 0, keep: int = 0, feed: Sequence[int] = (), n_logits: int = 0,
                 parents: Sequence[int] = ()) -> None:
        with self._lock:
            released, self._released = self._released, []
        device = comm_device()
        header = torch.tensor([op, slot, keep, len(feed), n_logits, len(released), len(parents)], dtype=torch.int64,
                              device=device)
        dist.broadcast(header, src=0)
        payload = torch.tensor([*feed, *released, *parents], dtype=torch.int64, device=device)
        if payload.numel():
            dist.broadcast(payload, src=0)

    def shutdown(self) -> None:
        self.announce(OP_SHUTDOWN)


class ShardedSessionCache(SessionCache):
    """A session cache whose every forward step is mirrored on the other ranks."""

    def __init__(self, model, leader: Leader, slot: int) -> None:
        super().__init__(model)
        self._leader = leader
        self.slot = slot

    def logits(
        self, context: Sequence[int], block: Sequence[int], parents: Sequence[int] | None = None,
        all_rows: bool = False, grown: bool = False,
    ) -> torch.Tensor:
        if parents is not None and not self.supports_trees:
            raise ValueError("this tensor-parallel target runs transformers' forward on its shards: chains only")
        self._check_group()
        keep, feed = self.plan(context, block, grown)
        n_logits = len(feed) if all_rows else len(block) + 1
        try:
            self._leader.announce(OP_FORWARD, self.slot, keep, feed, n_logits, parents or ())
            return self.apply(keep, feed, n_logits, parents)
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError) included
            raise self._leader.fail(exc) from None

    def _move_path(self, length: int, path: Sequence[int]) -> None:
        """A tree's accepted path moved on every rank's shard of the cache alike."""
        self._check_group()
        try:
            self._leader.announce(OP_KEEP_PATH, self.slot, length, path)
            super()._move_path(length, path)
        except RuntimeError as exc:
            raise self._leader.fail(exc) from None

    def _check_group(self) -> None:
        if self._leader.broken:
            raise errors.Unavailable(f"the tensor-parallel target lost a rank ({self._leader.broken})")

    @property
    def can_copy(self) -> bool:
        return False  # the other ranks hold their shards of it: a copy on rank 0 alone would split them

    def release(self) -> None:
        self._leader.release(self.slot)


def follow(model) -> None:
    """Ranks > 0: replay rank 0's steps until it announces shutdown (or the group breaks)."""
    caches: dict[int, SessionCache] = {}
    device = comm_device()
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.broadcast(header, src=0)
        op, slot, keep, n_feed, n_logits, n_released, n_parents = header.tolist()
        payload = torch.empty(n_feed + n_released + n_parents, dtype=torch.int64, device=device)
        if payload.numel():
            dist.broadcast(payload, src=0)
        values = payload.tolist()
        for released in values[n_feed : n_feed + n_released]:
            caches.pop(released, None)
        if op == OP_SHUTDOWN:
            return
        cache = caches.setdefault(slot, SessionCache(model))
        if op == OP_KEEP_PATH:
            cache.keep_path(keep, values[:n_feed])
        else:
            cache.apply(keep, values[:n_feed], n_logits, values[n_feed + n_released :] or None)
