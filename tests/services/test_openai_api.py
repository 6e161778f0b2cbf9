"""The OpenAI-compatible HTTP API, driven by the official `openai` client (sync, async, streaming) and raw HTTP.

A real orchestrator over the tiny draft and target services serves the API with
uvicorn on 127.0.0.1; greedy text equals the target model's own `generate`,
logprobs equal the target's log-softmax, and bad requests get OpenAI's error
shape with the right status.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import grpc
import openai
import pytest
import torch

from specsplit.lmkit import models
from specsplit.lmkit.auth import Tokens
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from tests.conftest import run_async, wait_until

pytestmark = pytest.mark.services

MODEL = "tiny-llama"
TOKEN = "s3cret-token"
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]


@pytest.fixture(scope="module")
def api(tiny_services, tiny_target_dir, background_loop):
    """(base url, orchestrator): the HTTP API over the tiny services; a second app on the same orchestrator
    requires a bearer token (``api.token_url``)."""
    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir),
                                served_model_names=(MODEL,), max_new_tokens_limit=600)
    orch = background_loop.run(Orchestrator.connect(config))
    open_app = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch), "127.0.0.1", 0))
    locked = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch, Tokens(fixed=TOKEN)), "127.0.0.1", 0))
    yield Api(f"http://127.0.0.1:{open_app.port}/v1", f"http://127.0.0.1:{locked.port}/v1", open_app.port, orch)
    background_loop.run(open_app.stop())
    background_loop.run(locked.stop())
    background_loop.run(orch.close())


class Api:
    def __init__(self, url: str, token_url: str, port: int, orch) -> None:
        self.url, self.token_url, self.port, self.orch = url, token_url, port, orch

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    """The tiny target's own greedy continuation and per-position log-softmax (teacher-forced)."""
    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))

    def greedy(ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
        return out[0, len(ids):].tolist()

    def logprobs(prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:  # [len(new_ids), vocab]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + new_ids])).logits[0]
        return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) + len(new_ids) - 1].float(), -1)

    def chat_ids(messages) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

    return Reference(tokenizer, greedy, logprobs, chat_ids)


class Reference:
    def __init__(self, tokenizer, greedy, logprobs, chat_ids) -> None:
        self.tokenizer, self.greedy, self.logprobs, self.chat_ids = tokenizer, greedy, logprobs, chat_ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def sessions(services) -> tuple[int, int]:
    return services.target_engine.sessions.stats()[0], services.draft_engine.sessions.stats()[0]


# -- the openai client ------------------------------------------------------------------------------------


def test_models_lists_the_served_name(api):
    with api.client() as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.retrieve(MODEL).owned_by == "specsplit"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_chat_completion_of_a_conversation_is_the_targets_greedy_answer(api, reference, drafter):
    prompt_ids = reference.chat_ids(CONVERSATION)
    expected = reference.greedy(prompt_ids, 16)
    with api.client() as client:
        response = client.chat.completions.create(
            model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=16, extra_body={"k": 4, "drafter": drafter})
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.text(expected)
    assert choice.finish_reason == ("stop" if 2 in expected else "length")
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected)
    speculative = response.usage.speculative
    assert speculative["drafter"] == drafter and speculative["k"] == 4
    assert speculative["rounds"] >= 1 and 0 <= speculative["accepted_tokens"] <= speculative["drafted_tokens"]


def test_penalties_and_biases_through_the_openai_client_equal_non_speculative_references(api, tiny_target_dir):
    from tests.services.test_penalties_e2e import NEW, openai_penalty_greedy, transformers_greedy

    tokenizer = models.load_tokenizer(str(tiny_target_dir))
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    prompt = "a b a b a b a b"
    ids = tokenizer.encode(prompt)
    with api.client() as client:
        biased = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=NEW, logit_bias={"13": 9, "2": 30},
            extra_body={"repetition_penalty": 2.0, "min_tokens": 5, "k": 4, "drafter": "ngram"},
        )
        penalized = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=NEW, presence_penalty=0.4, frequency_penalty=0.6,
            extra_body={"k": 4, "drafter": "ngram"},
        )
    expected = transformers_greedy(model, ids, repetition_penalty=2.0, sequence_bias={(13,): 9.0, (2,): 30.0},
                                   min_new_tokens=5)
    assert biased.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert biased.usage.completion_tokens == len(expected) == 6 and biased.choices[0].finish_reason == "stop"
    expected = openai_penalty_greedy(model, ids, 0.4, 0.6)
    assert penalized.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(api, reference):
    prompt_ids = reference.chat_ids(CONVERSATION)
    expected = reference.text(reference.greedy(prompt_ids, 24))
    with api.client() as client:
        stream = client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=24,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and chunks[-2].choices[0].finish_reason == finishes[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2  # it really streamed


def test_async_client_completions_whole_and_streamed(api, reference, gguf_tokenizer):
    prompt = "def fibonacci(n):"
    expected = reference.text(reference.greedy(list(gguf_tokenizer.encode(prompt)), 20))

    async def go():
        async with api.async_client() as client:
            whole = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
            stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20,
                                                     stream=True)
            parts = [chunk async for chunk in stream]
            many = await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20) for _ in range(3)
            ])
            return whole, parts, many

    whole, parts, many = run_async(go())
    assert whole.object == "text_completion" and whole.choices[0].text == expected
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason in ("length", "stop")
    assert [m.choices[0].text for m in many] == [expected] * 3


def test_chat_logprobs_are_the_targets_log_softmax(api, reference):
    messages = [{"role": "user", "content": "Count: 1, 2, 3,"}]
    prompt_ids = reference.chat_ids(messages)
    with api.client() as client:
        response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                                  logprobs=True, top_logprobs=3, extra_body={"k": 4})
    content = response.choices[0].logprobs.content
    ids = reference.greedy(prompt_ids, 12)
    expected = reference.logprobs(prompt_ids, ids)  # [12, vocab]
    assert len(content) == len(ids)
    for position, (item, token_id) in enumerate(zip(content, ids)):
        assert item.token == reference.tokenizer.decode([token_id])
        assert item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(expected[position, token_id].item(), abs=1e-4)
        top_values, top_ids = expected[position].topk(3)
        assert [t.token for t in item.top_logprobs] == [reference.tokenizer.decode([i]) for i in top_ids.tolist()]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy takes the argmax


def test_completion_logprobs_in_the_legacy_shape_streamed(api, reference, gguf_tokenizer):
    prompt = "a b a b a b"
    with api.client() as client:
        stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10, logprobs=2,
                                           stream=True, extra_body={"k": 3, "drafter": "ngram"})
        chunks = [c for c in stream if c.choices]
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    top = [d for c in chunks for d in c.choices[0].logprobs.top_logprobs]
    assert len(tokens) == 10 and len(top) == 10 and all(len(d) <= 2 for d in top)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(10)]
    ids = reference.greedy(list(gguf_tokenizer.encode(prompt)), 10)
    assert tokens == [reference.tokenizer.decode([i]) for i in ids]


def _prompt_logprobs(reference, prompt_ids: list[int]) -> torch.Tensor:  # [len - 1, vocab]: row i scores token i + 1
    return reference.logprobs(prompt_ids[:1], prompt_ids[1:])


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt_as_lm_eval_asks(api, reference, gguf_tokenizer):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0, greedy."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = list(gguf_tokenizer.encode(prompt))
    with api.client() as client:
        response = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                             temperature=0)
    choice = response.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [reference.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    want = _prompt_logprobs(reference, ids)
    assert lp.token_logprobs[1:] == pytest.approx(want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), abs=1e-4)
    for top, row in zip(lp.top_logprobs[1:], want):
        best = row.argmax().item()
        assert top == {reference.tokenizer.decode([best]): pytest.approx(row[best].item(), abs=1e-4)}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 0


def test_echo_prepends_the_prompt_to_new_text_and_its_logprobs_streamed_or_not(api, reference, gguf_tokenizer):
    prompt = "a b a b a b"
    ids = list(gguf_tokenizer.encode(prompt))
    new = reference.greedy(ids, 6)
    with api.client() as client:
        plain = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=6, temperature=0)
        whole = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=6, temperature=0,
                                          logprobs=0, extra_body={"k": 3, "drafter": "ngram"})
        chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=6,
                                                       temperature=0, logprobs=0, stream=True) if c.choices]
    assert plain.choices[0].text == prompt + reference.tokenizer.decode(new) and plain.choices[0].logprobs is None
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == plain.choices[0].text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    # the stream ran the default k, the whole reply k 3 (other forward shapes): float32 rounding apart
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], rel=1e-5)
    want = torch.cat([_prompt_logprobs(reference, ids), reference.logprobs(ids, new)])
    chosen = want.gather(1, torch.tensor(ids[1:] + new)[:, None])[:, 0].tolist()
    assert whole.choices[0].logprobs.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    assert whole.choices[0].logprobs.tokens == [reference.tokenizer.decode([i]) for i in ids + new]


def test_vllms_prompt_logprobs_extra_on_completions_and_chat(api, reference, gguf_tokenizer):
    prompt = "The quick brown fox"
    ids = list(gguf_tokenizer.encode(prompt))
    want = _prompt_logprobs(reference, ids)
    with api.client() as client:
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                               extra_body={"prompt_logprobs": 2})
        chat = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2, temperature=0,
                                              extra_body={"prompt_logprobs": 0})
        scored = completion.choices[0].model_extra["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(ids)
        for position, (token, row) in enumerate(zip(ids[1:], want), start=1):
            entry = scored[position]
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
            assert entry[str(token)]["decoded_token"] == reference.tokenizer.decode([token])
            best = row.topk(2).indices.tolist()
            assert {k: v["rank"] for k, v in entry.items() if k != str(token)} == {
                str(b): r for r, b in enumerate(best, start=1) if b != token}
        chat_ids = reference.chat_ids(CONVERSATION)
        assert len(chat.model_extra["prompt_logprobs"]) == len(chat_ids) and chat.model_extra["prompt_logprobs"][0] is None
        assert all(len(p) == 1 for p in chat.model_extra["prompt_logprobs"][1:])  # the prompt's token alone
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                      extra_body={"prompt_logprobs": 1})
        assert info.value.param == "prompt_logprobs" and "stream false" in info.value.message


def test_the_speculation_extra_turns_drafting_off_or_fixes_k_for_one_request(api, reference, gguf_tokenizer):
    prompt = "a b a b a b a b"
    ids = list(gguf_tokenizer.encode(prompt))
    want = reference.tokenizer.decode(reference.greedy(ids, 12))
    with api.client() as client:
        def ask(speculation):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"speculation": speculation, "drafter": "ngram"})
        off, fixed = ask({"enabled": False}), ask({"k": 3})
        assert off.choices[0].text == fixed.choices[0].text == want
        assert off.usage.speculative["drafted_tokens"] == 0 and off.usage.speculative["k"] == 0
        assert fixed.usage.speculative["k"] == 3 and not fixed.usage.speculative["adaptive_k"]
        assert fixed.usage.speculative["drafted_tokens"] > 0
        for speculation, param in [({"k": -1}, "speculation.k"), ({"enabled": False, "k": 2}, "speculation.k"),
                                   ({"k": "4"}, "speculation.k"), ({"depth": 2}, "speculation.depth")]:
            with pytest.raises(openai.BadRequestError) as info:
                ask(speculation)
            assert info.value.param == param, (speculation, info.value.message)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"speculation": {"k": 2}, "k": 2})
        assert "not both" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            ask({"k": 1000})
        assert "max block" in info.value.message


def test_seed_reproduces_a_sample_and_stop_ends_the_text(api, reference):
    messages = [{"role": "user", "content": "Tell me a story."}]
    with api.client() as client:
        def sample(seed):
            return client.chat.completions.create(model=MODEL, messages=messages, temperature=0.9, top_p=0.95,
                                                  seed=seed, max_tokens=20).choices[0].message.content
        first, again, other = sample(7), sample(7), sample(8)
        assert first == again and first != other
        greedy = reference.text(reference.greedy(reference.chat_ids(messages), 20))
        stop = greedy[len(greedy) // 2: len(greedy) // 2 + 3]
        stopped = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                                 stop=[stop])
    assert stop and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == greedy[: greedy.index(stop)]


# -- errors ----------------------------------------------------------------------------------------------


def raw(api, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, parsed JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_bad_requests_get_openai_errors_with_the_right_status(api):
    with api.client() as client:
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4o", messages=CONVERSATION)
        assert info.value.code == "model_not_found" and MODEL in info.value.message
        cases = {
            "temperature": {"temperature": "hot"},
            "max_tokens": {"max_tokens": 10_000},
            "n": {"n": 0},
            "frequency_penalty": {"frequency_penalty": 2.5},
            "logit_bias": {"logit_bias": {"99999999": 1}},
            "top_logprobs": {"logprobs": True, "top_logprobs": 25},
            "stop": {"stop": 3},
            "k": {"extra_body": {"k": 1000}},
        }
        for param, extra in cases.items():
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=MODEL, messages=CONVERSATION, **{"max_tokens": 4, **extra})
            assert info.value.status_code == 400 and param in info.value.message, (param, info.value.message)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "function", "content": "x"}])
        assert info.value.param.startswith("messages")
        with pytest.raises(openai.BadRequestError) as info:  # 0 new tokens score the prompt: echo only
            client.completions.create(model=MODEL, prompt="a b", max_tokens=0)
        assert info.value.param == "max_tokens" and "0 only with echo" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:  # about 1000 tokens; the tiny target's context is 512
            client.completions.create(model=MODEL, prompt="word " * 1000, max_tokens=4)
        assert "context" in info.value.message


def test_malformed_json_unknown_fields_and_routes_are_refused_in_the_error_shape(api):
    status, body = raw(api, "POST", "/v1/chat/completions", b'{"model": "tiny-llama", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"] and body["error"]["type"]
    status, body = raw(api, "POST", "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    request = {"model": MODEL, "messages": CONVERSATION, "temprature": 0}
    status, body = raw(api, "POST", "/v1/chat/completions", json.dumps(request).encode())
    assert status == 400 and body["error"]["param"] == "temprature"
    status, body = raw(api, "POST", "/v1/chat/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = raw(api, "GET", "/v1/nothing-here")
    assert status == 404 and "error" in body
    status, body = raw(api, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in body
    assert raw(api, "GET", "/health") == (200, {"status": "ok"})


def test_bearer_token_is_required_when_set(api):
    with openai.OpenAI(base_url=api.token_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=api.token_url, api_key=TOKEN, max_retries=0) as client:
        assert client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2).choices


# -- disconnects ------------------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_ends_the_generation(api, tiny_services):
    rounds_before = tiny_services.target_engine.sessions.stats()[2]
    with api.client() as client:
        stream = client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=500,
                                                stream=True, extra_body={"k": 0})
        for received, _ in enumerate(stream):
            if received == 3:
                break
        stream.close()
    assert wait_until(lambda: sessions(tiny_services) == (0, 0)), sessions(tiny_services)
    assert tiny_services.target_engine.sessions.stats()[2] - rounds_before < 250  # k = 0: one round per token


def test_a_client_that_disconnects_before_a_whole_answer_ends_the_generation(api, tiny_services):
    rounds_before = tiny_services.target_engine.sessions.stats()[2]
    body = json.dumps({"model": MODEL, "messages": CONVERSATION, "max_tokens": 500, "temperature": 0, "k": 0}).encode()
    with socket.create_connection(("127.0.0.1", api.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: sessions(tiny_services)[0] == 1)
        time.sleep(0.3)
    assert wait_until(lambda: sessions(tiny_services) == (0, 0)), sessions(tiny_services)
    assert tiny_services.target_engine.sessions.stats()[2] - rounds_before < 250
    assert api.orch.active == 0


# -- prompt shapes: token ids, lists of prompts ----------------------------------------------------------------


def test_token_id_prompts_are_fed_as_they_are(api, reference, gguf_tokenizer, tiny_services, public_api):
    """A token-id prompt gives the text prompt's tokens, and ids the tokenizer would not write reach the target
    untouched (lm-evaluation-harness sends its own tokenization); gRPC takes them too."""
    from specsplit.client import Client

    text = "def fibonacci(n):"
    ids = list(gguf_tokenizer.encode(text))
    odd = [t for letter in "fibonacci" for t in gguf_tokenizer.encode(letter)]  # a letter a token: not the tokenizer's
    assert list(gguf_tokenizer.encode(gguf_tokenizer.decode(odd))) != odd
    with api.client() as client:
        by_text = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=12)
        by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12)
        untouched = client.completions.create(model=MODEL, prompt=odd, temperature=0, max_tokens=12,
                                              extra_body={"k": 4, "drafter": "model"})
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=[5, 60000], max_tokens=2)
    assert by_ids.choices[0].text == by_text.choices[0].text == reference.text(reference.greedy(ids, 12))
    assert by_ids.usage.prompt_tokens == len(ids)
    assert untouched.choices[0].text == reference.text(reference.greedy(odd, 12))
    assert untouched.usage.prompt_tokens == len(odd)
    assert "prompt_token_ids[1] = 60000 is outside the model's vocabulary" in info.value.message
    with Client(public_api) as client:
        done = client.complete(prompt_token_ids=odd, max_new_tokens=12, k=4, return_token_ids=True)
        assert done.token_ids == reference.greedy(odd, 12)
        with pytest.raises(grpc.RpcError) as refused:
            client.complete("x", prompt_token_ids=odd, chat=False, max_new_tokens=2)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not prompt and prompt_token_ids" in \
        refused.value.details()
    assert wait_until(lambda: sessions(tiny_services) == (0, 0))


def test_a_list_of_prompts_is_one_request_with_choices_prompt_major(api, reference, gguf_tokenizer, tiny_services):
    texts = ["a b a b a b", "The quick brown fox"]
    ids = [list(gguf_tokenizer.encode(t)) for t in texts]
    new = [reference.greedy(i, 6) for i in ids]
    common = dict(model=MODEL, temperature=0, max_tokens=6, n=2)
    with api.client() as client:
        by_texts = client.completions.create(prompt=texts, **common)
        by_ids = client.completions.create(prompt=ids, echo=True, logprobs=1, **common)
        stream = client.completions.create(prompt=ids, stream=True, stream_options={"include_usage": True}, **common)
        chunks = list(stream)
        with pytest.raises(openai.BadRequestError) as info:  # the second prompt is refused: nothing runs
            client.completions.create(model=MODEL, prompt=[ids[0], [1, 2**31]], max_tokens=2)
    assert [c.index for c in by_texts.choices] == [0, 1, 2, 3]
    assert [c.text for c in by_texts.choices] == [reference.text(new[p]) for p in (0, 0, 1, 1)]
    assert by_texts.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and by_texts.usage.completion_tokens == 24
    echoed = [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)]
    assert echoed == [gguf_tokenizer.decode(ids[p]) + reference.text(new[p]) for p in (0, 0, 1, 1)]
    for choice in by_ids.choices:  # the echoed prompt's tokens, then the new ones, each with its logprob
        assert choice.logprobs.tokens == [reference.tokenizer.decode([t]) for t in ids[choice.index // 2] + new[choice.index // 2]]
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)}
    assert streamed == {i: reference.text(new[i // 2]) for i in range(4)}
    assert chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert "prompt_token_ids[1] = 2147483648" in info.value.message
    assert wait_until(lambda: sessions(tiny_services) == (0, 0))


def _post(api, path: str, body: dict) -> tuple[int, dict]:
    return raw(api, "POST", path, json.dumps(body).encode())


def test_tokenize_and_detokenize_in_vllms_shapes(api, reference, gguf_tokenizer):
    text = "The quick brown fox"
    ids = list(gguf_tokenizer.encode(text))
    status, plain = _post(api, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200 and plain == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                                       "token_strs": gguf_tokenizer.convert_ids_to_tokens(ids)}
    status, chat = _post(api, "/tokenize", {"messages": CONVERSATION})  # model is optional, as vLLM's
    assert status == 200 and chat["tokens"] == reference.chat_ids(CONVERSATION) and chat["token_strs"] is None
    with api.client() as client:  # what a chat completion of the same turns feeds the target
        answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens == chat["count"]
    _, bare = _post(api, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False})
    want = gguf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)["input_ids"]
    assert bare["tokens"] == list(want) and chat["tokens"][: bare["count"]] == bare["tokens"] < chat["tokens"]
    _, special = _post(api, "/tokenize", {"messages": CONVERSATION, "add_special_tokens": True})
    rendered = gguf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert special["tokens"] == list(gguf_tokenizer.encode(rendered, add_special_tokens=True))
    status, back = _post(api, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]})
    assert status == 200 and back == {"prompt": gguf_tokenizer.decode(chat["tokens"])}

    status, bad = _post(api, "/detokenize", {"tokens": [5, 60000]})
    assert status == 400 and "tokens[1] = 60000 is outside the model's vocabulary" in bad["error"]["message"]
    status, bad = _post(api, "/tokenize", {"model": "gpt-4o", "prompt": text})
    assert status == 404 and bad["error"]["code"] == "model_not_found"
    status, bad = _post(api, "/tokenize", {"prompt": 3})
    assert status == 400 and bad["error"]["param"] == "prompt"
    status, bad = _post(api, "/tokenize", {"messages": [{"role": "narrator", "content": "x"}]})
    assert status == 400 and bad["error"]["param"].startswith("messages")
    locked = http.client.HTTPConnection("127.0.0.1", int(api.token_url.split(":")[2].split("/")[0]), timeout=60)
    try:
        locked.request("POST", "/tokenize", body=json.dumps({"prompt": text}), headers={"content-type": "application/json"})
        assert locked.getresponse().status == 401
    finally:
        locked.close()


def test_metrics_are_served_on_the_api_port_with_its_token(api):
    def generated() -> float:
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
            text = response.read().decode()
        finally:
            conn.close()
        line = next(line for line in text.splitlines() if line.startswith("specsplit_generation_tokens_total"))
        return float(line.split()[-1])

    before = generated()
    with api.client() as client:
        client.completions.create(model=MODEL, prompt="a b a b", max_tokens=5, temperature=0)
    assert generated() == before + 5
    locked = http.client.HTTPConnection("127.0.0.1", int(api.token_url.split(":")[2].split("/")[0]), timeout=60)
    try:
        locked.request("GET", "/metrics")
        assert locked.getresponse().status == 401
    finally:
        locked.close()
