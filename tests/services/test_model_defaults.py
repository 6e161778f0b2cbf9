"""The target's generation_config.json sampling defaults fill what a request leaves unset (``--generation-config``).

A model folder whose generation config sets repetition_penalty: greedy output
through the services (HTTP with the openai client, and a GenerateRequest) equals
transformers' ``generate``, which applies the same config; with ``ignore`` it
equals plain greedy decoding instead. The defaults are the target model's, as the
target reports them (``ModelInfo.sampling_defaults``), not the orchestrator's
tokenizer folder's: a real ``serve-target`` process over the penalized folder
with the orchestrator's tokenizer the plain one gives the penalized text.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch

from specsplit.lmkit import models
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.requests import parse_request
from specsplit.v1 import specsplit_pb2 as pb
from tests.conftest import reference_greedy, run_async, service_processes

pytestmark = pytest.mark.services

PROMPT = "a b a b a b a b"
NEW = 24
PENALTY = 2.0  # the tiny target's top token leads by a wide margin: 1.5 would change nothing


@pytest.fixture(scope="module")
def penalized_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target's folder with repetition_penalty in its generation_config.json."""
    folder = tmp_path_factory.mktemp("tiny-target-penalized")
    shutil.copytree(tiny_target_dir, folder, dirs_exist_ok=True)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "repetition_penalty": PENALTY}))
    return folder


@pytest.fixture(scope="module")
def penalized_services(penalized_dir, tiny_draft_dir, tmp_path_factory):
    """Real serve-target (over the penalized folder) and serve-draft processes."""
    with service_processes(tmp_path_factory.mktemp("penalized-services"),
                           ["--model", str(penalized_dir), "--threads", "1"],
                           ["--model", str(tiny_draft_dir), "--threads", "1"]) as services:
        yield services


@pytest.fixture(scope="module")
def expected(penalized_dir, gguf_tokenizer):
    """transformers' greedy generate from the folder (its generation config applied), and without the penalty."""
    model = models.load_model(models.ModelSpec(str(penalized_dir)))
    ids = gguf_tokenizer.encode(PROMPT)
    assert model.generation_config.repetition_penalty == PENALTY
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=2)
    with_config = out[0, len(ids) :].tolist()
    model.generation_config.repetition_penalty = 1.0
    plain = reference_greedy(model, ids, NEW)
    assert with_config != plain  # the penalty changes the text: the tests below can tell
    return ids, with_config, plain


async def grpc_ids(services, folder, mode: str) -> list[int]:
    config = OrchestratorConfig(services.target_address, services.draft_address, str(folder), generation_config=mode)
    orch = await Orchestrator.connect(config)
    try:
        msg = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=NEW, sampling=pb.SamplingParams(temperature=0.0),
                                 k=4)
        request, prompt_ids = await parse_request(msg, orch)
        got: list[int] = []
        async for event in orch.generate(request, prompt_ids):
            got.extend(event.token_ids)
        return got
    finally:
        await orch.close()


@pytest.mark.parametrize("mode", ["auto", "ignore"])
def test_generate_request_takes_the_models_repetition_penalty(penalized_services, penalized_dir, expected, mode):
    _, with_config, plain = expected
    got = run_async(grpc_ids(penalized_services, penalized_dir, mode))
    assert got == (with_config if mode == "auto" else plain)


def test_the_defaults_are_the_target_models_as_the_target_reports_them(penalized_services, tiny_target_dir, expected,
                                                                        tiny_services):
    _, with_config, plain = expected
    # the orchestrator's tokenizer folder is the plain one: the penalty comes from the target's report
    assert run_async(grpc_ids(penalized_services, tiny_target_dir, "auto")) == with_config
    # and a target over the plain model reports none, whatever the tokenizer folder says
    assert run_async(grpc_ids(tiny_services, tiny_target_dir, "auto")) == plain


def test_an_explicit_value_wins_over_the_models(penalized_services, penalized_dir, expected):
    _, _, plain = expected

    async def go():
        config = OrchestratorConfig(penalized_services.target_address, penalized_services.draft_address,
                                    str(penalized_dir))
        orch = await Orchestrator.connect(config)
        try:
            sampling = pb.SamplingParams(temperature=0.0, repetition_penalty=1.0)
            request, prompt_ids = await parse_request(
                pb.GenerateRequest(prompt=PROMPT, max_new_tokens=NEW, sampling=sampling), orch
            )
            return [t async for event in orch.generate(request, prompt_ids) for t in event.token_ids]
        finally:
            await orch.close()

    assert run_async(go()) == plain


def test_the_openai_client_gets_the_models_defaults(penalized_services, penalized_dir, expected, background_loop):
    ids, with_config, _ = expected
    config = OrchestratorConfig(
        penalized_services.target_address, penalized_services.draft_address, str(penalized_dir),
        served_model_names=("tiny",)
    )
    orch = background_loop.run(Orchestrator.connect(config))
    app = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{app.port}/v1", api_key="unused", max_retries=0) as client:
            response = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=NEW)
    finally:
        background_loop.run(app.stop())
        background_loop.run(orch.close())
    assert response.choices[0].text == models.load_tokenizer(str(penalized_dir)).decode(
        with_config, skip_special_tokens=True
    )
