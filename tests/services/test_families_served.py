"""Each family people serve (``bench/families.py``), served: a target and a draft service of that family behind
real gRPC and the orchestrator, greedy output equal to the target model's own ``generate``, target-only, with the
model drafter (the target's weights perturbed: some drafts accepted, some rejected) and with n-gram drafts. Each
service's ``Info`` says what runs its model's steps, and where that is not the decoder step, why (no silent
fallback)."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import Services, make_engines, run_async
from specsplit.bench.families import FAMILIES, save_family
from tests.services.test_greedy_e2e import generate_all, generate_ids

pytestmark = pytest.mark.services

PROMPTS = ["The quick brown fox jumps over the lazy dog and", "def fibonacci(n):\n    if n < 2:", "Once upon a time"]
NEW_TOKENS = 16

# What runs each family's steps on the CPU (``lmkit.forward``): the decoder step where its checks pass, else
# transformers' forward over packed rows or its stock forward, each saying why.
FORWARDS = {
    "llama3": "the decoder step, eager", "qwen2.5": "the decoder step, eager", "qwen3": "the decoder step, eager",
    "phi3": "the decoder step, eager", "mistral": "the decoder step, eager", "gemma3": "the decoder step, eager",
    "mixtral": "the decoder step, eager",
}


async def _encoded(services, folder, text: str) -> list[int]:
    orch = await Orchestrator.connect(OrchestratorConfig(services.target_address, services.draft_address, str(folder)))
    try:
        return orch.encode(text, chat=True)
    finally:
        await orch.close()


async def _infos(services) -> tuple[pb.ModelInfo, pb.ModelInfo]:
    async with grpc.aio.insecure_channel(services.target_address) as target, \
            grpc.aio.insecure_channel(services.draft_address) as draft:
        return (await pb_grpc.TargetServiceStub(target).Info(pb.InfoRequest(), timeout=30),
                await pb_grpc.DraftServiceStub(draft).Info(pb.InfoRequest(), timeout=30))


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_served_family_gives_its_models_greedy_output(family, tmp_path, gguf_tokenizer, background_loop):
    """The target's folder as users have the files: bf16 weights in several safetensors shards with their index,
    the chat template in its tokenizer_config.json (not the tokenizer's usual one); served in float32."""
    from transformers import AutoModelForCausalLM

    tokenizer = copy.deepcopy(gguf_tokenizer)
    tokenizer.chat_template = TEMPLATE
    # seed 1: every greedy token of these prompts leads its runner-up by >= 1e-3 (seed 0's Mixtral has a 6e-6 tie,
    # below the rounding a batched step moves a logit by)
    target_dir = save_family(tmp_path / "target", family, tokenizer, seed=1, dtype=torch.bfloat16,
                             max_shard_size="2MB")
    assert (target_dir / "model.safetensors.index.json").is_file() and len(list(target_dir.glob("*.safetensors"))) > 1
    draft_dir = save_family(tmp_path / "draft", family, gguf_tokenizer, seed=1, perturbed=0.005)
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    chat = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                              add_generation_prompt=True)["input_ids"])
    prompts = [gguf_tokenizer.encode(p) for p in PROMPTS] + [chat]
    expected = []
    for ids in prompts:
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
        expected.append(out[0, len(ids):].tolist())
    target, draft = make_engines(str(target_dir), str(draft_dir))
    services = Services(background_loop, target, draft)
    try:
        target_info, draft_info = run_async(_infos(services))
        assert target_info.forward.startswith(FORWARDS[family]), target_info.forward
        assert next(target.model.parameters()).dtype == torch.float32
        assert run_async(_encoded(services, target_dir, PROMPTS[0])) == chat  # the folder's template
        (model,) = [d for d in draft_info.drafter_info if d.kind == DrafterKind.MODEL.value]
        assert model.forward and (model.forward.startswith("the decoder step") or "(" in model.forward), model.forward
        assert all(not d.forward for d in draft_info.drafter_info if not d.needs_model)
        stats: list = []
        for k, drafter in ((0, DrafterKind.NGRAM), (4, DrafterKind.MODEL), (4, DrafterKind.NGRAM)):
            got = run_async(generate_all(services, str(target_dir), prompts, k, drafter, NEW_TOKENS, stats=stats))
            assert got == expected, (family, k, drafter.name)
        model_rounds = stats[len(prompts): 2 * len(prompts)]
        drafted = sum(s.drafted_tokens for s in model_rounds)
        assert 0 < sum(s.accepted_tokens for s in model_rounds) < drafted, family  # accepted and rejected
    finally:
        services.stop()


def test_a_draft_of_another_vocabulary_is_refused_across_families(tmp_path, gguf_tokenizer, background_loop):
    other = copy.deepcopy(gguf_tokenizer)
    other.add_tokens(["<family-only>"])
    target_dir = save_family(tmp_path / "llama", "llama3", gguf_tokenizer)
    draft_dir = save_family(tmp_path / "qwen", "qwen3", other)
    target, draft = make_engines(str(target_dir), str(draft_dir))
    services = Services(background_loop, target, draft)
    try:
        with pytest.raises(ValueError, match="vocabulary mismatch: target .* and draft .* do not share a tokenizer"):
            run_async(Orchestrator.connect(OrchestratorConfig(services.target_address, services.draft_address,
                                                              str(target_dir))))
    finally:
        services.stop()
