"""A light client of the public ``Generator`` API: grpcio and the generated stubs, no torch, no ray.

    async with AsyncClient("127.0.0.1:50050") as client:
        async for chunk in client.generate("Summarise: ...", max_new_tokens=64):
            print(chunk.text, end="")

    with Client("127.0.0.1:50050") as client:
        print(client.complete("Hello").text)
        answer = client.complete(messages=[("system", "Answer briefly."), ("user", "Why is the sky blue?")])

Requests are plain ``GenerateRequest`` messages built by ``build_request``;
errors are ``grpc.RpcError`` with the server's status code and message. It
installs on its own, without the model stack, as the ``specsplit-client``
distribution (``clients/python``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

from specsplit.lmkit.kinds import DrafterKind, drafter_value
from specsplit.lmkit.security import ClientTls, open_channel, open_sync_channel
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

Message = tuple[str, str] | dict[str, str] | pb.ChatMessage  # a conversation turn


def build_request(
    prompt: str = "",
    *,
    messages: Sequence[Message] = (),
    chat: bool = True,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    k: int | None = None,
    drafter: DrafterKind | str | int | None = None,
    draft_probs: bool = False,
    return_token_ids: bool = False,
    adaptive_k: bool | None = None,
    overlap: bool | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    request_id: str = "",
    mode: str | None = None,  # sampling verification: "token-only", "draft-probs" or "coupled"; None = server default
    repetition_penalty: float | None = None,  # None: the model's default (its generation config), else 1 (off)
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: dict[int, float] | None = None,  # token id -> bias in [-100, 100]
    min_tokens: int = 0,
    ignore_eos: bool = False,
    n: int | None = None,  # samples of the prompt (GenerateResponse.index names each); None: 1
    json_schema: str | dict | None = None,  # the output is one JSON value this schema validates
    regex: str | None = None,  # the whole output matches this regular expression
    choice: Sequence[str] | None = None,  # the output is exactly one of these strings
    tools: Sequence[dict] | str | None = None,  # OpenAI's tools array (or its JSON text) for the chat template
    prompt_logprobs: int | None = None,  # score the prompt, this many alternatives (GenerateResponse.prompt_logprobs)
    prompt_token_ids: Sequence[int] = (),  # the prompt as the target's token ids, fed as they are (chat does not apply)
) -> pb.GenerateRequest:
    """A ``GenerateRequest`` for a prompt or a conversation (``messages``: system, user, assistant turns, rendered
    with the model's chat template); unset options take the server's defaults. The server validates every field.

    ``logprobs``: stream each token's log-probability under the target (and the ``top_logprobs`` most likely
    tokens); ``request_id``: the id the server's log lines carry for this request. ``json_schema``, ``regex``
    and ``choice`` (one at most) constrain the output (``GenerateRequest.grammar``).
    """
    grammars = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
                if value is not None]
    if len(grammars) > 1:
        raise ValueError(f"send one constraint at most, not {' and '.join(grammars)}")
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k)
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    sampling.presence_penalty, sampling.frequency_penalty = presence_penalty, frequency_penalty
    sampling.logit_bias.update(logit_bias or {})
    sampling.min_tokens, sampling.ignore_eos = min_tokens, ignore_eos
    request = pb.GenerateRequest(
        prompt=prompt, chat=chat and not prompt_token_ids, sampling=sampling, stop=list(stop), draft_probs=draft_probs,
        return_token_ids=return_token_ids, messages=[chat_message(m) for m in messages],
        return_logprobs=logprobs, top_logprobs=top_logprobs, request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
    )
    for name, value in (("max_new_tokens", max_new_tokens), ("k", k), ("adaptive_k", adaptive_k), ("overlap", overlap),
                        ("n", n)):
        if value is not None:
            setattr(request, name, value)
    if drafter is not None:
        request.drafter = drafter_value(drafter)
    if mode is not None:
        request.mode = mode_value(mode)
    if json_schema is not None:
        request.grammar.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif regex is not None:
        request.grammar.regex = regex
    elif choice is not None:
        request.grammar.choice.choices.extend(choice)
    if tools is not None:
        request.tools = tools if isinstance(tools, str) else json.dumps(list(tools))
    if prompt_logprobs is not None:
        request.prompt_logprobs = prompt_logprobs
    return request


def chat_message(message: Message) -> pb.ChatMessage:
    """A conversation turn given as (role, content), a {"role", "content"} dict or a ChatMessage."""
    if isinstance(message, pb.ChatMessage):
        return message
    role, content = (message["role"], message["content"]) if isinstance(message, dict) else message
    return pb.ChatMessage(role=role, content=content)
SAMPLING_MODES = {
    "token-only": pb.VERIFICATION_MODE_TOKEN_ONLY,
    "draft-probs": pb.VERIFICATION_MODE_DRAFT_PROBS,
    "coupled": pb.VERIFICATION_MODE_COUPLED,
}


def mode_value(mode: str) -> int:
    """The wire value of a sampling verification mode named as in SAMPLING_MODES."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(SAMPLING_MODES)}")
    return SAMPLING_MODES[mode]


@dataclass
class Completion:
    """A whole generation: its text, token ids and logprobs (when asked for), finish reason and stats."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""  # e.g. "FINISH_REASON_LENGTH"
    stats: pb.GenerationStats | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        if response.HasField("stats"):
            self.finish_reason = pb.FinishReason.Name(response.finish_reason)
            self.stats = response.stats


def _metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class AsyncClient:
    """The Generate API over one asyncio channel; use as ``async with``."""

    def __init__(self, address: str, *, token: str = "", tls: ClientTls | None = None, timeout_s: float = 600.0):
        self._channel = open_channel(address, tls)
        self._stub = pb_grpc.GeneratorStub(self._channel)
        self._metadata = _metadata(token)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The server's responses as they come; the last one carries the finish reason and stats."""
        async for response in self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata):
            yield response

    async def generate(self, prompt: str = "", **options) -> AsyncIterator[pb.GenerateResponse]:
        """Stream a completion of ``prompt`` or of ``messages=[...]`` (``options``: see ``build_request``)."""
        async for response in self.stream(build_request(prompt, **options)):
            yield response

    async def complete(self, prompt: str = "", **options) -> Completion:
        done = Completion()
        async for response in self.generate(prompt, **options):
            done.add(response)
        return done

    async def complete_samples(self, prompt: str = "", *, n: int, **options) -> list[Completion]:
        """``n`` samples of the prompt, whole: sample i's ``Completion`` at index i."""
        done = [Completion() for _ in range(n)]
        async for response in self.generate(prompt, n=n, **options):
            done[response.index].add(response)
        return done


class Client:
    """The Generate API over one blocking channel; use as ``with``."""

    def __init__(self, address: str, *, token: str = "", tls: ClientTls | None = None, timeout_s: float = 600.0):
        self._channel = open_sync_channel(address, tls)
        self._stub = pb_grpc.GeneratorStub(self._channel)
        self._metadata = _metadata(token)
        self.timeout_s = timeout_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        yield from self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)

    def generate(self, prompt: str = "", **options) -> Iterator[pb.GenerateResponse]:
        yield from self.stream(build_request(prompt, **options))

    def complete(self, prompt: str = "", **options) -> Completion:
        done = Completion()
        for response in self.generate(prompt, **options):
            done.add(response)
        return done

    def complete_samples(self, prompt: str = "", *, n: int, **options) -> list[Completion]:
        """``n`` samples of the prompt, whole: sample i's ``Completion`` at index i."""
        done = [Completion() for _ in range(n)]
        for response in self.generate(prompt, n=n, **options):
            done[response.index].add(response)
        return done
