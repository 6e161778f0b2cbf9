"""Speed comes back after a fault: a draft process paused for three seconds mid-generation (SIGSTOP, as a
partition or a stalled host looks from the orchestrator) stops drafting for the pause only.

The draft is the target's first two layers, and the target's other layers add nothing to the residual stream
(zero output projections): every drafted token is accepted and a target step costs several drafted tokens, as
with a large target beside a small draft that agrees with it, so the controller asks for the longest blocks it
may when nothing is wrong. (With a target no costlier than its draft, speculation does not pay: once the pause
has let the controller measure the target's one-token steps, it rightly stops asking.) The proposal in flight
when the draft stops reports the pause as its compute; counted whole, that one sample would price the
drafter's tokens above a target step, no block would be asked for again, and no sample could bring the price
back (the cost model bounds a sample; without the bound the later generations here draft 0.0 tokens a round,
against 7.9 before the pause). Greedy output stays the target's own throughout.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

from specsplit.lmkit import processes
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from tests.conftest import run_async, save_tiny_llama

pytestmark = pytest.mark.services

PROMPT = [5, 6, 7, 8, 9, 10]
PAUSE_S = 3.0
PAUSE_AT_S = 0.3  # after the generation starts: it is drafting full blocks by then
FAULT_TOKENS = 1200  # the target alone commits a token a round through the pause: enough to outlast it
DEPTH = 12  # the target's layers: the draft's two, then ones that add nothing


def save_twins(root: Path, tokenizer) -> tuple[Path, Path]:
    """(target, draft) checkpoints with the same greedy text: a random two-layer Llama (a long context), and it
    with ``DEPTH - 2`` more layers whose attention and MLP output projections are zero (x + 0 is x)."""
    from transformers import LlamaForCausalLM

    draft = save_tiny_llama(root / "draft", tokenizer, seed=1, layers=2, context=4096)
    target = save_tiny_llama(root / "target", tokenizer, seed=1, layers=DEPTH, context=4096)
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        missing = model.load_state_dict(LlamaForCausalLM.from_pretrained(draft).state_dict(), strict=False).missing_keys
        assert all(key.split(".")[2] not in ("0", "1") for key in missing)  # the two layers are the draft's
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(target)
    return target, draft


@pytest.fixture(scope="module")
def services(tmp_path_factory, gguf_tokenizer):
    """Target and draft processes over the twins, the draft's MODEL drafter."""
    target_dir, draft_dir = save_twins(tmp_path_factory.mktemp("twins"), gguf_tokenizer)
    with processes.local_services(["--model", str(target_dir)], ["--model", str(draft_dir)]) as (target, draft):
        yield target, draft, str(target_dir)


async def generate(orch: Orchestrator, tokens: int, pause: tuple[int, float] | None = None):
    """(ids, tokens drafted a round, tokens drafted a round over the first 20 rounds)."""
    request = GenerationRequest("", False, tokens, SamplingParams(), (), 8, DrafterKind.MODEL, False,
                                adaptive_k=True, overlap=True)
    if pause is not None:
        pid, at_s = pause
        loop = asyncio.get_running_loop()
        loop.call_later(at_s, os.kill, pid, signal.SIGSTOP)
        loop.call_later(at_s + PAUSE_S, os.kill, pid, signal.SIGCONT)
    ids, last = [], None
    try:
        async for event in orch.generate(request, PROMPT):
            ids += event.token_ids
            last = event
    finally:
        if pause is not None:
            os.kill(pause[0], signal.SIGCONT)
    drafted = last.loop.drafted_per_round
    return ids, sum(drafted) / len(drafted), sum(drafted[:20]) / len(drafted[:20])


def test_drafting_returns_to_its_pre_fault_blocks_after_the_draft_is_paused(services):
    target, draft, folder = services

    async def go():
        orch = await Orchestrator.connect(OrchestratorConfig(target.address, draft.address, tokenizer=folder))
        try:
            await generate(orch, 200)  # warm: every cost measured
            before = await generate(orch, 400)
            fault = await generate(orch, FAULT_TOKENS, (draft.process.pid, PAUSE_AT_S))
            after = await generate(orch, 400)
        finally:
            await orch.close()
        return before, fault, after

    (before_ids, before_rate, _), (fault_ids, _, _), (after_ids, after_rate, after_first) = run_async(go())
    assert fault_ids[:400] == before_ids and after_ids == before_ids  # the target's own greedy text throughout
    assert len(fault_ids) == FAULT_TOKENS
    assert before_rate >= 4.0  # every token accepted: long blocks
    assert after_rate >= 0.5 * before_rate and after_first >= 0.5 * before_rate, (before_rate, after_rate, after_first)
