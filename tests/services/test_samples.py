"""n samples of one prompt through a real orchestrator, over the OpenAI API (the `openai` client) and gRPC.

The tiny draft and target services behind real gRPC; an orchestrator serving both APIs. Greedy samples
all equal the target's own greedy output; seeded samples reproduce and differ; the prompt is prefilled
once on the target (its Stats: fed and shared positions); usage counts the prompt once; streaming chunks
name their choice; n outside [1, --max-n] and n over the concurrency limit are refused in OpenAI's
shape or with gRPC's status.
"""

from __future__ import annotations

import grpc
import openai
import pytest
import torch
from prometheus_client import REGISTRY

from specsplit.client import Client
from specsplit.lmkit import models
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.server import start_server
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import wait_until

pytestmark = pytest.mark.services

MODEL = "tiny-llama"
PROMPT = "Once upon a time, in a land far away,"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


class Served:
    def __init__(self, url: str, grpc_address: str, small_url: str, services) -> None:
        self.url, self.grpc_address, self.small_url = url, grpc_address, small_url
        self.target_address, self.draft_address = services.target_address, services.draft_address

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=url or self.url, api_key="unused", max_retries=0)

    def target_stats(self) -> pb.StatsResponse:
        with grpc.insecure_channel(self.target_address) as channel:
            return pb_grpc.TargetServiceStub(channel).Stats(pb.StatsRequest(), timeout=10)

    def draft_stats(self) -> pb.StatsResponse:
        with grpc.insecure_channel(self.draft_address) as channel:
            return pb_grpc.DraftServiceStub(channel).Stats(pb.StatsRequest(), timeout=10)

    def live_sessions(self) -> tuple[int, int]:
        """(target, draft) sessions open."""
        return self.target_stats().active_sessions, self.draft_stats().active_sessions


@pytest.fixture(scope="module")
def served(tiny_services, tiny_target_dir, background_loop):
    """Both APIs over the tiny services (--max-n 16), and an HTTP API whose orchestrator runs 2 generations at most."""
    base = dict(draft_address=tiny_services.draft_address, tokenizer=str(tiny_target_dir), served_model_names=(MODEL,))
    orch = background_loop.run(Orchestrator.connect(OrchestratorConfig(tiny_services.target_address, **base)))
    small = background_loop.run(
        Orchestrator.connect(OrchestratorConfig(tiny_services.target_address, max_concurrent=2, **base))
    )
    http = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    small_http = background_loop.run(openai_server.start_http_server(openai_server.build_app(small), "127.0.0.1", 0))
    server, port = background_loop.run(start_server(orch))
    yield Served(
        f"http://127.0.0.1:{http.port}/v1",
        f"127.0.0.1:{port}",
        f"http://127.0.0.1:{small_http.port}/v1",
        tiny_services,
    )
    background_loop.run(server.stop(0))
    for app in (http, small_http):
        background_loop.run(app.stop())
    for o in (orch, small):
        background_loop.run(o.close())


@pytest.fixture(scope="module")
def greedy(tiny_target_dir):
    """The tiny target's own greedy continuation of prompt ids, and the ids of the chat prompt."""
    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))

    def continuation(ids: list[int], n: int) -> str:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
        return tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    chat_ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    return continuation, tokenizer.encode(PROMPT), chat_ids


def test_greedy_samples_are_each_the_targets_greedy_output_and_usage_counts_the_prompt_once(served, greedy):
    continuation, _, chat_ids = greedy
    with served.client() as client:
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, temperature=0, max_tokens=12, extra_body={"k": 4}
        )
        one = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    assert [c.index for c in response.choices] == [0, 1, 2]
    expected = continuation(chat_ids, 12)
    assert [c.message.content for c in response.choices] == [expected] * 3
    assert {c.finish_reason for c in response.choices} <= {"length", "stop"}
    usage = response.usage
    assert usage.prompt_tokens == len(chat_ids)
    assert usage.completion_tokens == 3 * one.usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_seeded_samples_reproduce_and_differ_and_sample_0_is_the_seeds_own(served):
    def samples(n: int) -> list[str]:
        with served.client() as client:
            response = client.completions.create(
                model=MODEL, prompt=PROMPT, n=n, temperature=1.0, seed=11, max_tokens=10
            )
        assert [c.index for c in response.choices] == list(range(n))
        return [c.text for c in response.choices]

    first = samples(3)
    assert samples(3) == first
    assert len(set(first)) > 1
    assert samples(1) == first[:1]


def test_streamed_samples_name_their_choice_and_end_with_one_usage(served, greedy):
    continuation, prompt_ids, _ = greedy
    with served.client() as client:
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=3,
            temperature=0,
            max_tokens=10,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    texts, finishes, tokens = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == sorted(finishes) == [0, 1, 2]
    assert list(texts.values()) == [continuation(prompt_ids, 10)] * 3
    assert all("".join(tokens[i]) == texts[i] for i in range(3))  # each choice's logprobs are its own tokens'
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == len(prompt_ids) and usage.completion_tokens == 30


def test_the_prompt_is_prefilled_once_on_the_target(served, greedy):
    _, prompt_ids, _ = greedy
    before, prompt_metric = served.target_stats(), metric("specsplit_prompt_tokens_total")
    new = 8
    with served.client() as client:  # target-only, ignore_eos: each sample feeds one position a token
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, n=3, temperature=0, max_tokens=new, extra_body={"k": 0, "ignore_eos": True}
        )
    after = served.target_stats()
    assert response.usage.completion_tokens == 3 * new
    assert after.shared_tokens - before.shared_tokens == 2 * (len(prompt_ids) - 1)
    # The prompt but its last token once; then each sample its own positions (without sharing: 3 prompts).
    assert after.fed_tokens - before.fed_tokens == len(prompt_ids) - 1 + 3 * new
    assert metric("specsplit_prompt_tokens_total") - prompt_metric == len(prompt_ids)  # the request's prompt, once


def test_a_model_drafter_reads_the_prompt_once_and_the_samples_stay_exact(served, greedy):
    continuation, prompt_ids, _ = greedy
    target, draft = served.target_stats().shared_tokens, served.draft_stats().shared_tokens
    with served.client() as client:
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, n=3, temperature=0, max_tokens=8, extra_body={"k": 4, "drafter": "model"}
        )
    assert [c.text for c in response.choices] == [continuation(prompt_ids, 8)] * 3
    assert served.target_stats().shared_tokens - target == 2 * (len(prompt_ids) - 1)
    assert served.draft_stats().shared_tokens - draft == 2 * (len(prompt_ids) - 1)


def test_grpc_samples_carry_their_index_seed_and_stats(served, greedy):
    continuation, prompt_ids, _ = greedy
    with Client(served.grpc_address) as client:
        greedy_samples = client.complete_samples(PROMPT, n=3, chat=False, max_new_tokens=8, k=4)
        sampled = client.complete_samples(PROMPT, n=3, chat=False, max_new_tokens=8, temperature=1.0, seed=5)
        again = client.complete_samples(PROMPT, n=3, chat=False, max_new_tokens=8, temperature=1.0, seed=5)
    assert [s.text for s in greedy_samples] == [continuation(prompt_ids, 8)] * 3
    assert all(s.finish_reason and s.stats.prompt_tokens == len(prompt_ids) for s in greedy_samples)
    assert [s.text for s in again] == [s.text for s in sampled] and len({s.text for s in sampled}) > 1
    seeds = [s.stats.seed for s in sampled]
    assert seeds[0] == 5 and len(set(seeds)) == 3


def test_a_client_that_leaves_a_stream_of_samples_frees_every_session(served):
    idle = served.live_sessions()
    with served.client() as client:
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=4,
            temperature=1.0,
            seed=3,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        assert served.live_sessions()[0] > idle[0]
        stream.close()
    assert wait_until(lambda: served.live_sessions() == idle), served.live_sessions()


@pytest.mark.parametrize("n", [0, 17, "2", 1.5])
def test_n_outside_its_range_is_a_400_naming_it(served, n):
    with served.client() as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=n, max_tokens=2)
    assert info.value.status_code == 400 and info.value.param == "n"
    assert info.value.body["type"] == "invalid_request_error"


def test_grpc_n_over_max_n_is_invalid_argument(served):
    with Client(served.grpc_address) as client, pytest.raises(grpc.RpcError) as info:
        client.complete(PROMPT, n=17, max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-n" in info.value.details()


def test_each_sample_counts_against_the_concurrency_limit(served):
    with served.client(served.small_url) as client:
        with pytest.raises(openai.RateLimitError, match="n = 3 samples count as 3 generations"):
            client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=2)
        assert len(client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=2).choices) == 2
