"""The target engine: per-session KV caches and one-pass verification of draft blocks.

No grpc here: the servicer converts protos to these calls and maps
``specsplit.lmkit.errors`` to status codes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from specsplit.lmkit import draws, errors, forward, packed_rows, token_mask, token_tree
from specsplit.lmkit.costs import LinearCost
from specsplit.lmkit.features import FeatureBlock
from specsplit.lmkit.kinds import TREE_MODES, VerificationMode
from specsplit.lmkit.kvcache import SessionCache, check_cache_layout, common_prefix, rows_share_rope
from specsplit.lmkit.sampling import (
    SamplingParams,
    apply_penalties,
    block_argmax,
    block_topk,
    chain_paths,
    first_rows,
    logits_to_probs,
    rows_when_reached,
)
from specsplit.lmkit.sessions import (
    PREFILL_AUTO,
    SessionLimits,
    SessionTable,
    check_open,
    check_prefill_chunk,
    check_tokens,
    reservation,
)
from specsplit.lmkit.successors import Successors, check_successors_k
from specsplit.target_service import rejection, tree_verify
from specsplit.target_service.batched_forward import Step, forward_batch, padded_tokens, split_by_width
from specsplit.target_service.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, committed_logprobs

_MIN_FIT_SAMPLES = 8  # forwards before the cost fit is used

log = logging.getLogger(__name__)

# A decided block: a chain's verdict, or a tree's (accepted nodes in ``path``).
Decided = rejection.Verdict | tree_verify.TreeVerdict


@dataclass
class TargetSession:
    session_id: str
    tokens: list[int]  # committed: prompt + output, the orchestrator's truth mirrored; only ever appended to
    sampling: SamplingParams
    mode: VerificationMode
    cache: SessionCache
    rounds: int = 0
    top_logprobs: int | None = None  # None: no logprobs; else also this many most likely tokens per position
    reserved: int = 0  # positions reserved against the KV budget at the open: the most it may hold
    successors_k: int = 0  # the target's best successors of each verified position to return, ids per position
    prompt_logprobs: int | None = None  # score the prompt at the first verify, with this many alternatives
    prompt_scored: bool = False  # the first verify has scored the prompt (TargetOpen.prompt_logprobs)

    @property
    def scores_prompt(self) -> bool:
        """Its next verify scores the prompt: a row for every fed position, and it runs alone."""
        return self.prompt_logprobs is not None and not self.prompt_scored


@dataclass(frozen=True)
class BatchShare:
    """The forward pass a block was verified in, as the load signal for the orchestrator's choice of k."""

    size: int = 1  # sessions in the forward
    width: int = 1  # tokens per row: the longest block when rows are padded, the mean (rounded up) when packed
    others_committed: int = 0  # tokens the other sessions committed from the same forward
    tokens: int = 0  # tokens the forward computed over, padding included (0: a block verified alone)
    packed: bool = False  # rows packed end to end (no padding): a block adds only its own tokens


@dataclass(frozen=True)
class VerifyOutcome:
    """One verified block: the verdict, the time it took, the forward it shared, and what the session asked for."""

    accepted: int
    next_token: int
    compute_s: float
    batch: BatchShare = BatchShare()
    features: FeatureBlock | None = None  # the committed positions' hidden features, when the session asked
    path: tuple[int, ...] = ()  # a tree block's accepted nodes, root first; empty for a chain
    logprobs: tuple[TokenLogprob, ...] = ()  # one per committed token when the session asked for them
    forward_s: float = 0.0  # the model's forward alone, within compute_s
    successors: Successors | None = None  # the block's positions' best successors, when the session asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first verify of a session scoring its prompt


# A block whose session's prompt is still being computed in chunks (``TargetEngine.prefill_chunk``): the scheduler
# offers it to the next step again, unanswered.
PREFILLING = object()
UNMEASURED_PREFILL_CHUNK = 512  # --prefill-chunk auto's chunk until the forwards' cost is measured
MIN_AUTO_CHUNK = 8  # auto's smallest chunk (the last one, with the block, is the rest, up to a block)


@dataclass(frozen=True)
class VerifyItem:
    session: "TargetSession"
    position: int
    draft_tokens: Sequence[int]  # [k]
    draft_probs: torch.Tensor | None  # [k, vocab] in DRAFT_PROBS mode, else None
    parents: Sequence[int] | None = None  # [k] a token tree (lmkit.token_tree); None or a chain's: a chain
    allowed: torch.Tensor | None = None  # [k+1, vocab] bool: a grammar's tokens per verified position; None: all


def tree_of(parents: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    """A block's parents as the engine keeps them: None for a chain (however it was sent).

    Raises InvalidArgument unless non-empty parents hold one entry per draft token.
    """
    if not parents:
        return None
    if len(parents) != n:
        raise errors.InvalidArgument(f"parents has {len(parents)} entries for {n} tokens; send one parent index per token")
    return None if token_tree.is_chain(parents) else tuple(parents)


def check_mode(mode: VerificationMode, sampling: SamplingParams) -> None:
    if mode is VerificationMode.GREEDY and not sampling.greedy:
        raise errors.InvalidArgument(
            f"VERIFICATION_MODE_GREEDY needs temperature 0, got {sampling.temperature}; "
            "use TOKEN_ONLY, DRAFT_PROBS or COUPLED for sampling"
        )
    if mode is not VerificationMode.GREEDY and sampling.greedy:
        raise errors.InvalidArgument(f"{mode.name} samples and needs temperature > 0; use GREEDY for temperature 0")


class TargetEngine:
    """Holds the target model and its sessions; all model work runs on one thread."""

    def __init__(
        self,
        model,
        *,
        model_id: str,
        vocab_fingerprint: str,
        limits: SessionLimits,
        new_cache: Callable[[], SessionCache] | None = None,  # tensor parallel: caches mirrored on every rank
        tp_degree: int = 1,
        fast_forward: bool = True,
        batch_invariant: bool = False,  # never share a forward between sessions (docs/protocol.md)
        compile_mode: str = "off",  # the decoder step's compilation (serve-target --compile, resolved)
        max_context: int = 0,  # positions a session may reach; 0: the model's (a CUDA-graph slot holds fewer)
        sampling_defaults: dict[str, float] | None = None,  # what its generation_config.json sets (ModelInfo)
        prefill_chunk: int = 0,  # prompt tokens a step computes at most for prefills longer than it; 0: whole
    ) -> None:
        """``fast_forward``: run verify steps through the packed-rows forward (``specsplit.lmkit.packed_rows``)
        where the model allows (full attention only: a sliding-window model keeps the stock forward), as the
        decoder step (``specsplit.lmkit.decoder_step``, compiled by ``compile_mode``) where the model's layout
        allows, with linear layers packed for oneDNN (fp32 CPU) unless compiled; off, the model's stock
        forward."""
        check_cache_layout(model)
        # cuda-graphs: new_cache hands out slots of an lmkit.graph_step.GraphStep; another new_cache: tensor parallel
        sharded = new_cache is not None and compile_mode != "cuda-graphs"
        self.forward_kind = forward.install(model, compile_mode if fast_forward else forward.STOCK, sharded)
        if not fast_forward and compile_mode != "off":
            self.forward_kind += f" (--compile {compile_mode} applies to the fast forward, which is off)"
        self.model = model
        self.model_id = model_id
        self.vocab_fingerprint = vocab_fingerprint
        self.sampling_defaults = dict(sampling_defaults or {})
        self.limits = limits
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.max_context = min(self.max_context, max_context or self.max_context)
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0)
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        self.sessions: SessionTable[TargetSession] = SessionTable(limits, "target")
        self._new_cache = new_cache or (lambda: SessionCache(model))
        self.tp_degree = tp_degree
        # Sharded caches replay each step on the other ranks one session at a time; a RoPE whose scaling
        # follows the longest row of a forward would let rows change each other's positions' encoding.
        # batch_invariant: each session's rows run with the shapes they would have alone, so a session's
        # greedy tokens do not depend on which sessions arrive with it (a bf16 near-tie cannot flip).
        self.batch_invariant = batch_invariant
        # A CUDA-graph target's sessions replay together in its batch buckets (lmkit.graph_step).
        own_caches = new_cache is None or compile_mode == "cuda-graphs"
        self._static_step = compile_mode == "cuda-graphs"  # lmkit.graph_step's caches: chains and trees
        self.can_batch = not batch_invariant and own_caches and rows_share_rope(model)
        self.forward_passes = 0  # verifying forwards run; rounds / forward_passes is the mean batch size
        self.forward_cost = LinearCost()  # verifying forwards' seconds over their (padded) tokens
        self.fed_tokens = 0  # positions the forwards computed keys/values for (StatsResponse.fed_tokens)
        self.shared_tokens = 0  # positions sessions started with as copies from another (TargetOpen.fork_from)
        check_prefill_chunk(prefill_chunk, auto=True)
        # auto: a step's chunk costs about one step of the rows beside it, by the forwards' cost fit (until it is
        # measured, the fixed default); a prompt with no other session open runs whole.
        self.prefill_auto = prefill_chunk == PREFILL_AUTO
        fixed = UNMEASURED_PREFILL_CHUNK if self.prefill_auto else prefill_chunk
        # Chunks of at least a block: a prompt's last chunk is verified with the block that follows it.
        self.prefill_chunk = max(fixed, limits.max_block + 1) if fixed else 0
        self.prefill_chunks = 0  # prefill chunks run beside other sessions' rows (not in StatsResponse)
        self.chunk_token_s: float | None = None  # auto: what a chunk's token costs, measured (_price_chunks)

    # -- sessions -----------------------------------------------------------
    def open(
        self, session_id: str, tokens: Sequence[int], sampling: SamplingParams, mode: VerificationMode,
        top_logprobs: int | None = None, feature_layers: Sequence[int] = (), caller: str = "",
        reserve_tokens: int = 0,  # positions it may hold (TargetOpen.reserve_tokens); 0: the full context
        fork_from: str = "",  # a live session to copy the shared prefix's keys/values from (TargetOpen.fork_from)
        successors_k: int = 0,  # successors of every verified position to return (TargetOpen.successors_k)
        prompt_logprobs: int | None = None,  # score the prompt, with this many alternatives (TargetOpen.prompt_logprobs)
    ):
        check_open(session_id, tokens, self.max_context, "model")
        check_tokens(tokens, self.vocab_size, "tokens")
        check_tokens([t for t, _ in sampling.logit_bias], self.vocab_size, "sampling.logit_bias ids")
        check_tokens(sampling.eos_token_ids, self.vocab_size, "sampling.eos_token_ids")
        check_mode(mode, sampling)
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise errors.InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise errors.InvalidArgument(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
        self._check_feature_layers(feature_layers)
        try:
            check_successors_k(successors_k)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        reserve = reservation(reserve_tokens, self.max_context, len(tokens))
        session = TargetSession(session_id, list(tokens), sampling, mode, self._new_cache(),
                                top_logprobs=top_logprobs, reserved=reserve, successors_k=successors_k,
                                prompt_logprobs=prompt_logprobs)
        session.cache.feature_layers = tuple(feature_layers)
        if feature_layers and not session.cache.gives_layers(feature_layers):
            given = getattr(session.cache, "feature_layers_given", ())
            session.cache.release()
            if given:
                raise errors.InvalidArgument(
                    f"this target ({self.forward_kind}) keeps the hidden states of layers {list(given)}, not all of "
                    f"{list(feature_layers)} that this feature drafter reads; serve it with --graph-feature-layers "
                    "naming them")
            raise errors.InvalidArgument(
                f"this target ({self.forward_kind}) returns no hidden features, which a feature drafter (EAGLE, "
                "Medusa) needs; serve it with --compile off or inductor, or --graph-feature-layers, for such drafters")
        try:
            self.sessions.add(session_id, session, caller, reserve)
        except errors.SpecsplitError:
            session.cache.release()  # refused (a limit or the budget): its cache goes with it, on every rank
            raise
        # A feature session's first verify sends the prompt's features. Batch-invariant: a fork's prompt keys
        # come from forwards of the source's shapes, which depend on when the fork arrives.
        if fork_from and not feature_layers and not self.batch_invariant and prompt_logprobs is None:
            self._fork(session, fork_from, caller)
        return session

    def _fork(self, session: TargetSession, source_id: str, caller: str) -> None:
        """Start ``session``'s cache as a copy of the positions it shares with ``source_id``'s, computing them
        in the source first if it does not hold them yet (its own next step then reuses them). Shares nothing
        when the source is gone, another caller's, a feature session, or its cache cannot be copied."""
        source = self.sessions.find(source_id, caller)
        if source is None or source is session or source.cache.feature_layers or not source.cache.can_copy:
            return
        # The last context token is always fed (its logits decide the next token): share up to it.
        shared = min(common_prefix(source.tokens, session.tokens), len(session.tokens) - 1)
        if shared <= 0:
            return
        cached = common_prefix(source.cache.tokens, source.tokens[:shared])
        floor = source.cache.copy_floor  # its sliding layers hold no positions before this one
        if shared < floor or 0 < cached < floor:
            return
        try:
            if cached < shared:
                source.cache.apply(cached, source.tokens[cached:shared], 1)
                self.fed_tokens += shared - cached
            session.cache.copy_prefix(source.cache, shared)
        except Exception as exc:  # noqa: BLE001 - out of memory, say: the sessions re-prefill on their own
            log.warning("forking session %r from %r failed (%s); it prefills alone", session.session_id, source_id, exc)
            source.cache.reset()
            session.cache.reset()
            return
        self.shared_tokens += shared

    def _check_feature_layers(self, layers: Sequence[int]) -> None:
        bad = [layer for layer in layers if not 0 <= layer <= self.num_layers]
        if bad:
            raise errors.InvalidArgument(
                f"feature_layers {bad} are outside [0, {self.num_layers}]: this target has {self.num_layers} "
                "decoder layers (0 = the embeddings, i = the input of layer i); the draft's head was trained "
                "for another target"
            )

    def close(self, session_id: str) -> None:
        session = self.sessions.remove(session_id)
        if session is not None:
            session.cache.release()

    # -- verification -------------------------------------------------------
    def verify(
        self,
        session: TargetSession,
        position: int,
        draft_tokens: Sequence[int],  # [k]
        draft_probs: torch.Tensor | None,  # [k, vocab] in DRAFT_PROBS mode, else None
        parents: Sequence[int] | None = None,  # [k] a token tree; None: a chain
        allowed: torch.Tensor | None = None,  # [k+1, vocab] bool: the tokens a grammar allows; None: all
    ) -> VerifyOutcome:
        """Run the block through the target in one forward pass and commit accepted + 1 tokens."""
        parents = tree_of(parents, len(draft_tokens))
        self._check_block(session, position, draft_tokens, draft_probs, parents, allowed)
        start = time.perf_counter()
        fed = session.cache.fed
        scoring = session.scores_prompt
        # [k+1, vocab]; scoring the prompt: a row for every position fed, the prompt's first (the cache is new)
        logits = session.cache.logits(session.tokens, draft_tokens, parents, all_rows=scoring, grown=True)
        forward_s = time.perf_counter() - start
        prompt_logprobs = ()
        if scoring:
            verified = len(draft_tokens) + 1
            scored = session.tokens[len(session.tokens) - (logits.shape[0] - verified) :]  # the fed context after the first
            prompt_logprobs = tuple(committed_logprobs(logits[:-verified], scored, session.prompt_logprobs, ranks=True))
            logits, session.prompt_scored = logits[-verified:], True
        self.fed_tokens += session.cache.fed - fed
        self.forward_passes += 1
        masked = token_mask.apply(logits, allowed)  # a grammar's refusals at -inf; penalties keep them there
        adjusted = penalized(session, masked, draft_tokens, parents)  # logprobs stay the model's own
        successors = block_successors([session], [logits], [draft_tokens])[0]
        result = self._commit(session, adjusted, draft_tokens, draft_probs, parents)
        logprobs = self._logprobs(session, logits, result)
        path = _tree_path(result, parents)
        return VerifyOutcome(
            result.accepted, result.next_token, time.perf_counter() - start, path=path,
            features=committed_features(session.cache, position, result.accepted, path), logprobs=logprobs,
            forward_s=forward_s, successors=successors, prompt_logprobs=prompt_logprobs,
        )

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome | errors.SpecsplitError]:
        """Verify blocks of different sessions in shared forward passes; each result equals its solo ``verify``.

        A block that fails its checks gets its error in its slot and the others
        still run. Feeds longer than a verification block (a prefill) run alone,
        and wide blocks run apart from narrow ones when the padding they would
        put on the narrow rows costs more than one more forward.
        """
        results: list[VerifyOutcome | errors.SpecsplitError | None] = [None] * len(items)
        batch: list[int] = []
        steps: list[Step] = []  # one per batched row
        chunking: list[tuple[int, int, list[int]]] = []  # prompts longer than a chunk: (item, kept, feed)
        for i, item in enumerate(items):
            try:
                parents = tree_of(item.parents, len(item.draft_tokens))
                self._check_block(item.session, item.position, item.draft_tokens, item.draft_probs, parents,
                                  item.allowed)
            except errors.SpecsplitError as exc:
                results[i] = exc
                continue
            keep, feed = item.session.cache.plan(item.session.tokens, item.draft_tokens, grown=True)
            if self._chunks(item, feed):
                chunking.append((i, keep, feed))
                continue
            if self.can_batch and len(feed) <= self.limits.max_block + 1 and not item.session.scores_prompt:
                batch.append(i)
                steps.append(Step(item.session.cache, keep, feed, len(item.draft_tokens) + 1, parents))
            else:
                results[i] = self._verify_checked(item)
        budget = self._chunk_budget(sum(len(step.feed) for step in steps), len(chunking)) if chunking else 0
        for i, keep, feed in chunking:
            item = items[i]
            if budget is None:  # nobody else to keep going: the prompt runs whole
                results[i] = self._verify_checked(item)
                continue
            # This step computes the prompt's next chunk beside the others' rows, and the block waits (PREFILLING)
            # for a later step; a step past its budget leaves it for the next, the first in line first.
            take = min(budget, len(feed) - len(item.draft_tokens) - 1)
            results[i] = PREFILLING
            if take > 0:
                budget -= take
                batch.append(i)
                steps.append(Step(item.session.cache, keep, feed[:take], 1))
        widths = [len(step.feed) for step in steps]
        # Packed rows carry no padding: nothing to save by splitting.
        split = len(batch) > 1 and not packed_rows.installed(self.model)
        groups = split_by_width(widths, self._split_overhead_tokens()) if split else [list(range(len(batch)))]
        step_start = time.perf_counter()
        for group in groups:
            rows = [batch[g] for g in group]
            if len(rows) == 1 and results[rows[0]] is not PREFILLING:
                results[rows[0]] = self._verify_checked(items[rows[0]])
                if isinstance(results[rows[0]], VerifyOutcome):
                    self.forward_cost.observe(widths[group[0]], results[rows[0]].compute_s)
            elif rows:
                together = self._verify_together([items[i] for i in rows], [steps[g] for g in group])
                for i, verified in zip(rows, together):
                    results[i] = verified
        if len(groups) > 1:  # the load signal is the whole step, whichever forward a block ran in
            tokens = sum(padded_tokens(self.model, [widths[j] for j in g]) for g in groups)
            self._share_step(results, batch, tokens, time.perf_counter() - step_start)
        return results

    @staticmethod
    def _share_step(results, batch: list[int], tokens: int, step_s: float) -> None:
        """Every block of a split step reports the step: all its sessions, its tokens, its time."""
        done = [i for i in batch if isinstance(results[i], VerifyOutcome)]
        committed = sum(results[i].accepted + 1 for i in done)
        width = -(-tokens // max(len(done), 1))  # mean row width, rounded up
        for i in done:
            own = results[i]
            share = BatchShare(len(done), width, committed - (own.accepted + 1), tokens)
            results[i] = replace(own, compute_s=step_s, batch=share)

    def cost_fit(self) -> tuple[float, float] | None:
        """(a, s) of t(x) = a + s x over this target's verifying forwards, once measured (the load-aware
        K choice of every orchestrator reads it); None before ``_MIN_FIT_SAMPLES`` forwards."""
        if self.forward_cost.samples < _MIN_FIT_SAMPLES:
            return None
        return max(self.forward_cost.intercept(), 0.0), self.forward_cost.slope()

    def _split_overhead_tokens(self) -> float:
        """One more forward's fixed cost in tokens (a / s); infinite (never split) until measured."""
        slope = self.forward_cost.slope()
        if self.forward_cost.samples < _MIN_FIT_SAMPLES or slope <= 0:
            return float("inf")
        return max(self.forward_cost.intercept(), 0.0) / slope

    def _verify_checked(self, item: VerifyItem) -> VerifyOutcome | errors.SpecsplitError:
        try:
            return self.verify(item.session, item.position, item.draft_tokens, item.draft_probs, item.parents,
                               item.allowed)
        except errors.SpecsplitError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - NaN logits, OOM, a bad cache: this session's failure alone
            return self._failed(item.session, exc)

    def _verify_together(
        self, items: Sequence[VerifyItem], steps: Sequence[Step]
    ) -> list[VerifyOutcome | errors.SpecsplitError]:
        """One forward over the planned steps of checked items (``steps[i]`` belongs to ``items[i]``).

        A failure stays with its session: if the shared forward fails (a bad
        cache, out of memory), every block is verified again alone, so only the
        culprit fails; a session whose rows cannot be decided (NaN logits) gets
        its error while the others commit.
        """
        start = time.perf_counter()
        tokens = padded_tokens(self.model, [len(step.feed) for step in steps])
        width = -(-tokens // len(steps))  # per row, rounded up
        try:
            raw = forward_batch(self.model, steps)  # per item [k+1, vocab]
        except Exception as exc:  # noqa: BLE001 - find the culprit: each block alone
            log.warning("a batched forward of %d sessions failed (%s); verifying each alone", len(steps), exc)
            for step in steps:  # the step may have left caches half-written; they re-prefill
                step.cache.reset()
            return [self._verify_checked(item) for item in items]
        forward_s = time.perf_counter() - start
        self.forward_passes += 1
        self.fed_tokens += sum(len(step.feed) for step in steps)
        chunked = [self._is_chunk(item, step) for item, step in zip(items, steps)]
        if not any(chunked):
            self.forward_cost.observe(tokens, forward_s)
            return self._decided(items, raw, steps, start, forward_s, tokens, width)
        # A prefill's chunk: its keys and values are what it was for; no verdict yet. Not in the fit: a chunk's
        # cost grows with the prompt before it, not with its tokens.
        if self.prefill_auto:
            self._price_chunks(tokens, sum(len(step.feed) for step, c in zip(steps, chunked) if c), forward_s)
        self.prefill_chunks += sum(chunked)
        kept = [i for i, c in enumerate(chunked) if not c]
        if not kept:
            return [PREFILLING] * len(items)
        verified = iter(self._decided([items[i] for i in kept], [raw[i] for i in kept], [steps[i] for i in kept],
                                      start, forward_s, tokens, width))
        return [PREFILLING if c else next(verified) for c in chunked]

    def _chunk_budget(self, others: int, chunking: int = 1) -> int | None:
        """Prompt tokens a step with ``others`` tokens of other sessions' rows gives to chunks of long prompts;
        None: no chunk (``auto`` with no session open but the ``chunking`` prompts: they run whole). ``auto``:
        what the step costs without chunks (the forwards' fit, a + s x) over what a chunk's token costs, so a
        chunk costs about what the step costs without it; the fixed default until the fit is measured."""
        fit = self.cost_fit() if self.prefill_auto else None
        if fit is None or fit[1] <= 0:
            return self.prefill_chunk
        if not others and self.sessions.stats()[0] <= chunking:
            return None  # no other session at all (one that is only between steps still decodes)
        base, per_token = fit
        # A chunk's token costs more than a verify row's as the prompt goes on (it attends to all of it before):
        # priced by the chunks' own steps where they cost more than the fit says.
        price = max(self.chunk_token_s or 0.0, per_token)
        return max(int((base + per_token * others) / price), MIN_AUTO_CHUNK)

    def _price_chunks(self, tokens: int, chunk_tokens: int, forward_s: float) -> None:
        """Learn what a chunk's token costs from a forward of ``tokens``, ``chunk_tokens`` of them chunks: the
        forward's time beyond what the fit predicts for the other rows, a token (a running mean, halved each
        step, so it follows a prompt's growing context)."""
        fit = self.cost_fit()
        if fit is None or chunk_tokens <= 0:
            return
        base, per_token = fit
        price = max(forward_s - base - per_token * (tokens - chunk_tokens), 0.0) / chunk_tokens
        self.chunk_token_s = price if self.chunk_token_s is None else (self.chunk_token_s + price) / 2

    def _chunks(self, item: VerifyItem, feed: Sequence[int]) -> bool:
        """Whether this step computes only a chunk of the item's prompt: a feed longer than a chunk, on a cache of
        the packed forward (rows of any width, no padding), from a session that reads no prompt logprobs or
        features (those come from the prefill's every row)."""
        cache = item.session.cache
        measured = self.prefill_auto and self.cost_fit() is not None
        shortest = self.limits.max_block + 1 if measured else self.prefill_chunk  # prompt that goes in chunks
        return (self.prefill_chunk > 0 and self.can_batch and len(feed) > shortest
                and type(cache) is SessionCache and cache.kv is not None
                and not item.session.scores_prompt and not cache.feature_layers)

    @staticmethod
    def _is_chunk(item: VerifyItem, step: Step) -> bool:
        """A step that feeds part of the context only (the item's block and the last context token not in it)."""
        return step.keep + len(step.feed) < len(item.session.tokens)

    def _decided(self, items, raw, steps, start: float, forward_s: float, tokens: int, width: int):
        """Each item's verdict from its rows of a forward (``_verify_together``)."""
        adjusted = [
            penalized(item.session, token_mask.apply(rows, item.allowed), item.draft_tokens, step.parents)
            for item, rows, step in zip(items, raw, steps)
        ]
        firsts = self._first_rows(items, adjusted, steps)
        choices = self._greedy_choices(items, adjusted)
        successors = block_successors([item.session for item in items], raw, [item.draft_tokens for item in items])
        decided = [
            self._commit_isolated(item, rows, step.parents, first, chosen)
            for item, rows, step, first, chosen in zip(items, adjusted, steps, firsts, choices)
        ]
        logprobs = [self._logprobs(item.session, rows, d) if not isinstance(d, errors.SpecsplitError) else ()
                    for item, rows, d in zip(items, raw, decided)]
        elapsed = time.perf_counter() - start
        done = [d for d in decided if not isinstance(d, errors.SpecsplitError)]
        committed = sum(d.accepted + 1 for d in done)
        packed = packed_rows.installed(self.model)
        share = lambda d: BatchShare(len(done), width, committed - (d.accepted + 1), tokens, packed)  # noqa: E731
        return [
            d if isinstance(d, errors.SpecsplitError)
            else self._verified(item, d, elapsed, share(d), step.parents, lp, forward_s, succ)
            for item, d, lp, step, succ in zip(items, decided, logprobs, steps, successors)
        ]

    @staticmethod
    def _verified(item: VerifyItem, d: Decided, elapsed: float, batch: BatchShare, parents, logprobs,
                  forward_s: float, successors: Successors | None) -> VerifyOutcome:
        path = _tree_path(d, parents)
        features = committed_features(item.session.cache, item.position, d.accepted, path)
        return VerifyOutcome(d.accepted, d.next_token, elapsed, batch, features, path, logprobs, forward_s,
                             successors)

    @staticmethod
    def _logprobs(session: TargetSession, logits, verdict: Decided) -> tuple[TokenLogprob, ...]:
        """The committed tokens' log-probabilities from this pass's logits, when the session asked for them.

        A tree's logits rows are per node: the committed tokens follow the root
        row, then the accepted nodes' rows.
        """
        if session.top_logprobs is None:
            return ()
        committed = session.tokens[len(session.tokens) - verdict.accepted - 1 :]  # _commit appended them
        if isinstance(verdict, tree_verify.TreeVerdict):
            logits = logits[[0, *(node + 1 for node in verdict.path)]]
        return tuple(committed_logprobs(logits, committed, session.top_logprobs))

    @staticmethod
    def _first_rows(items: Sequence[VerifyItem], logits, steps: Sequence[Step]) -> list[torch.Tensor | None]:
        """Row 0 of every sampled chain's probabilities, made together (one call per kind of sampling): each
        verifier needs row 0, and most stop there."""
        sampled = [i for i, (item, step) in enumerate(zip(items, steps))
                   if step.parents is None and item.session.mode is not VerificationMode.GREEDY
                   and not item.session.sampling.greedy]
        made = first_rows([(logits[i], items[i].session.sampling) for i in sampled])
        firsts: list[torch.Tensor | None] = [None] * len(items)
        for i, row in zip(sampled, made):
            firsts[i] = row
        return firsts

    @staticmethod
    def _greedy_choices(items: Sequence[VerifyItem], logits) -> list[list[int] | None]:
        """The argmax ids of every greedy block's rows, found for the whole batch at once (its rows are consecutive
        in the forward's logits unless a mask or penalty made them anew); None for a sampled block, and for a greedy
        one with a NaN row, which its own verifier then refuses."""
        greedy = [i for i, item in enumerate(items) if item.session.mode is VerificationMode.GREEDY]
        choices: list[list[int] | None] = [None] * len(items)
        for i, chosen in zip(greedy, block_argmax([logits[i] for i in greedy])):
            choices[i] = chosen
        return choices

    def _commit_isolated(self, item: VerifyItem, logits, parents, first=None, choices=None
                         ) -> Decided | errors.SpecsplitError:
        try:
            return self._commit(item.session, logits, item.draft_tokens, item.draft_probs, parents, first, choices)
        except errors.SpecsplitError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - NaN logits in this session's rows: its failure alone
            return self._failed(item.session, exc)

    def _failed(self, session: TargetSession, exc: Exception) -> errors.Internal:
        """A session whose forward or decision failed: nothing committed, its cache dropped (it may be bad)."""
        log.warning("verifying session %r failed: %s: %s", session.session_id, type(exc).__name__, exc)
        session.cache.reset()
        return errors.Internal(
            f"verifying a block of session {session.session_id!r} failed ({type(exc).__name__}: {exc}); nothing was "
            "committed and its cache was dropped: resend the block or re-open the session"
        )

    def _commit(self, session, logits, draft_tokens, draft_probs, parents, first=None, choices=None) -> Decided:
        """Decide on the block from its logits and commit the accepted tokens + 1 to the session (``first``:
        row 0 of a sampled chain's probabilities, made with other sessions' rows, or None; ``choices``: a greedy
        block's argmax ids, found with other sessions' rows, or None)."""
        if choices is not None:
            verdict = (rejection.greedy_verdict(choices, draft_tokens) if parents is None
                       else tree_verify.greedy_tree_verdict(choices, draft_tokens, list(parents)))
        elif parents is None:
            verdict = self._decide(session, logits, draft_tokens, draft_probs, first)
        else:
            verdict = self._decide_tree(session, logits, draft_tokens, list(parents))
        if parents is None:
            path = range(verdict.accepted)
        else:
            path = verdict.path
            session.cache.keep_path(len(session.tokens), path)  # the rejected branches leave nothing behind
        session.tokens.extend(draft_tokens[i] for i in path)
        session.tokens.append(verdict.next_token)
        session.rounds += 1
        self.sessions.count_round()
        return verdict

    def _check_block(self, session, position, draft_tokens, draft_probs, parents=None, allowed=None) -> None:
        committed = len(session.tokens)
        if position != committed:
            raise errors.FailedPrecondition(
                f"block starts at position {position} but session {session.session_id!r} has {committed} "
                f"committed tokens; send blocks at position {committed}"
            )
        k = len(draft_tokens)
        if k > self.limits.max_block:
            raise errors.InvalidArgument(f"block has {k} draft tokens; this target accepts at most {self.limits.max_block}")
        if committed + k + 1 > self.max_context:
            room = max(self.max_context - committed - 1, 0)
            raise errors.InvalidArgument(
                f"block of {k} tokens at position {committed} overflows the model's context of "
                f"{self.max_context}; send at most {room} draft tokens"
            )
        reserved = session.reserved
        if reserved and committed + k + 1 > reserved:
            raise errors.ResourceExhausted(
                f"block of {k} tokens at position {committed} passes the {reserved} positions session "
                f"{session.session_id!r} reserved at its open (TargetOpen.reserve_tokens); reopen it reserving more"
            )
        check_tokens(draft_tokens, self.vocab_size, "draft_tokens")
        if parents is not None:
            self._check_tree(session, draft_tokens, parents)
        if session.mode is VerificationMode.DRAFT_PROBS:
            if draft_probs is None and k > 0:
                raise errors.InvalidArgument("DRAFT_PROBS mode needs draft_probs with one row per draft token")
            if draft_probs is not None and tuple(draft_probs.shape) != (k, self.vocab_size):
                raise errors.InvalidArgument(
                    f"draft_probs has shape {tuple(draft_probs.shape)}; expected ({k}, {self.vocab_size})"
                )
        elif draft_probs is not None:
            raise errors.InvalidArgument(
                f"draft_probs sent in {session.mode.name} mode; open the session with DRAFT_PROBS to use them"
            )
        if allowed is not None:
            self._check_mask(session, k, allowed)

    def _check_mask(self, session, k: int, allowed: torch.Tensor) -> None:
        if session.mode is VerificationMode.DRAFT_PROBS:
            raise errors.InvalidArgument("a token mask is not verified in DRAFT_PROBS mode; use TOKEN_ONLY or COUPLED")
        if tuple(allowed.shape) != (k + 1, self.vocab_size):
            raise errors.InvalidArgument(
                f"the token mask has {allowed.shape[0]} rows of {allowed.shape[1]} tokens; a block of {k} draft "
                f"tokens needs {k + 1} rows of {self.vocab_size}"
            )

    @property
    def verifies_trees(self) -> bool:
        """Token-tree blocks are verified (``ModelInfo.token_trees``): the packed forward (on each rank's shard of a
        tensor-parallel target, which replays the tree and its kept path) or the static step runs the model."""
        return self._static_step or packed_rows.installed(self.model)

    def _check_tree(self, session, draft_tokens, parents) -> None:
        if not session.cache.supports_trees:
            raise errors.InvalidArgument("this target does not verify token trees (ModelInfo.token_trees is false); send chains")
        try:
            token_tree.check_parents(parents, len(draft_tokens))
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        kids = token_tree.children(parents)
        if any(len({draft_tokens[i] for i in siblings}) != len(siblings) for siblings in kids):
            raise errors.InvalidArgument("two siblings in the token tree carry the same token; merge them")
        if session.mode not in TREE_MODES:
            raise errors.InvalidArgument(
                f"token trees are verified in GREEDY, TOKEN_ONLY and COUPLED modes; {session.mode.name} takes chains"
            )

    @staticmethod
    def _decide_tree(session, logits, draft_tokens, parents: list[int]) -> tree_verify.TreeVerdict:
        tokens = torch.tensor(list(draft_tokens), dtype=torch.long)
        if session.mode is VerificationMode.GREEDY:
            return tree_verify.verify_tree_greedy(logits, tokens, parents)
        if session.mode is VerificationMode.COUPLED:  # depth d decides absolute position len(tokens) + d
            row = rows_when_reached(logits, session.sampling)
            return tree_verify.verify_tree_coupled(row, tokens, parents, logits.shape[1], _coupled_noise(session))
        target_probs = logits_to_probs(logits, session.sampling)
        # The walk decides one node per depth: depth d's draws are those of absolute position len(tokens) + d.
        position, depth = len(session.tokens), max(token_tree.depths(parents)) + 2
        columns = tree_verify.uniform_columns(parents)
        uniforms = draws.uniforms(session.sampling.seed, draws.Stream.TARGET, range(position, position + depth), columns)
        return tree_verify.verify_tree_token_only(target_probs, tokens, parents, uniforms)

    @staticmethod
    def _decide(session, logits, draft_tokens, draft_probs, first=None) -> rejection.Verdict:
        tokens = torch.tensor(list(draft_tokens), dtype=torch.long)
        if session.mode is VerificationMode.GREEDY:
            return rejection.verify_greedy(logits, tokens)
        # Row i decides the token at absolute position len(session.tokens) + i, with that position's draws.
        position, seed = len(session.tokens), session.sampling.seed
        # Rows past the first rejection: no softmax, no top-p.
        row = rows_when_reached(logits, session.sampling, first)
        vocab = logits.shape[1]
        if session.mode is VerificationMode.COUPLED:
            return rejection.verify_coupled_rows(row, tokens, vocab, _coupled_noise(session))
        uniforms = draws.uniforms(seed, draws.Stream.TARGET, range(position, position + len(tokens) + 1), 2)
        if session.mode is VerificationMode.TOKEN_ONLY or not draft_tokens:
            return rejection.verify_token_only_rows(row, tokens, vocab, uniforms)
        return rejection.verify_draft_probs_rows(row, draft_probs, tokens, vocab, uniforms)


def _coupled_noise(session: TargetSession) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """The Gumbel noise of the session's position ``i`` past its committed tokens, for token ids [n]: the draws
    coupled verification decides a block's row i (a chain) or a tree's depth i with."""
    position, seed = len(session.tokens), session.sampling.seed
    return lambda i, ids: draws.gumbel(seed, draws.Stream.COUPLED, position + i, ids)


def block_successors(
    sessions: Sequence[TargetSession], logits: Sequence[torch.Tensor], blocks: Sequence[Sequence[int]]
) -> list[Successors | None]:
    """Per block (rows [k+1, vocab] of the raw logits, before its tokens are committed) the session's best
    successors of each position: after its last context token, then after each draft token. One ``topk`` over
    the forward's rows for every session that asked; None for the others."""
    asking = [i for i, session in enumerate(sessions) if session.successors_k]
    found: list[Successors | None] = [None] * len(sessions)
    if not asking:
        return found
    ranked = block_topk([logits[i] for i in asking], max(sessions[i].successors_k for i in asking))
    for i, ids in zip(asking, ranked):
        k = sessions[i].successors_k
        found[i] = Successors(k, (sessions[i].tokens[-1], *blocks[i]), tuple(ids[:, :k].flatten().tolist()))
    return found


def penalized(
    session: TargetSession,
    logits: torch.Tensor,  # [k+1, vocab] a block's raw logits: one row per position (a tree: root, then nodes)
    draft_tokens: Sequence[int],  # [k]
    parents: Sequence[int] | None,  # [k] a token tree, or None for a chain
) -> torch.Tensor:  # [k+1, vocab] the logits the session's penalties and biases make of them
    """Each row adjusted with its own context: the committed tokens, then the draft tokens on its path."""
    if not session.sampling.penalizes:
        return logits
    if parents is None:
        paths = chain_paths(draft_tokens)
    else:
        paths = [(), *([draft_tokens[j] for j in token_tree.path_to(parents, i)] for i in range(len(parents)))]
    return apply_penalties(logits, session.sampling, session.tokens, paths)


def committed_features(cache, position: int, accepted: int, path: Sequence[int] = ()) -> FeatureBlock | None:
    """The hidden features of the positions a forward fed that are now committed, when the session asked.

    The forward fed positions from ``cache.features_from`` on; those through the
    last accepted draft token (``position + accepted - 1``) are committed: for a
    token tree, the context's tail and the accepted nodes (``path``). The new
    next token has none yet. A long prefill keeps only its last rows.
    """
    if not cache.feature_layers or cache.features is None:
        return None
    tail = position - cache.features_from  # fed rows of the context before the block
    if path:
        return FeatureBlock(cache.features_from, cache.features[[*range(tail), *(tail + i for i in path)]]).last_rows()
    return FeatureBlock(cache.features_from, cache.features[: tail + accepted]).last_rows()


def _tree_path(verdict: Decided, parents: Sequence[int] | None) -> tuple[int, ...]:
    return () if parents is None else tuple(verdict.path)
