"""Stop a proposal whose session has closed, at the next decoder layer, so it frees the compute thread.

The draft service runs every session's model work on one compute thread, in
arrival order. An orchestrator that stops waiting for a proposal (past its
draft timeout) aborts the session's stream; the servicer then closes the
session, but the forward already running would hold the thread to its end —
a long prefill on a slow drafter (the int8 self-draft on a long prompt) holds
it for many seconds, and every other session's proposal (an EAGLE session's,
say) waits behind it and misses its own timeout. A forward pre-hook on each
decoder layer of the service's models (``watch``) checks whether the running proposal's
session is still open, and raises ``errors.NotFound`` when it is not: the
abandoned work ends after at most one more layer. The closed session's
drafter is left half-updated, which is harmless: it is never used again.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Iterator

import torch

from specsplit.lmkit import errors

_HOOKED = "_specsplit_abandon_check"  # set on a layer once its hook is in place
_running = threading.local()  # .closed: the proposal computed on this thread asks "is my session closed?"


def decoder_layers(models: Iterable[object]) -> list[torch.nn.Module]:
    """The layers in every ``ModuleList`` of these models (each module once: views share layers)."""
    seen: dict[int, torch.nn.Module] = {}
    for model in models:
        if not isinstance(model, torch.nn.Module):
            continue
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                seen.update((id(layer), layer) for layer in module)
    return list(seen.values())


def watch(models: Iterable[object]) -> None:
    """Check for abandonment before each decoder layer of these models (once per layer, however often asked)."""
    for layer in decoder_layers(models):
        if not getattr(layer, _HOOKED, False):
            layer.register_forward_pre_hook(_check)
            setattr(layer, _HOOKED, True)


@contextlib.contextmanager
def proposing(closed: Callable[[], bool]) -> Iterator[None]:
    """Forwards on this thread, inside the block, stop once ``closed()`` is true."""
    _running.closed = closed
    try:
        yield
    finally:
        _running.closed = None


def _check(module, args) -> None:
    closed = getattr(_running, "closed", None)  # other threads (a target sharing the model in tests) pass
    if closed is not None and closed():
        raise errors.NotFound("the session closed while its proposal was computed; the proposal is abandoned")
