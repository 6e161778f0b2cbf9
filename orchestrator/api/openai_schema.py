"""The OpenAI API's request and response shapes, and their translation to and from ``specsplit.v1``.

Requests are validated strictly (JSON types as the API documents them; an
unknown parameter is refused rather than ignored) and become the same
``GenerateRequest`` the gRPC API takes, so both APIs share one validation
(``specsplit.orchestrator.api.requests``). Parameters that specsplit cannot honour
(``best_of`` other than ``n``...) are refused with a 400 naming them, never
silently ignored. Tools (``tools``, ``tool_choice``) go to the chat template
and, for a forced call, to the grammar (``specsplit.orchestrator.api.tools``).

``n`` samples (``GenerateRequest.n``) come back as ``choices`` 0..n-1, each with
its own ``finish_reason`` and logprobs; ``usage`` counts the prompt once and the
completion tokens of every choice.

Structured outputs: ``response_format`` (chat; ``json_object``, or
``json_schema`` with ``strict``) and vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` (both endpoints) become
``GenerateRequest.grammar``.

Extensions, in the body (``extra_body`` in the openai SDK): ``top_k``,
``repetition_penalty``, ``min_tokens`` and ``ignore_eos`` (as vLLM), and
specsplit's ``k``, ``drafter``, ``adaptive_k``, ``overlap``, ``draft_probs``.
Responses carry the speculative stats in ``usage.speculative``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specsplit.lmkit.kinds import DrafterKind, VerificationMode, drafter_value
from specsplit.orchestrator.api import tools
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.tool_parsers import FORMATS
from specsplit.orchestrator.api.tools import ToolPlan
from specsplit.orchestrator.decode.loop import Finish
from specsplit.v1 import specsplit_pb2 as pb

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
_FINISH = {Finish.LENGTH: "length", Finish.CONTEXT: "length", Finish.EOS: "stop", Finish.STOP_STRING: "stop"}


class RequestError(Exception):
    """A request the API refuses, in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.error_type, self.code = message, param, status, error_type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    """A request shape that refuses unknown fields and converts no types (the parameter named when it refuses)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object's text, as the API returned it


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatTurn(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted; chat templates of the supported models have no use for it
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(Strict):
    include_usage: bool = False


class Speculation(Strict):
    """The ``speculation`` extra: ``{"enabled": false}`` decodes target-only, ``{"k": N}`` fixes the block size."""

    enabled: bool | None = None
    k: int | None = None


class _Common(Strict):
    """Parameters both endpoints take; specsplit's extensions last."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # unset: 1.0, as OpenAI
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None  # vLLM's: -1 or 0 disables
    repetition_penalty: float | None = None  # vLLM's (transformers' semantics): > 0, 1 disables
    min_tokens: int | None = None  # vLLM's: no EOS before this many new tokens
    ignore_eos: bool | None = None  # vLLM's: do not stop at EOS
    k: int | None = None  # draft block size (0 = no speculation)
    speculation: Speculation | None = None  # {"enabled": false} or {"k": N}: k, as one object
    prompt_logprobs: int | None = None  # vLLM's: score the prompt, this many alternatives a position
    drafter: str | None = None
    adaptive_k: bool | None = None
    overlap: bool | None = None
    draft_probs: bool | None = None
    # vLLM's structured outputs (one at most; chat also takes response_format)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatTurn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, texts, token ids, token-id lists (OpenAI's four)
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TokenizeCompletionRequest(Strict):
    """vLLM's ``/tokenize`` of a raw prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    """vLLM's ``/tokenize`` of a conversation, rendered by the chat template as a chat completion's is."""

    model: str | None = None
    messages: list[ChatTurn] = Field(min_length=1)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int]


def tokenize_message(req: TokenizeCompletionRequest | TokenizeChatRequest) -> pb.GenerateRequest:
    """The prompt or conversation of a ``/tokenize`` request as a ``GenerateRequest`` holds it."""
    if isinstance(req, TokenizeCompletionRequest):
        return pb.GenerateRequest(prompt=req.prompt)
    msg = pb.GenerateRequest(messages=[_chat_message(turn) for turn in req.messages])
    if req.tools:
        msg.tools = json.dumps(req.tools, ensure_ascii=False)
    return msg


_ALTERNATIVES = ("str", "list[str]", "list[TextPart]", "int", "float", "list[int]", "list[list[int]]")


def validate(model_cls: type[Strict], body: Any) -> Any:
    """Parse a JSON body; the first problem becomes a RequestError naming the parameter."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = [str(part) for part in error["loc"]]
        # A union reports each alternative's failure ("stop.str"): name the parameter, not the alternative.
        param = ".".join(p for p in path if p not in _ALTERNATIVES)
        if error["type"] == "extra_forbidden":
            raise RequestError(f"unrecognized request argument supplied: {param}", param) from None
        if error["type"] == "missing":
            raise RequestError(f"missing required parameter: {param}", param) from None
        raise RequestError(f"invalid value for {param}: {error['msg']} (got {_shown(error.get('input'))})", param) from None


def to_generate_request(
    req: _Common, config: OrchestratorConfig, request_id: str, defaults: dict[str, float] | None = None
) -> pb.GenerateRequest:
    """The ``GenerateRequest`` an OpenAI request stands for; refuses what cannot be honoured.

    ``defaults``: the model's sampling defaults (``Orchestrator.sampling_defaults``); an unset temperature or
    top_k takes them (then OpenAI's temperature 1), top_p and repetition_penalty stay unset for the
    orchestrator to fill.
    """
    _refuse_unsupported(req)
    _check_wire_ranges(req)
    sampling = _sampling(req, defaults or {})
    msg = pb.GenerateRequest(sampling=sampling, stop=_stop(req.stop), request_id=request_id)
    _samples(req, config.max_n, msg)
    if isinstance(req, ChatCompletionRequest):
        msg.messages.extend(_chat_message(t) for t in req.messages)
        _tools(req, msg, config)
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, max_name)
        _chat_logprobs(req, msg)
    else:
        set_prompt(msg, completion_prompts(req)[0])
        max_tokens, max_name = req.max_tokens, "max_tokens"
        _completion_logprobs(req, msg)
        if req.echo and (req.logprobs is not None or max_tokens == 0):
            msg.prompt_logprobs = req.logprobs or 0  # echoed tokens carry logprobs; 0 new tokens need a scored prompt
    _prompt_logprobs(req, msg)
    if max_tokens is not None:
        least = 0 if msg.HasField("prompt_logprobs") else 1
        if not least <= max_tokens <= config.max_new_tokens_limit:
            zero = " (0 only with echo)" if least and isinstance(req, CompletionRequest) else ""
            raise RequestError(f"{max_name} must be in [{least}, {config.max_new_tokens_limit}]{zero}, got {max_tokens}",
                               max_name)
        msg.max_new_tokens = max_tokens
    _extensions(req, msg)
    _grammar(req, msg)
    return msg


def _refuse_unsupported(req: _Common) -> None:
    if not isinstance(req, ChatCompletionRequest):
        if req.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if req.best_of not in (None, req.n or 1):
            raise RequestError(
                f"best_of = {req.best_of} is not supported: specsplit returns every sample it generates; send n "
                "(best_of may only equal n)", "best_of")


def _samples(req: _Common, max_n: int, msg: pb.GenerateRequest) -> None:
    """``n``: the samples to generate, 1..max_n (``--max-n``)."""
    if req.n is None:
        return
    if not 1 <= req.n <= max_n:
        raise RequestError(f"n must be in [1, {max_n}] (this server's --max-n), got {_shown(req.n)}", "n")
    msg.n = req.n


# Integer parameters the wire carries in fixed widths, each with the largest value it holds.
_WIRE_MAX = {"top_k": 2**31 - 1, "k": 2**32 - 1}


def _check_wire_ranges(req: _Common) -> None:
    """Refuse an integer too large for its protobuf field, naming it (JSON integers are unbounded)."""
    for name, largest in _WIRE_MAX.items():
        value = getattr(req, name)
        if value is not None and value > largest:
            raise RequestError(f"{name} must be at most {largest}, got {_shown(value)}", name)


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about inputs of any size."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 256 else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sampling(req: _Common, defaults: dict[str, float]) -> pb.SamplingParams:
    temperature = float(defaults.get("temperature", 1.0)) if req.temperature is None else req.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(f"temperature must be a number >= 0 (0 is greedy), got {temperature}", "temperature")
    sampling = pb.SamplingParams(temperature=temperature)
    if req.top_p is not None:
        if not 0 < req.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
        sampling.top_p = req.top_p
    if req.top_k is not None:
        if req.top_k < -1:
            raise RequestError(f"top_k must be >= 0 (0 or -1 disable it), got {req.top_k}", "top_k")
        sampling.top_k = max(req.top_k, 0)
    elif "top_k" in defaults:
        sampling.top_k = max(int(defaults["top_k"]), 0)
    if req.seed is not None:
        if not 0 <= req.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {req.seed}", "seed")
        sampling.seed = req.seed
    _penalties(req, sampling)
    return sampling


def _penalties(req: _Common, sampling: pb.SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2] (0 disables it), got {value}", name)
            setattr(sampling, name, value)
    if req.repetition_penalty is not None:
        if not (math.isfinite(req.repetition_penalty) and req.repetition_penalty > 0):
            raise RequestError(
                f"repetition_penalty must be a number > 0 (1 disables it), got {req.repetition_penalty}",
                "repetition_penalty",
            )
        sampling.repetition_penalty = req.repetition_penalty
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:
            raise RequestError(f"logit_bias keys must be token ids (e.g. \"50256\"), got {key!r}", "logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise RequestError(f"logit_bias[{key}] must be in [-100, 100], got {bias}", "logit_bias")
        sampling.logit_bias[int(key)] = bias
    if req.min_tokens is not None:
        if not 0 <= req.min_tokens < 2**32:
            raise RequestError(f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
        sampling.min_tokens = req.min_tokens
    sampling.ignore_eos = bool(req.ignore_eos)


def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


Prompt = str | list[int]  # one prompt of a completion request: its text, or its token ids


def completion_prompts(req: CompletionRequest) -> list[Prompt]:
    """The prompts of a completion request, in order (OpenAI's four shapes: a string, a list of strings, a list of
    token ids, a list of token-id lists); each becomes a generation of its own."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is an empty list; send a string, a list of strings, a list of token ids or a list "
                           "of token-id lists", "prompt")
    if isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    for i, one in enumerate(prompts):
        if isinstance(one, list):
            where = "prompt" if prompts[0] is prompt else f"prompt[{i}]"
            if not one:
                raise RequestError(f"{where} is an empty list of token ids", "prompt")
            bad = next((j for j, token in enumerate(one) if not 0 <= token < 2**32), None)
            if bad is not None:
                raise RequestError(f"{where}[{bad}] = {_shown(one[bad])} is not a token id", "prompt")
    return prompts


def set_prompt(msg: pb.GenerateRequest, prompt: Prompt) -> None:
    """Put one prompt in ``msg``: text in ``prompt``, token ids in ``prompt_token_ids``."""
    msg.ClearField("prompt")
    msg.ClearField("prompt_token_ids")
    if isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.prompt_token_ids.extend(prompt)


def _chat_logprobs(req: ChatCompletionRequest, msg: pb.GenerateRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    if req.logprobs:
        if not 0 <= (req.top_logprobs or 0) <= 20:
            raise RequestError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
        msg.return_logprobs = True
        msg.top_logprobs = req.top_logprobs or 0


def _completion_logprobs(req: CompletionRequest, msg: pb.GenerateRequest) -> None:
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}", "logprobs")
        msg.return_logprobs = True
        msg.top_logprobs = req.logprobs


def _extensions(req: _Common, msg: pb.GenerateRequest) -> None:
    _speculation(req, msg)
    if req.k is not None:
        if req.k < 0:
            raise RequestError(f"k must be >= 0 (0 = no speculation), got {req.k}", "k")
        msg.k = req.k
    if req.drafter is not None:
        try:
            msg.drafter = drafter_value(req.drafter)
        except ValueError as exc:
            raise RequestError(str(exc), "drafter") from None
    for name in ("adaptive_k", "overlap"):
        if getattr(req, name) is not None:
            setattr(msg, name, getattr(req, name))
    msg.draft_probs = bool(req.draft_probs)


def _prompt_logprobs(req: _Common, msg: pb.GenerateRequest) -> None:
    """vLLM's ``prompt_logprobs``: the prompt scored with this many alternatives a position (whole responses)."""
    if req.prompt_logprobs is None:
        return
    if not 0 <= req.prompt_logprobs <= 20:
        raise RequestError(f"prompt_logprobs must be in [0, 20], got {_shown(req.prompt_logprobs)}", "prompt_logprobs")
    if req.stream:
        raise RequestError("prompt_logprobs come with whole responses: send stream false", "prompt_logprobs")
    if msg.HasField("prompt_logprobs") and msg.prompt_logprobs != req.prompt_logprobs:
        raise RequestError(f"prompt_logprobs ({req.prompt_logprobs}) and echo's logprobs ({msg.prompt_logprobs}) "
                           "score the same prompt: send one count", "prompt_logprobs")
    msg.prompt_logprobs = req.prompt_logprobs


def vllm_prompt_logprobs(items) -> list:
    """``prompt_logprobs`` in vLLM's shape for a run of ``pb.TokenLogprob`` (the first prompt token's unscored):
    per position null or {token id: {"logprob", "rank", "decoded_token"}} for the prompt's token and the most
    likely ones."""
    out = []
    for lp in items:
        if math.isnan(lp.logprob):
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": i + 1, "decoded_token": t.token} for i, t in enumerate(lp.top)}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}
        out.append(entry)
    return out


def _speculation(req: _Common, msg: pb.GenerateRequest) -> None:
    """``speculation``: this request's block size, bounded by the server's (the services' max block) when parsed."""
    spec = req.speculation
    if spec is None:
        return
    if req.k is not None:
        raise RequestError("send the block size as k or as speculation.k, not both", "speculation")
    if spec.enabled is False:
        if spec.k:
            raise RequestError(f"speculation.k = {spec.k} with speculation.enabled false: drop one", "speculation.k")
        msg.k = 0
        msg.adaptive_k = False
    elif spec.k is not None:
        if not 0 <= spec.k <= _WIRE_MAX["k"]:
            raise RequestError(f"speculation.k must be >= 0 (0 = no speculation), got {_shown(spec.k)}", "speculation.k")
        msg.k = spec.k
        msg.adaptive_k = False  # fixed: every round drafts k


def _chat_message(turn: ChatTurn) -> pb.ChatMessage:
    msg = pb.ChatMessage(role="system" if turn.role == "developer" else turn.role, content=turn.text())
    if turn.tool_calls:
        msg.tool_calls = json.dumps([call.model_dump() for call in turn.tool_calls], ensure_ascii=False)
    if turn.tool_call_id is not None:
        msg.tool_call_id = turn.tool_call_id
    return msg


def _tool_plan(req: ChatCompletionRequest, config: OrchestratorConfig) -> ToolPlan | None:
    """What the request's tools and tool_choice make of the generation (``orchestrator.api.tools``); None: no tools."""
    if req.tools is None:
        if req.tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools: send the functions the model may call as tools", "tool_choice")
        return None
    try:
        return tools.plan(req.tools, req.tool_choice, FORMATS[config.tool_call_parser], config.enable_auto_tool_choice)
    except tools.ToolError as exc:
        raise RequestError(str(exc), exc.param) from None


def _tools(req: ChatCompletionRequest, msg: pb.GenerateRequest, config: OrchestratorConfig) -> None:
    plan = _tool_plan(req, config)
    if plan is None:
        return
    msg.tools = plan.tools_json
    if plan.grammar:
        named = _constraints(req)
        if named:
            raise RequestError(f"a forced tool call (tool_choice {req.tool_choice!r}) is its own structured output; "
                               f"send it without {named[0]}", named[0])
        msg.grammar.ebnf = plan.grammar


def _constraints(req: _Common) -> list[str]:
    """The structured output parameters a request sets."""
    named = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(req, name) is not None]
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.get("type", "text") != "text":
        named.insert(0, "response_format")
    return named


def _grammar(req: _Common, msg: pb.GenerateRequest) -> None:
    """``response_format`` or a ``guided_*`` parameter as ``GenerateRequest.grammar`` (compiled, and refused with
    the compiler's reason, by ``requests.parse_request``)."""
    named = _constraints(req)
    response_format = getattr(req, "response_format", None)
    if len(named) > 1:
        raise RequestError(f"send one structured output constraint; got {' and '.join(named)}", named[1])
    if not named:
        return
    if named[0] == "response_format":
        _response_format(response_format, msg.grammar)
    elif named[0] == "guided_json":
        schema = req.guided_json
        msg.grammar.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    elif named[0] == "guided_regex":
        msg.grammar.regex = req.guided_regex
    elif named[0] == "guided_choice":
        msg.grammar.choice.choices.extend(req.guided_choice)
    else:
        msg.grammar.ebnf = req.guided_grammar


def _response_format(value: dict, grammar: pb.Grammar) -> None:
    """OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}}``."""
    kind = value.get("type")
    if kind == "json_object":
        grammar.json_object = True
        return
    if kind != "json_schema":
        raise RequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           "response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise RequestError("response_format.json_schema must be an object with a `schema` object",
                           "response_format.json_schema")
    grammar.json_schema = json.dumps(spec.get("schema", {}))
    strict = spec.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise RequestError(f"response_format.json_schema.strict must be a boolean, got {strict!r}",
                               "response_format.json_schema.strict")
        grammar.strict = strict


# -- responses ----------------------------------------------------------------------------------------------


def finish_reason(value: int) -> str:
    return _FINISH[Finish(value)]


def usage(samples: Sequence[pb.GenerationStats], per_prompt: int = 0) -> dict:
    """OpenAI's token counts (each prompt once, every sample's completion), plus the speculative stats of the
    generation under ``speculative``: of the samples together for n > 1 (counts summed, rates over the sums,
    each sample's seed in ``seeds``). ``samples`` are prompt-major, ``per_prompt`` of each prompt (0: one prompt)."""
    prompt = sum(s.prompt_tokens for s in samples[:: per_prompt or len(samples)])
    completion = sum(s.new_tokens for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculative": _speculative(samples),
    }


_SUMMED = ("rounds", "drafted_tokens", "accepted_tokens", "overlap_hits", "forced_tokens", "draft_fallback_rounds",
           "target_reopens")


def _speculative(samples: Sequence[pb.GenerationStats]) -> dict:
    first = samples[0]
    sums = {name: sum(getattr(s, name) for s in samples) for name in _SUMMED}
    rounds, drafted = sums["rounds"], sums["drafted_tokens"]
    wall = max(s.wall_s for s in samples)

    def per_round(name: str) -> float:  # a per-round mean over every sample's rounds
        return sum(getattr(s, name) * s.rounds for s in samples) / rounds if rounds else getattr(first, name)

    out = {
        "drafter": DrafterKind(first.drafter).name.lower() if first.drafter else None,
        "verification": VerificationMode(first.mode).name.lower() if first.mode else None,
        "k": first.k,
        "adaptive_k": first.adaptive_k,
        "mean_k": round(per_round("mean_k"), 3),
        **sums,
        "acceptance_rate": round(sums["accepted_tokens"] / drafted if drafted else 0.0, 4),
        "mean_accepted_length": round(per_round("mean_accepted_length"), 4),
        # committed tokens of every sample over the longest sample's time
        "tokens_per_s": round(sum(s.tokens_per_s * s.wall_s for s in samples) / wall if wall else 0.0, 3),
        "wall_s": round(wall, 4),
        "seed": first.seed,
    }
    if len(samples) > 1:
        out["seeds"] = [s.seed for s in samples]
    return out


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items) -> dict:
    """``choices[].logprobs`` of the chat API for a run of ``pb.TokenLogprob``."""
    return {"content": [
        {**_entry(lp.token, lp.logprob), "top_logprobs": [_entry(t.token, t.logprob) for t in lp.top]} for lp in items
    ]}


def completion_logprobs(items, text_offset: int) -> dict:
    """``choices[].logprobs`` of the completions API; offsets count from the start of the text (with echo, the
    prompt's). An echoed prompt's first token has no logprob (NaN in ``pb.TokenLogprob``): null, as OpenAI's."""
    tokens, offsets = [], []
    for lp in items:
        offsets.append(text_offset)
        tokens.append(lp.token)
        text_offset += len(lp.token)
    unscored = [math.isnan(lp.logprob) for lp in items]
    return {
        "tokens": tokens,
        "token_logprobs": [None if none else lp.logprob for lp, none in zip(items, unscored)],
        "top_logprobs": [None if none else {t.token: t.logprob for t in lp.top} for lp, none in zip(items, unscored)],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    """One sample's whole answer: its text, its tokens' logprobs, why it ended."""

    text: str
    logprobs: list
    finish: str
    prompt_logprobs: tuple = ()  # pb.TokenLogprob of the prompt, when the request asked (vLLM's extra)


class ResponseShape:
    """One request's response objects, whole or as stream chunks (the subclasses: one per endpoint); a
    request of n samples has choices 0..n-1."""

    whole_object = ""
    chunk_object = ""

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.logprobs = logprobs
        self.prompt_logprobs = False  # the request asked for vLLM's prompt_logprobs (whole responses only)
        self.samples_per_prompt = 0  # choices of each prompt of a list (prompt-major); 0: one prompt
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def opening(self, n: int = 1) -> list[dict]:
        """Chunks sent before the first text."""
        return []

    def chunk(self, text: str, logprobs, finish: str | None, index: int = 0) -> dict:
        return self._envelope(self.chunk_object, [self._choice(index, text, logprobs, finish, delta=True)])

    def usage_chunk(self, samples: Sequence[pb.GenerationStats]) -> dict:
        return {**self._envelope(self.chunk_object, []), "usage": usage(samples, self.samples_per_prompt)}

    def whole(self, choices: Sequence[Choice], samples: Sequence[pb.GenerationStats]) -> dict:
        """The response of every sample (``choices[i]`` is sample i's)."""
        made = [self._choice(i, c.text, c.logprobs, c.finish, delta=False) for i, c in enumerate(choices)]
        whole = {**self._envelope(self.whole_object, made), "usage": usage(samples, self.samples_per_prompt)}
        if self.prompt_logprobs:  # vLLM: on each choice of a completion, once on a chat response
            if isinstance(self, CompletionShape):
                for choice, c in zip(made, choices):
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs)
            else:
                whole["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs)
        return whole

    def _choice(self, index: int, text: str, logprobs, finish: str | None, delta: bool) -> dict:
        raise NotImplementedError


class ChatShape(ResponseShape):
    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self, n: int = 1) -> list[dict]:
        return [self._envelope(self.chunk_object, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]) for i in range(n)]

    def _choice(self, index: int, text: str, logprobs, finish: str | None, delta: bool) -> dict:
        content = ({"content": text} if text or not finish else {}) if delta else {"role": "assistant",
                                                                                   "content": text}
        return {"index": index, "delta" if delta else "message": content,
                "logprobs": chat_logprobs(logprobs) if self.logprobs else None, "finish_reason": finish}


class CompletionShape(ResponseShape):
    whole_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        super().__init__(response_id, model, logprobs)
        self.text_offsets: dict[int, int] = {}  # choice index -> characters of its completion sent so far

    def _choice(self, index: int, text: str, logprobs, finish: str | None, delta: bool) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if self.logprobs:
            offset = self.text_offsets.get(index, 0) if delta else 0
            choice["logprobs"] = completion_logprobs(logprobs, offset)
            self.text_offsets[index] = offset + sum(len(lp.token) for lp in logprobs)
        return choice
