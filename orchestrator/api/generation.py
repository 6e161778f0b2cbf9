"""The orchestrator: owns sessions, tokenizes once, drives the speculative loop, streams text.

Only the orchestrator sees text. It connects to one target and optionally one
draft service, refuses a pair whose vocabularies differ, and turns each
request into a session on both services that lives exactly as long as the
generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Sequence

from specsplit.lmkit import errors, logs, models
from specsplit.lmkit.kinds import TREE_MODES, DrafterKind, DrafterTraits, VerificationMode, default_chain
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.wire import sampling_to_proto
from specsplit.orchestrator.api import metrics
from specsplit.orchestrator.api.config import DEFAULT_SAMPLING_MODE, OrchestratorConfig
from specsplit.orchestrator.api.detok import IncrementalDetokenizer, StopMatcher, TokenTextAlignment
from specsplit.orchestrator.api.limits import Slots, longest_token_bytes, prompt_byte_limit
from specsplit.orchestrator.api.tool_parsers import FORMATS
from specsplit.orchestrator.api.tools import inline_tools, renders_tools
from specsplit.orchestrator.decode.grammar import Constraint, Grammars, GrammarSpec
from specsplit.orchestrator.decode.links import NO_DRAFT, DraftLink, TargetLink
from specsplit.orchestrator.decode.loop import Finish, LoopConfig, LoopStats, speculative_decode
from specsplit.orchestrator.decode.mux import Mux
from specsplit.orchestrator.decode.peers import Pool, draft_pool, peer_tokens, target_pool
from specsplit.orchestrator.decode.policy.controller import AdaptiveK, Controller, Drafters, FixedK
from specsplit.orchestrator.decode.policy.measure import AcceptRule, Measurements
from specsplit.v1 import specsplit_pb2 as pb

log = logging.getLogger(__name__)


class DeadlineExceeded(Exception):
    """A generation ran past the server's ``max_generation_s``."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request (see ``specsplit.orchestrator.api.requests``)."""

    prompt: str
    chat: bool
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    k: int
    drafter: DrafterKind
    draft_probs: bool
    adaptive_k: bool = False  # k is then the per-round upper bound
    chain: tuple[DrafterKind, ...] = ()  # CHAIN members in order; empty = default_chain of what the draft serves
    overlap: bool = False  # draft block i+1 while the target verifies block i
    second_guess: bool = True  # with overlap, also draft past the drafter's second guess where that is free
    messages: tuple[dict, ...] = ()  # turns for the chat template (``Orchestrator.encode``); prompt is then ""
    top_logprobs: int | None = None  # None: no logprobs; else each token's and this many alternatives
    prompt_logprobs: int | None = None  # None: the prompt is not scored; else scored with this many alternatives
    request_id: str = ""  # in every log line of the generation
    # How sampled blocks are verified (TOKEN_ONLY, DRAFT_PROBS, COUPLED); None: DRAFT_PROBS when
    # draft_probs is set, else the server's default sampling mode. Greedy requests verify GREEDY.
    sampling_mode: VerificationMode | None = None
    tree_branches: int = 1  # continuations a round may verify as a token tree; 1 = chains only
    grammar: object | None = None  # the compiled grammar the output follows (orchestrator.decode.grammar); None: free text


def reserve_tokens(prompt_ids: Sequence[int], request: GenerationRequest, max_block: int) -> int:
    """What a session can ever hold, reserved against a service's KV budget (``TargetOpen``/``DraftOpen``
    ``.reserve_tokens``, a uint32): the prompt, every new token, and the service's largest block beyond them (the
    target's last verified block; the draft's longest proposal with the guess it drafts ahead)."""
    return min(len(prompt_ids) + request.max_new_tokens + max_block + 1, 2**32 - 1)


@dataclass(frozen=True)
class GenerationEvent:
    text: str
    token_ids: list[int]
    finish: Finish | None = None
    stats: pb.GenerationStats | None = None
    loop: LoopStats | None = None  # per-round figures, on the last event (benchmarks read them)
    logprobs: tuple[pb.TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    # On a sample's first event, when the request asked (GenerateResponse.prompt_logprobs): one per prompt
    # token, the first (which nothing precedes) with a NaN logprob and no alternatives.
    prompt_logprobs: tuple[pb.TokenLogprob, ...] = ()


@dataclass(frozen=True)
class PromptFork:
    """A sample's part in sharing its prompt (``orchestrator.api.samples``): sample 0 (``leader``) publishes its
    target and draft sessions' ids in ``source`` once open ("" where it has none); the others open forked
    from them."""

    source: asyncio.Future  # of (target session id, draft session id)
    leader: bool

    def opened(self, target_id: str, draft_id: str) -> None:
        if self.leader and not self.source.done():
            self.source.set_result((target_id, draft_id))

    async def source_ids(self) -> tuple[str, str]:
        """The sessions to fork from; a cancelled wait leaves ``source`` for the other samples."""
        return await asyncio.shield(self.source)


def verification_mode(request: GenerationRequest, default: VerificationMode = DEFAULT_SAMPLING_MODE) -> VerificationMode:
    """The one place a request's mode is decided: greedy for temperature 0, else the sampling mode asked for."""
    if request.sampling.greedy:
        return VerificationMode.GREEDY
    if request.sampling_mode is not None:
        return request.sampling_mode
    return VerificationMode.DRAFT_PROBS if request.draft_probs else default


# Chat templates shipped with specsplit, by the name --chat-template takes for them: ChatML (the default model's
# format) that renders tools and tool turns as Hermes 2 Pro and Qwen do (the ``hermes`` tool-call parser's format).
BUNDLED_TEMPLATES = {"hermes-tools": Path(__file__).parent / "templates" / "hermes_tools.jinja"}


def read_chat_template(path: str) -> str:
    """The Jinja chat template of ``--chat-template``: a file, or the name of a bundled one where no such file
    exists; ValueError saying what is wrong with the file."""
    if path in BUNDLED_TEMPLATES and not Path(path).exists():
        path = str(BUNDLED_TEMPLATES[path])
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: cannot read it ({exc})") from None
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {path}: not a Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def shared_stream(replica, call_type, calls_type, info: pb.ModelInfo) -> None:
    """Give ``replica`` a shared Sessions stream (``orchestrator.decode.mux``), its messages bounded as ``info`` says."""
    replica.mux = Mux(replica.stub.Sessions, call_type, calls_type, replica.kind)
    replica.mux.max_bytes = info.max_request_bytes


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tokenizer, target: Pool, draft: Pool | None):
        self.config = config
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.eos_ids = frozenset(models.eos_ids(config.tokenizer, tokenizer))
        # What a request that leaves these unset samples with (docs/http-api.md, "Model defaults"): the target
        # model's, as the target reports them; a target that reports none (an older build): the tokenizer folder's.
        self.sampling_defaults: dict[str, float] = {}
        if config.generation_config == "auto":
            info = target.info
            reported = info.sampling_defaults if info is not None and info.HasField("sampling_defaults") else None
            self.sampling_defaults = ({f.name: v for f, v in reported.ListFields()} if reported is not None
                                      else models.sampling_defaults(config.tokenizer))
        # The drafters the draft serves and what each can do, as it reports them.
        self.drafter_traits: dict[DrafterKind, DrafterTraits] = {
            t.kind: t for t in (drafter_traits(draft.info) if draft is not None else ())
        }
        # One target and one draft: their costs, links and acceptance, measured from every session, serve each.
        self.measured = Measurements()
        # Generations in flight over every API, in all and per caller; bounded by config.max_concurrent*.
        self.slots = Slots(config.max_concurrent, config.max_concurrent_per_caller)
        # The UTF-8 bytes of the vocabulary's longest token: bounds a prompt and a Generate message (one scan).
        self.longest_token_bytes = longest_token_bytes(tokenizer)
        self.prompt_byte_limit = prompt_byte_limit(
            config.max_prompt_bytes, target.info.max_context, self.longest_token_bytes
        )
        # Tokenizing and rendering chat templates happen here, never on the event loop that answers /health.
        self._tokenize_pool = ThreadPoolExecutor(config.tokenize_threads, thread_name_prefix="tokenize")
        self.in_flight = 0  # generations running (admitted or not): what decides a new session's stream
        self._grammars: Grammars | None = None  # built at the first grammar (xgrammar's tokenizer tables)

    @classmethod
    async def connect(cls, config: OrchestratorConfig) -> "Orchestrator":
        """Connect to the services, check that they share a vocabulary, load the tokenizer."""
        tokenizer = models.load_tokenizer(config.tokenizer)
        if config.chat_template:
            tokenizer.chat_template = read_chat_template(config.chat_template)
        tokens = peer_tokens(config.peer_token_file)
        target = target_pool(config.target_address, config.peer_tls, tokens, config.resolve_every_s)
        draft = (draft_pool(config.draft_address, config.peer_tls, tokens, config.resolve_every_s)
                 if config.draft_address else None)
        target_info = await target.fetch_info(config.connect_timeout_s)
        target.watch_load(config.load_every_s)
        if config.shared_stream_from:  # a Sessions stream per replica, bounded alike (a pool serves one model)
            target.prepare(lambda replica: shared_stream(replica, pb.TargetCall, pb.TargetCalls, target_info))
        check_pair(
            "tokenizer", config.tokenizer, models.vocab_fingerprint(tokenizer), "target", target_info
        )
        if draft is not None:
            draft_info = await draft.fetch_info(config.connect_timeout_s)
            draft.watch_load(config.load_every_s)
            if config.shared_stream_from:
                draft.prepare(lambda replica: shared_stream(replica, pb.DraftCall, pb.DraftCalls, draft_info))
            if draft_info.vocab_fingerprint:  # model-free drafters accept any vocabulary
                check_pair("target", target_info.model_id, target_info.vocab_fingerprint, "draft", draft_info)
                if draft_info.vocab_size != target_info.vocab_size:
                    raise ValueError(
                        f"draft {draft_info.model_id} has {draft_info.vocab_size} output rows but target "
                        f"{target_info.model_id} has {target_info.vocab_size}; they must match"
                    )
        log.info(
            "target %s (tp=%d, %s) at %s; draft %s",
            target_info.model_id,
            target_info.tp_degree,
            target_info.device,
            config.target_address,
            f"{draft.info.model_id} at {config.draft_address}" if draft else "none (target-only)",
        )
        return cls(config, tokenizer, target, draft)

    async def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await self.target.close()
        if self.draft is not None:
            await self.draft.close()

    @property
    def max_block(self) -> int:
        limits = [self.target.info.max_block]
        if self.draft is not None:
            limits.append(self.draft.info.max_block)
        return min(limits)

    @property
    def drafters(self) -> list[DrafterKind]:
        return list(self.drafter_traits)

    @property
    def active(self) -> int:
        return self.slots.active

    def admit(self, caller: str = "", count: int = 1, what: str = ""):
        """Hold ``count`` generation slots for ``caller`` (``with``; one per sample, ``what`` naming them when they
        are not a prompt's n samples); ResourceExhausted when they are not all free to it."""
        return self.slots.hold(caller, count, what)

    async def tokenize(self, prompt: str, chat: bool, messages: Sequence[dict] = (), tools: Sequence[dict] = (),
                       add_special_tokens: bool | None = None, add_generation_prompt: bool = True) -> list[int]:
        """``encode`` on the tokenizer threads, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.encode, prompt, chat, messages, tools,
                                          add_special_tokens, add_generation_prompt)

    def compile_grammar(self, spec: GrammarSpec):
        """A request's grammar compiled for this tokenizer and the target's vocabulary (GrammarError if it
        does not compile). Blocking: requests compile through ``compile_grammar_off_loop``."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.target.info.vocab_size, self.eos_ids)
        return self._grammars.compile(spec)

    async def compile_grammar_off_loop(self, spec: GrammarSpec):
        """``compile_grammar`` on the tokenizing threads, so the event loop keeps serving; a grammar still compiling
        after ``--grammar-timeout-s`` raises TimeoutError (its thread finishes on its own, its result unused)."""
        loop = asyncio.get_running_loop()
        compiling = loop.run_in_executor(self._tokenize_pool, self.compile_grammar, spec)
        bound = self.config.grammar_timeout_s
        return await (asyncio.wait_for(compiling, bound) if bound else compiling)

    def encode(self, prompt: str, chat: bool, messages: Sequence[dict] = (), tools: Sequence[dict] = (),
               add_special_tokens: bool | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a raw prompt, of a prompt as one user turn (``chat``), or of a conversation (turns as chat
        templates read them: ``role``, ``content`` and, where sent, ``tool_calls`` and ``tool_call_id``), with the
        ``tools`` the template renders. ``add_special_tokens``: the tokenizer's own special tokens (BOS, say) around
        the text; unset, a raw prompt gets them and a conversation does not (its template writes its own).
        ``add_generation_prompt``: the template's header of the assistant's turn after the turns."""
        if not (chat or messages):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False))
        turns = list(messages) or [{"role": "user", "content": prompt}]
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise errors.InvalidArgument(
                f"the tokenizer of {self.config.tokenizer} has no chat template; send a raw prompt (chat off) instead"
            )
        uses_tools = tools or any(turn["role"] == "tool" or "tool_calls" in turn for turn in turns)
        if uses_tools and not renders_tools(template):  # written into the turns instead, in the parser's format
            turns, tools = inline_tools(turns, tools, FORMATS[self.config.tool_call_parser]), ()
        from jinja2 import TemplateError

        tokenize = not add_special_tokens
        try:
            ids = self.tokenizer.apply_chat_template(
                turns, tools=list(tools) or None, add_generation_prompt=add_generation_prompt, tokenize=tokenize
            )
        except TemplateError as exc:  # templates refuse e.g. a role they do not know, or turns out of order
            raise errors.InvalidArgument(f"the model's chat template refused the messages: {exc}") from None
        if not tokenize:  # the rendered text, the tokenizer's special tokens added as to a raw prompt
            return list(self.tokenizer.encode(ids, add_special_tokens=True))
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def generate(
        self, request: GenerationRequest, prompt_ids: list[int], arrived: float | None = None,
        fork: PromptFork | None = None,
    ) -> AsyncIterator[GenerationEvent]:
        """Stream committed text; the last event carries the finish reason and stats.

        ``arrived``: when the request reached the server (``time.perf_counter()``),
        the start of its queue time, time to first token and end-to-end latency.
        ``fork``: this generation is one of several samples of the prompt (``orchestrator.api.samples``).
        """
        timer = metrics.RequestTimer(arrived)
        start = time.perf_counter()
        request = replace(request, sampling=self.session_sampling(request.sampling, prompt_ids))
        stats = LoopStats()
        mode = verification_mode(request, self.config.default_sampling_mode)
        sampling = sampling_to_proto(request.sampling)
        policy = self.config.link_policy
        logprobs = request.top_logprobs is not None
        speculating = request.k > 0 and self.draft is not None
        # A feature drafter (EAGLE) reads the target's hidden states of these layers, sent with each result.
        layers = self.feature_traits(request).feature_layers if speculating else ()
        successors_k = self.successors_k(request) if speculating else 0
        shared = self.shares_streams()
        reserve = reserve_tokens(prompt_ids, request, self.target.info.max_block)
        target = TargetLink(
            self.target,
            lambda sid, tokens: pb.TargetOpen(
                session_id=sid, tokens=tokens, sampling=sampling, mode=mode.value, return_logprobs=logprobs,
                top_logprobs=request.top_logprobs or 0, feature_layers=layers,
                reserve_tokens=reserve, successors_k=successors_k,
                **({} if request.prompt_logprobs is None else {"prompt_logprobs": request.prompt_logprobs}),
            ),
            policy,
            self.measured.costs.links.target,
            shared,
        )
        controller = self.controller(request, mode, speculating)
        draft = NO_DRAFT
        if speculating:
            draft_reserve = reserve_tokens(prompt_ids, request, self.draft.info.max_block)
            draft = DraftLink(
                self.draft, lambda sid, tokens: self._draft_open(sid, tokens, request, mode, draft_reserve), policy,
                shared,
            )
        self.in_flight += 1
        with logs.request_context(request.request_id):
            log.debug("started: %d prompt tokens, k %d, drafter %s", len(prompt_ids), request.k, request.drafter.name)
            try:
                if fork is not None and not fork.leader:
                    target.fork_from, draft.fork_from = await fork.source_ids()
                await self._open(target, draft, prompt_ids)
                if fork is not None:
                    fork.opened(target.session_id, draft.session_id)
                timer.opened()
                async for event in self._stream(request, mode, prompt_ids, target, draft, controller, stats):
                    timer.committed(len(event.token_ids))
                    if event.finish is not None:
                        event = replace(
                            event, stats=self._stats(request, mode, prompt_ids, stats, start, target, draft), loop=stats
                        )
                        # A request's prompt counts once in the metrics, however many samples it has.
                        counted = len(prompt_ids) if fork is None or fork.leader else 0
                        self._record(event, timer, len(prompt_ids), counted, draft, target)
                        metrics.record_links(self.measured.costs.links)
                    yield event
            finally:
                self.in_flight -= 1
                await target.close()
                await draft.close()

    def session_sampling(self, sampling: SamplingParams, prompt_ids: Sequence[int]) -> SamplingParams:
        """The services' sampling: generated tokens count from the prompt's end (also when a session is
        re-opened with prompt + output), and min_tokens holds back the model's end-of-sequence tokens."""
        eos = tuple(sorted(self.eos_ids)) if sampling.min_tokens else ()
        return replace(sampling, prompt_length=len(prompt_ids), eos_token_ids=eos)

    def shares_streams(self) -> bool:
        """Whether a session starting now goes on the services' shared Sessions streams (``shared_stream_from``)."""
        start = self.config.shared_stream_from
        return bool(start) and self.in_flight + 1 >= start

    @staticmethod
    async def _open(target: TargetLink, draft: DraftLink, prompt_ids: list[int]) -> None:
        """Open both sessions at once: a far draft's round trip (and its prefill) hides behind the target's.
        A draft that is down only means no speculation for now; the target's errors go to the client."""
        if draft is NO_DRAFT:
            await target.try_open(prompt_ids)
            return
        opened = await asyncio.gather(target.try_open(prompt_ids), draft.open(prompt_ids), return_exceptions=True)
        for outcome in opened:
            if isinstance(outcome, BaseException):
                raise outcome

    @staticmethod
    def _record(event: GenerationEvent, timer: metrics.RequestTimer, prompt_tokens: int, counted_prompt: int,
                draft, target) -> None:
        stats = event.stats
        timer.finished(event.finish.name.lower())
        metrics.record_generation(event.loop, counted_prompt, draft.fallback_rounds, target.reopens)
        log.info(
            "finished (%s): %d prompt + %d new tokens in %.2f s, first token after %.3f s, %d rounds, acceptance %.2f",
            event.finish.name.lower(), prompt_tokens, stats.new_tokens, stats.wall_s, timer.first_token_s or 0.0,
            stats.rounds, stats.acceptance_rate,
        )

    async def _stream(self, request, mode, prompt_ids, target, draft, controller, stats) -> AsyncIterator[GenerationEvent]:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stops = StopMatcher(request.stop)
        aligned = TokenTextAlignment()  # ids are sent with their text: none past a stop string
        emitted = 0  # characters of text sent so far
        speculating = draft is not NO_DRAFT
        config = LoopConfig(
            max_new_tokens=request.max_new_tokens,
            eos_ids=frozenset() if request.sampling.ignore_eos else self.eos_ids,
            max_context=self.target.info.max_context or 1 << 30,
            ahead_max=min(request.k, self.draft.info.max_block - 1) if speculating else 0,
            tree_branches=self.tree_branches(request, mode) if speculating else 1,
            constraint=self._constraint(request),
        )
        rounds = speculative_decode(prompt_ids, config, target, draft, stats, controller)
        deadline = time.monotonic() + self.config.max_generation_s if self.config.max_generation_s else None
        pending: list[pb.TokenLogprob] = []  # the logprobs of committed ids not sent yet (ids wait for their text)
        scored = request.prompt_logprobs is None  # the prompt's logprobs went out (or were not asked for)
        last = None
        # A stop string ends the generation here: the loop (and the proposal it drafts ahead) is closed
        # before the last event goes out, not whenever the abandoned generator is collected.
        async with contextlib.aclosing(rounds):
            async for new, finish, logprobs in rounds:
                self._check_deadline(deadline)
                pending.extend(logprobs)
                pieces = []
                for token in new:
                    pieces.append(detok.add([token]))
                    aligned.add(token, pieces[-1])
                text, stopped = stops.feed("".join(pieces))
                if stopped:
                    finish = Finish.STOP_STRING
                elif finish is not None:
                    tail = detok.flush()
                    aligned.add_text(tail)
                    tail, stopped = stops.feed(tail)
                    text += tail if stopped else tail + stops.flush()
                    finish = Finish.STOP_STRING if stopped else finish
                emitted += len(text)
                ids = aligned.release(emitted) if stopped or finish is None else aligned.release_all()
                sent = tuple(self._with_text(lp) for lp in pending[: len(ids)])
                del pending[: len(ids)]
                prompt_logprobs = () if scored else self._prompt_logprobs(prompt_ids, target.prompt_logprobs)
                scored = True
                if finish is not None:
                    stats.delivered = aligned.released
                    last = GenerationEvent(text, ids, finish, logprobs=sent, prompt_logprobs=prompt_logprobs)
                    break
                yield GenerationEvent(text, ids, finish, logprobs=sent, prompt_logprobs=prompt_logprobs)
        if last is not None:
            yield last

    def _check_deadline(self, deadline: float | None) -> None:
        if deadline is not None and time.monotonic() > deadline:
            metrics.REFUSED.inc(reason="generation_deadline")
            raise DeadlineExceeded(
                f"the generation ran past the server's limit of {self.config.max_generation_s:g} s "
                "(--max-generation-s); ask for fewer tokens"
            )

    def _constraint(self, request: GenerationRequest) -> Constraint | None:
        """The generation's grammar state; forced tokens are drafted unless the request decodes target-only."""
        if request.grammar is None:
            return None
        return self._grammars.constraint(request.grammar, self.max_block, jump_forward=request.k > 0)

    def tree_branches(self, request: GenerationRequest, mode: VerificationMode) -> int:
        """The request's tree width where draft and target both take trees and its mode verifies them
        (GREEDY, TOKEN_ONLY, COUPLED: not DRAFT_PROBS), else 1. A feature drafter's
        (EAGLE, alone or in a chain) rounds are chains: 1."""
        both = self.target.info.token_trees and self.draft is not None and self.draft.info.token_trees
        chains_only = self.feature_traits(request).kind is DrafterKind.EAGLE  # its head chains one row to the next
        return request.tree_branches if both and mode in TREE_MODES and not chains_only else 1

    def controller(self, request: GenerationRequest, mode: VerificationMode, speculating: bool) -> Controller:
        """The session's round policy: adaptive K where the request asks for it, else a fixed K (0 without a draft)."""
        members = self._chain(request) or (request.drafter,)
        free = frozenset(m for m in members if m in self.drafter_traits and self.drafter_traits[m].free)
        drafters = Drafters(request.drafter, free, next((m for m in members if m not in free), None))
        policy = self.config.link_policy
        kind = AdaptiveK if request.adaptive_k and request.k > 0 and speculating else FixedK
        return kind(request.k if speculating else 0, self.measured, AcceptRule.of(mode, request.sampling.temperature),
                    drafters, overlap=request.overlap and speculating, second_guess=request.second_guess,
                    draft_timeout_s=policy.draft_timeout_s, draft_deadline_s=policy.draft_deadline_s)

    def _prompt_logprobs(self, prompt_ids: Sequence[int], scored: Sequence[pb.TokenLogprob]) -> tuple[pb.TokenLogprob, ...]:
        """The prompt's first token (unscored: NaN) and the target's scores of the others, with their text."""
        first = pb.TokenLogprob(token_id=prompt_ids[0], logprob=math.nan, token=self.token_text(prompt_ids[0]))
        return (first, *(self._with_text(lp) for lp in scored))

    def _with_text(self, logprob: pb.TokenLogprob) -> pb.TokenLogprob:
        """The target's TokenLogprob with each token's text filled in."""
        out = pb.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob, token=self.token_text(logprob.token_id),
                              rank=logprob.rank)
        out.top.extend(
            pb.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=self.token_text(t.token_id)) for t in logprob.top
        )
        return out

    def token_text(self, token_id: int) -> str:
        """One token's text as the tokenizer decodes it alone (a partial UTF-8 byte shows as U+FFFD)."""
        return self.tokenizer.decode([token_id])

    def _draft_open(
        self, session_id: str, prompt_ids: list[int], request: GenerationRequest, mode: VerificationMode,
        reserve: int = 0,
    ) -> pb.DraftOpen:
        return pb.DraftOpen(
            session_id=session_id,
            tokens=prompt_ids,
            sampling=sampling_to_proto(request.sampling),
            drafter=request.drafter.value,
            return_probs=mode is VerificationMode.DRAFT_PROBS,
            ngram_min=self.config.ngram_min,
            ngram_max=self.config.ngram_max,
            chain=[kind.value for kind in self._chain(request)],
            mode=mode.value,
            feature_width=len(self.feature_traits(request).feature_layers) * self.target.info.hidden_size,
            reserve_tokens=reserve,
        )

    def feature_traits(self, request: GenerationRequest) -> DrafterTraits:
        """The traits of the request's feature drafter (alone or in its chain); empty traits when it has none."""
        for kind in (request.drafter, *self._chain(request)):
            traits = self.drafter_traits.get(kind)
            if traits is not None and traits.needs_features:
                return traits
        return DrafterTraits(request.drafter)

    def successors_k(self, request: GenerationRequest) -> int:
        """Successors per verified position the request's drafters read (a recycling drafter's; 0: none)."""
        kinds = (request.drafter, *self._chain(request))
        return max((self.drafter_traits[kind].successors_k for kind in kinds if kind in self.drafter_traits), default=0)

    def check_features(self, request: GenerationRequest) -> None:
        """Refuse a feature drafter whose head does not fit the target's hidden states."""
        traits = self.feature_traits(request)
        if not traits.needs_features:
            return
        info = self.target.info
        sends = len(traits.feature_layers) * info.hidden_size
        out_of_range = [layer for layer in traits.feature_layers if layer > info.num_layers]
        if out_of_range or sends != traits.feature_width:
            raise errors.FailedPrecondition(
                f"drafter {traits.kind.name}'s head reads {traits.feature_width} feature values per position from "
                f"target layers {list(traits.feature_layers)}, but target {info.model_id} has {info.num_layers} "
                f"layers of hidden size {info.hidden_size} (it would send {sends}): the head was trained for another "
                "target; start serve-draft with a head for this one"
            )

    def _chain(self, request: GenerationRequest) -> tuple[DrafterKind, ...]:
        if request.drafter is not DrafterKind.CHAIN:
            return ()
        return request.chain or default_chain(self.drafters)

    @staticmethod
    def _stats(request, mode, prompt_ids, stats: LoopStats, start: float, target, draft) -> pb.GenerationStats:
        wall = time.perf_counter() - start
        return pb.GenerationStats(
            prompt_tokens=len(prompt_ids),
            new_tokens=stats.delivered,
            rounds=stats.rounds,
            drafted_tokens=stats.drafted,
            accepted_tokens=stats.accepted,
            acceptance_rate=stats.acceptance_rate,
            mean_accepted_length=stats.mean_accepted_length,
            tokens_per_s=stats.committed / wall if wall > 0 else 0.0,
            wall_s=wall,
            k=request.k,
            drafter=request.drafter.value,
            mode=mode.value,
            seed=request.sampling.seed,
            draft_compute_s=stats.draft_compute_s,
            target_compute_s=stats.target_compute_s,
            adaptive_k=request.adaptive_k,
            mean_k=stats.mean_k,
            draft_fallback_rounds=draft.fallback_rounds,
            draft_reattached=draft.reattached,
            target_reopens=target.reopens,
            overlap=request.overlap,
            overlap_hits=stats.overlap_hits,
            mean_batch_size=stats.mean_batch_size,
            feature_bytes=stats.feature_bytes,
            feature_bytes_per_round=stats.feature_bytes / stats.rounds if stats.rounds else 0.0,
            tree_rounds=stats.tree_rounds,
            tree_nodes=stats.tree_nodes,
            branch_accepted=stats.branch_accepted,
            forced_tokens=stats.forced_tokens,
            request_id=request.request_id,
        )


def drafter_traits(info: pb.ModelInfo) -> list[DrafterTraits]:
    """A draft service's drafters, registering the kinds it defines beyond the built-in ones."""
    return [
        DrafterTraits(
            DrafterKind(d.kind, d.name), d.has_probs, d.needs_model, d.free, needs_features=d.needs_features,
            feature_layers=tuple(d.feature_layers), feature_width=d.feature_width, successors_k=d.successors_k,
        )
        for d in info.drafter_info
    ]


def check_pair(a_name: str, a_model: str, a_fingerprint: str, b_name: str, b_info: pb.ModelInfo) -> None:
    """Refuse two components whose vocabularies differ, naming both."""
    if a_fingerprint != b_info.vocab_fingerprint:
        raise ValueError(
            f"vocabulary mismatch: {a_name} {a_model} (fingerprint {a_fingerprint[:12]}) and {b_name} "
            f"{b_info.model_id} (fingerprint {b_info.vocab_fingerprint[:12] or 'none'}) do not share a tokenizer; "
            "pair models that use the same vocabulary"
        )
