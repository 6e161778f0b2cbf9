"""Validation of public ``GenerateRequest`` messages into ``GenerationRequest``.

Every field is checked; a bad one raises ``errors.InvalidArgument`` with a
message that names the field and the accepted range.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import replace

from specsplit.lmkit import errors
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.wire import MAX_TOP_LOGPROBS, mode_from_proto, sampling_from_proto
from specsplit.orchestrator.api.config import MAX_TREE_BRANCHES
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
from specsplit.orchestrator.api.limits import check_prompt_size
from specsplit.orchestrator.api.tools import parse_tools, template_calls
from specsplit.orchestrator.decode.grammar import GrammarError, GrammarKind, GrammarSpec
from specsplit.v1 import specsplit_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID = 128
_GRAMMAR_NAMES = {"json_schema": "the JSON schema (response_format json_schema / guided_json)",
                  "json_object": "the JSON object grammar", "regex": "the regex (guided_regex)",
                  "choice": "the choices (guided_choice)", "ebnf": "the EBNF grammar (guided_grammar)"}
_REQUEST_ID_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


async def parse_request(msg: pb.GenerateRequest, orch: Orchestrator) -> tuple[GenerationRequest, list[int]]:
    """Validate a request against the server's limits; return it with the prompt's token ids.

    The prompt's size is checked before it is tokenized, and it is tokenized off the event loop.
    """
    config = orch.config
    messages = _messages(msg)
    check_prompt_size(msg.prompt + msg.tools + grammar_text(msg), _sized(msg.messages), orch.prompt_byte_limit)
    tools = _tools(msg)
    prompt_logprobs = msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > MAX_TOP_LOGPROBS:
        raise errors.InvalidArgument(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
    max_new = msg.max_new_tokens if msg.HasField("max_new_tokens") else config.default_max_new_tokens
    if not (0 if prompt_logprobs is not None else 1) <= max_new <= config.max_new_tokens_limit:
        raise errors.InvalidArgument(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}] (0 only with "
                                     f"prompt_logprobs, to score the prompt alone), got {max_new}")
    sampling = sampling_from_proto(with_defaults(msg.sampling, orch.sampling_defaults))
    if not msg.sampling.HasField("seed"):
        sampling = replace(sampling, seed=secrets.randbelow(2**63))
    stop = tuple(msg.stop)
    if len(stop) > config.max_stop_strings:
        raise errors.InvalidArgument(f"{len(stop)} stop strings sent; at most {config.max_stop_strings} are allowed")
    if any(not s for s in stop):
        raise errors.InvalidArgument("stop strings must not be empty")
    if any(len(s) > config.max_stop_chars for s in stop):
        longest = max(len(s) for s in stop)
        raise errors.InvalidArgument(f"a stop string is {longest} characters; at most {config.max_stop_chars} are allowed")
    k = msg.k if msg.HasField("k") else config.default_k
    if k > orch.max_block:
        raise errors.InvalidArgument(f"k = {k} is larger than the services' max block {orch.max_block}")
    drafter = _drafter(msg.drafter, config.default_drafter)
    if k > 0 and orch.draft is not None and drafter not in orch.drafters:
        available = ", ".join(d.name for d in orch.drafters)
        raise errors.InvalidArgument(f"drafter {drafter.name} is not served by the draft service (it runs {available})")
    sampling_mode = _sampling_mode(msg, sampling)
    wants_probs = msg.draft_probs or sampling_mode is VerificationMode.DRAFT_PROBS
    traits = orch.drafter_traits.get(drafter)
    if wants_probs and not (traits is not None and traits.has_probs):
        names = "/".join(sorted(t.kind.name for t in orch.drafter_traits.values() if t.has_probs)) or "model"
        raise errors.InvalidArgument(f"draft_probs needs a {names} drafter; {drafter.name} sends token ids only")
    grammar = await _grammar(msg, orch, wants_probs)
    chain = _chain(msg.chain, drafter, orch.drafters if k > 0 and orch.draft is not None else None)
    top_logprobs = _top_logprobs(msg)
    request_id = _request_id(msg.request_id)
    _check_bias_ids(sampling, orch.target.info.vocab_size)
    prompt_ids = _token_prompt(msg, orch.target.info.vocab_size) if msg.prompt_token_ids else \
        await orch.tokenize(msg.prompt, msg.chat, messages, tools)
    limit = orch.target.info.max_context
    if limit and len(prompt_ids) >= limit:
        raise errors.InvalidArgument(
            f"the prompt is {len(prompt_ids)} tokens but the model's context is {limit}; shorten the prompt"
        )
    adaptive = msg.adaptive_k if msg.HasField("adaptive_k") else config.default_adaptive_k
    overlap = msg.overlap if msg.HasField("overlap") else config.default_overlap
    branches = msg.tree_branches if msg.HasField("tree_branches") else config.default_tree_branches
    if not 1 <= branches <= MAX_TREE_BRANCHES:
        raise errors.InvalidArgument(f"tree_branches must be in [1, {MAX_TREE_BRANCHES}] (1 = chains only), got {branches}")
    request = GenerationRequest(
        msg.prompt, msg.chat, max_new, sampling, stop, k, drafter, msg.draft_probs, adaptive, chain, overlap,
        messages=messages, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs, request_id=request_id,
        sampling_mode=sampling_mode,
        tree_branches=branches, grammar=grammar,
    )
    if k > 0 and orch.draft is not None:
        orch.check_features(request)
    return request, prompt_ids


async def tokenized(msg: pb.GenerateRequest, orch: Orchestrator, add_special_tokens: bool | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a request's prompt or conversation (with its tools) as a generation reads them, checked
    and sized as ``parse_request`` checks them (``/tokenize``); the options as ``Orchestrator.encode`` takes
    them."""
    messages = _messages(msg)
    check_prompt_size(msg.prompt + msg.tools, _sized(msg.messages), orch.prompt_byte_limit)
    return await orch.tokenize(msg.prompt, msg.chat, messages, _tools(msg), add_special_tokens, add_generation_prompt)


def sample_count(msg: pb.GenerateRequest, max_n: int) -> int:
    """GenerateRequest.n checked against the server's --max-n (unset or 0: 1)."""
    n = msg.n if msg.HasField("n") and msg.n else 1
    if n > max_n:
        raise errors.InvalidArgument(f"n = {n} samples asked for; this server allows 1 to {max_n} (--max-n)")
    return n


def with_defaults(sampling: pb.SamplingParams, defaults: dict[str, float]) -> pb.SamplingParams:
    """The model's defaults for the fields a request left unset; on gRPC only top_p and repetition_penalty
    can be told unset (proto3 cannot tell temperature or top_k 0 from unset: they are as sent)."""
    filled = pb.SamplingParams()
    filled.CopyFrom(sampling)
    for name in ("top_p", "repetition_penalty"):
        if not sampling.HasField(name) and name in defaults:
            setattr(filled, name, defaults[name])
    return filled


def _check_bias_ids(sampling: SamplingParams, vocab_size: int) -> None:
    bad = [token for token, _ in sampling.logit_bias if vocab_size and token >= vocab_size]
    if bad:
        raise errors.InvalidArgument(
            f"logit_bias names token ids {bad[:8]} outside the model's vocabulary [0, {vocab_size}); "
            "send ids the tokenizer produces"
        )


def _messages(msg: pb.GenerateRequest) -> tuple[dict, ...]:
    """The conversation, checked, as chat templates read it; a request sends one of prompt, prompt_token_ids and
    messages."""
    sent = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(msg, name)]
    if len(sent) > 1:
        raise errors.InvalidArgument(f"send one of prompt, prompt_token_ids and messages, not {' and '.join(sent)}")
    if not sent:
        raise errors.InvalidArgument("prompt is empty; send the text to continue (or prompt_token_ids, or messages "
                                     "for a conversation)")
    return tuple(_turn(i, turn) for i, turn in enumerate(msg.messages))


def _token_prompt(msg: pb.GenerateRequest, vocab_size: int) -> list[int]:
    """``prompt_token_ids`` as the target takes them, each checked to be a token of its vocabulary."""
    if msg.chat:
        raise errors.InvalidArgument("chat wraps a text prompt in the chat template; prompt_token_ids are fed as they "
                                     "are: send the templated ids, or the prompt text with chat")
    ids = list(msg.prompt_token_ids)
    if vocab_size:
        for index, token in enumerate(ids):
            if token >= vocab_size:
                raise errors.InvalidArgument(f"prompt_token_ids[{index}] = {token} is outside the model's vocabulary "
                                             f"[0, {vocab_size}); send ids the target's tokenizer produces")
    return ids


def _turn(i: int, turn: pb.ChatMessage) -> dict:
    if turn.role not in CHAT_ROLES:
        raise errors.InvalidArgument(f"messages[{i}].role is {turn.role!r}; use one of {', '.join(CHAT_ROLES)}")
    rendered: dict = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        if turn.role != "assistant":
            raise errors.InvalidArgument(f"messages[{i}].tool_calls is for assistant turns; this one is {turn.role}")
        try:
            rendered["tool_calls"] = template_calls(turn.tool_calls)
        except ValueError as exc:
            raise errors.InvalidArgument(f"messages[{i}].tool_calls is not a JSON array of tool calls: {exc}") from None
    if turn.tool_call_id:
        if turn.role != "tool":
            raise errors.InvalidArgument(f"messages[{i}].tool_call_id is for tool turns; this one is {turn.role}")
        rendered["tool_call_id"] = turn.tool_call_id
    return rendered


def _sized(messages) -> list[tuple[str, str]]:
    """What a conversation's size is counted over: each turn's role and its texts."""
    return [(turn.role, turn.content + turn.tool_calls + turn.tool_call_id) for turn in messages]


def _tools(msg: pb.GenerateRequest) -> list[dict]:
    """GenerateRequest.tools checked (the chat template renders them); empty: none."""
    if not msg.tools:
        return []
    if not (msg.messages or msg.chat):
        raise errors.InvalidArgument("tools are rendered by the chat template: send messages (or chat) with them")
    try:
        tools = json.loads(msg.tools)
        parse_tools(tools)
    except ValueError as exc:
        raise errors.InvalidArgument(f"tools is not a JSON array of function tools: {exc}") from None
    return tools


def grammar_text(msg: pb.GenerateRequest) -> str:
    """The text of the request's grammar (schema, regex, choices or EBNF), which the size check counts."""
    if not msg.HasField("grammar"):
        return ""
    kind = msg.grammar.WhichOneof("kind")
    if kind == "choice":
        return "".join(msg.grammar.choice.choices)
    return getattr(msg.grammar, kind) if kind in ("json_schema", "regex", "ebnf") else ""


async def _grammar(msg: pb.GenerateRequest, orch: Orchestrator, wants_probs: bool):
    """GenerateRequest.grammar compiled off the event loop (None: free text); a grammar that does not compile
    names xgrammar's reason, one that compiles too long names the bound."""
    if not msg.HasField("grammar"):
        return None
    spec = grammar_spec(msg.grammar)
    if wants_probs:
        raise errors.InvalidArgument("a grammar is not verified with draft_probs (DRAFT_PROBS); use TOKEN_ONLY or COUPLED")
    if msg.sampling.ignore_eos or msg.sampling.min_tokens:
        # Where the grammar is complete it allows only the end of text, which these would ban: no token left.
        raise errors.InvalidArgument("a grammar ends the text itself; send it without ignore_eos and min_tokens")
    what = _GRAMMAR_NAMES[msg.grammar.WhichOneof("kind")]
    try:
        return await orch.compile_grammar_off_loop(spec)
    except GrammarError as exc:
        raise errors.InvalidArgument(f"{what} does not compile: {exc}") from None
    except TimeoutError:
        raise errors.InvalidArgument(
            f"{what} took over {orch.config.grammar_timeout_s:g} s to compile (--grammar-timeout-s); simplify it"
        ) from None


def grammar_spec(msg: pb.Grammar) -> GrammarSpec:
    """The grammar a ``pb.Grammar`` names, checked for what xgrammar cannot say (an empty choice list)."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise errors.InvalidArgument("grammar is set but names none: send json_schema, json_object, regex, choice or ebnf")
    if kind != "json_schema" and msg.HasField("strict"):
        raise errors.InvalidArgument(f"grammar.strict is for json_schema; grammar is {kind}")
    if kind == "choice":
        if not msg.choice.choices or not all(msg.choice.choices):
            raise errors.InvalidArgument("grammar.choice needs at least one choice, none of them empty")
        return GrammarSpec(GrammarKind.CHOICE, choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    source = getattr(msg, kind)
    if not source:
        raise errors.InvalidArgument(f"grammar.{kind} is empty")
    return GrammarSpec(GrammarKind[kind.upper()], source, strict=msg.strict if msg.HasField("strict") else True)


def _top_logprobs(msg: pb.GenerateRequest) -> int | None:
    if not msg.return_logprobs:
        if msg.top_logprobs:
            raise errors.InvalidArgument("top_logprobs needs return_logprobs")
        return None
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise errors.InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {msg.top_logprobs}")
    return msg.top_logprobs


def _request_id(value: str) -> str:
    """The caller's id, checked (it goes into log lines), or a new one."""
    if not value:
        return f"req-{secrets.token_hex(8)}"
    if len(value) > MAX_REQUEST_ID or not set(value) <= _REQUEST_ID_CHARS:
        raise errors.InvalidArgument(
            f"request_id must be 1..{MAX_REQUEST_ID} printable ASCII characters without spaces, got {value[:40]!r}"
        )
    return value
def _sampling_mode(msg: pb.GenerateRequest, sampling: SamplingParams) -> VerificationMode | None:
    """GenerateRequest.mode, checked against the temperature and draft_probs (None: the server's default)."""
    if msg.mode == pb.VERIFICATION_MODE_UNSPECIFIED:
        return None
    mode = mode_from_proto(msg.mode)
    if mode is VerificationMode.GREEDY or sampling.greedy:
        raise errors.InvalidArgument(
            f"mode {mode.name} with temperature {sampling.temperature}: temperature 0 is greedy and needs no mode; "
            "for sampling send temperature > 0 with TOKEN_ONLY, DRAFT_PROBS or COUPLED"
        )
    if msg.draft_probs and mode is not VerificationMode.DRAFT_PROBS:
        raise errors.InvalidArgument(f"draft_probs asks for DRAFT_PROBS verification but mode is {mode.name}; send one")
    return mode


def _chain(values, drafter: DrafterKind, served: list[DrafterKind] | None) -> tuple[DrafterKind, ...]:
    """Validate GenerateRequest.chain (``served`` is None when no draft will run)."""
    if not values:
        return ()
    if drafter is not DrafterKind.CHAIN:
        raise errors.InvalidArgument(f"chain is only for the CHAIN drafter, but drafter is {drafter.name}")
    chain = tuple(_drafter(v, DrafterKind.CHAIN) for v in values)
    if DrafterKind.CHAIN in chain or len(set(chain)) != len(chain):
        raise errors.InvalidArgument("chain must list distinct member drafters (not CHAIN), e.g. [NGRAM, LAYERSKIP]")
    missing = [d.name for d in chain if served is not None and d not in served]
    if missing:
        raise errors.InvalidArgument(f"chain members {missing} are not served by the draft service")
    return chain


def _drafter(value: int, default: DrafterKind) -> DrafterKind:
    if value == pb.DRAFTER_KIND_UNSPECIFIED:
        return default
    try:
        return DrafterKind(value)
    except ValueError:
        names = ", ".join(f"{k.name} ({k.value})" for k in DrafterKind)
        raise errors.InvalidArgument(f"drafter {value} is unknown; send one of {names}") from None
