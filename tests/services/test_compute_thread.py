"""Services run tensor work on their compute thread only, never on the event loop.

With OpenMP every thread that starts a parallel region gets its own team of
helpers; a second team on a service's event loop makes libgomp stop spinning
between regions and slows every forward (``specsplit.lmkit.grpc_server.ComputeThread``).
The check: a torch function mode on the servers' event-loop thread records
every torch call there that touches a tensor of ATen's parallel grain or more
(the size from which a kernel opens a parallel region), while a DRAFT_PROBS
generation moves the draft's distributions both ways (encoded by the draft,
decoded by the target).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from tests.conftest import run_async

pytestmark = pytest.mark.services

GRAIN = 32768  # at::internal::GRAIN_SIZE: a kernel over fewer elements runs on its calling thread alone


class LargeTorchCalls(TorchFunctionMode):
    """Records the torch functions called on the thread that entered it over a tensor of >= GRAIN elements."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(kwargs or {}).values(), result) if isinstance(a, torch.Tensor)]
        if any(t.numel() >= GRAIN for t in tensors):
            self.calls.append(getattr(func, "__name__", str(func)))
        return result


def test_services_keep_tensor_work_off_their_event_loop(tiny_services, tiny_target_dir, background_loop):
    mode = LargeTorchCalls()
    background_loop.run(_enter(mode))  # torch function modes are per thread: this one sees the loop's calls only
    try:
        tokens = run_async(_generate(tiny_services, tiny_target_dir))
    finally:
        background_loop.run(_exit(mode))
    assert len(tokens) == 24
    assert mode.calls == [], f"tensor work on the services' event loop: {sorted(set(mode.calls))}"


async def _enter(mode: TorchFunctionMode) -> None:
    mode.__enter__()


async def _exit(mode: TorchFunctionMode) -> None:
    mode.__exit__(None, None, None)


async def _generate(services, target_dir) -> list[int]:
    orch = await Orchestrator.connect(OrchestratorConfig(services.target_address, services.draft_address,
                                                         tokenizer=str(target_dir)))
    request = GenerationRequest("", False, 24, SamplingParams(temperature=1.0, seed=3), (), 4,
                                DrafterKind.MODEL, True, sampling_mode=VerificationMode.DRAFT_PROBS)
    try:
        return [t async for event in orch.generate(request, list(range(300, 340))) for t in event.token_ids]
    finally:
        await orch.close()
