"""The model drafter: a causal LM sharing the target's vocabulary, with its own KV cache.

It drafts autoregressively: greedy argmax, or sampling from q processed by the same
``logits_to_probs`` as the target's p, the token at absolute position n drawn with the session's
``specsplit.lmkit.draws`` uniform for (DRAFT, n); penalties and biases adjust its logits as they
adjust the target's (``apply_penalties``, the drafted tokens counted). In coupled verification it
proposes argmax(log q_n + G(seed, n)) with the target's own Gumbel noise at n, so it is accepted whenever q
and p pick the same token under the same noise. Rolled-back tokens are dropped lazily: the session
cache keeps the longest prefix shared with the committed context and crops the rest on the next
proposal. ``SamplingDrafter`` is what it shares with the EAGLE drafter; greedy token trees add its
second choices as leaves (``ModelDrafter.propose_tree``; EAGLE-2, Li et al. 2024).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from specsplit.draft_service.drafter import ContextDrafter, Proposal
from specsplit.lmkit import chain_step, draws, token_tree
from specsplit.lmkit.kvcache import SessionCache, common_prefix
from specsplit.lmkit.probs_codec import quantize_probs
from specsplit.lmkit.sampling import SamplingParams, apply_penalties, logits_to_probs


class SamplingDrafter(ContextDrafter):
    """A drafter over a committed context that draws each token from logits: the argmax when greedy, else a
    sample from q = ``logits_to_probs(logits)`` (fp16-rounded first when q travels, DRAFT_PROBS mode) with the
    session's uniform for the token's absolute position; in coupled verification argmax(log q + G) with the
    target's Gumbel noise at that position."""

    def __init__(
        self, prompt: Sequence[int], sampling: SamplingParams, return_probs: bool, coupled: bool = False
    ) -> None:
        if not prompt:
            raise ValueError(f"{type(self).__name__} needs a non-empty context")
        super().__init__(prompt)
        self._sampling = sampling
        self._return_probs = return_probs and not sampling.greedy
        self._coupled = coupled and not sampling.greedy

    def _next(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at absolute ``position`` from [1, vocab] logits, and the distribution it came from."""
        if self._sampling.greedy:
            return int(logits[0].argmax()), None
        q = logits_to_probs(logits, self._sampling)  # [1, vocab]
        seed = self._sampling.seed
        if self._coupled:
            return draws.gumbel_max(q[0], lambda ids: draws.gumbel(seed, draws.Stream.COUPLED, position, ids)), None
        if self._return_probs:
            # Sample from exactly what the target will decode from the wire.
            q = quantize_probs(q)
        u = float(draws.uniforms(seed, draws.Stream.DRAFT, [position], 1)[0, 0])
        token = draws.inverse_cdf(q[0].to(torch.float64), u)
        return token, (q if self._return_probs else None)

    def _runner_up(self, logits: torch.Tensor, token: int, position: int) -> tuple[float, int] | None:
        """The second choice at absolute ``position`` beside the drafted ``token`` ([1, vocab] logits)."""
        if self._sampling.greedy:
            return _runner_up(logits[0], token)
        q = logits_to_probs(logits, self._sampling)[0]  # [vocab]
        seed = self._sampling.seed
        other = draws.gumbel_runner_up(q, lambda ids: draws.gumbel(seed, draws.Stream.COUPLED, position, ids), token)
        return None if other is None else (float(q[other]), other)


class ModelDrafter(SamplingDrafter):
    """Drafts with a model of the target's vocabulary, one forward a drafted token, over a session cache
    ``new_cache(model)`` builds: the forward the service set the model up with (``lmkit.forward``), a slot of the
    static step under ``--compile cuda-graphs``."""

    def __init__(
        self, model, prompt: Sequence[int], sampling: SamplingParams, return_probs: bool, coupled: bool = False,
        new_cache: Callable[[object], SessionCache] = SessionCache,
    ) -> None:
        super().__init__(prompt, sampling, return_probs, coupled)
        self._cache = new_cache(model)

    def close(self) -> None:
        self._cache.release()

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    def prepare(self, budget: int = 0) -> bool:
        """Prefill the cache with the context but its last token, which the first proposal feeds: the next
        ``budget`` tokens of it (0: all), so that a long prompt is read a chunk at a time between other sessions'
        proposals. Whether the whole context is read."""
        wanted = len(self._tokens) - 1
        if wanted < 1:
            return True
        read = min(common_prefix(self._cache.tokens, self._tokens), wanted)
        if read >= wanted:
            return True
        end = min(read + budget, wanted) if budget > 0 else wanted
        try:
            self._cache.logits(self._tokens[:end], [])
        except BaseException:
            self._cache.reset()  # a half-written cache: the first proposal reads the context itself
            raise
        return end >= wanted

    def prepare_from(self, source: "ModelDrafter") -> int:
        """Start the cache as a copy of ``source``'s where it holds this context but its last token (a
        fork: another sample of the prompt); else read the context (``prepare``). Returns the positions
        copied."""
        wanted = len(self._tokens) - 1
        same_model = source._cache.runs_like(self._cache)
        if wanted < max(1, source._cache.copy_floor) or not same_model or \
                common_prefix(source._cache.tokens, self._tokens[:wanted]) < wanted:
            self.prepare()
            return 0
        self._cache.copy_prefix(source._cache, wanted)
        return wanted

    def propose(self, k: int) -> Proposal:
        return self._draft(k, None)

    def propose_tree(self, k: int, max_branches: int, max_nodes: int) -> Proposal:
        """Greedy and coupled: the chain plus up to max_branches - 1 second choices as leaves; other sampling:
        the chain.

        The second choices go where the draft was least sure (the largest second-best probability), each
        as a leaf beside its first: the top-2 branching of EAGLE-2 (Li et al. 2024), kept to leaves so
        that a tree costs no extra draft forward. Coupled, a second choice is the runner-up of log q + G
        with the target's noise: what the target's coupled token is when it is not the chain's.
        """
        if not (self._sampling.greedy or self._coupled) or max_branches <= 1:
            return self.propose(min(k, max_nodes))
        k = min(k, max_nodes)
        runners_up: list[tuple[float, int, int]] = []  # (probability, position, token) of each second choice
        block = self._draft(k, runners_up)
        leaves = sorted(runners_up, reverse=True)[: min(max_branches - 1, max_nodes - len(block.tokens))]
        if not leaves:
            return block
        by_position = {position: token for _, position, token in leaves}
        tokens, parents = [], []
        for position, token in enumerate(block.tokens):
            parent = len(tokens) - 1 - (position - 1 in by_position) if position else token_tree.ROOT
            tokens.append(token)
            parents.append(parent)
            if position in by_position:
                tokens.append(by_position[position])
                parents.append(parent)
        return Proposal(tokens=tokens, parents=parents)

    def _chain_draw(self, k: int) -> tuple[bool, chain_step.Draw | None]:
        """Whether the cache's chain step drafts this request's k tokens in one replay, and how it draws them (None:
        the argmax); else (False, None): token by token."""
        chains = getattr(self._cache, "chains", None)
        sampling = self._sampling
        if chains is None or not 1 <= k <= chains.max_length:
            return False, None
        if sampling.greedy:
            return True, None
        return True, chain_step.Draw(sampling.seed, sampling.temperature, sampling.top_k, sampling.top_p,
                                     coupled=self._coupled, quantize=self._return_probs and not self._coupled)

    def _draft(self, k: int, runners_up: list | None) -> Proposal:
        """The chain; with ``runners_up`` (greedy, coupled), also the second choice at each position."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        chained, draw = self._chain_draw(k)
        if chained:  # the k tokens in one replay, chosen on the device, each position's second choice beside
            chain = self._cache.draft_chain(self._tokens, k, draw,
                                            self._sampling if self._sampling.penalizes else None)
            if runners_up is not None:
                runners_up += [(second, position, branch) for position, (second, branch)
                               in enumerate(zip(chain.seconds, chain.branches)) if second >= 0]
            index = min(range(k), key=lambda i: chain.margins[i])
            return Proposal(tokens=chain.tokens, probs=chain.probs, second_guess=(index, chain.others[index]))
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        margins: list[tuple[float, int]] = []  # (how sure, runner-up) per drafted position
        for position in range(k):
            logits = self._cache.logits([*self._tokens, *drafted], [])  # [1, vocab]
            logits = apply_penalties(logits, self._sampling, self._tokens, [drafted])  # as the target's p has them
            token, probs = self._next(logits, len(self._tokens) + len(drafted))
            margins.append(_margin(logits[0], token))
            drafted.append(token)
            if probs is not None:
                rows.append(probs)
            if runners_up is not None:
                found = self._runner_up(logits, token, len(self._tokens) + len(drafted) - 1)
                if found is not None:
                    runners_up.append((found[0], position, found[1]))
        probs = torch.cat(rows) if self._return_probs and rows else None
        second_guess = None
        if margins:
            index = min(range(len(margins)), key=lambda i: margins[i][0])
            second_guess = (index, margins[index][1])
        return Proposal(tokens=drafted, probs=probs, second_guess=second_guess)


def _runner_up(logits: torch.Tensor, token: int) -> tuple[float, int]:
    """The probability and id of the most likely token other than ``token`` (logits: [vocab]).

    Not ``topk(2)[1]``: under a tie for the top, topk may rank the drafted token second, and a
    sibling equal to its chain token is a tree the target refuses.
    """
    probs = torch.softmax(logits, dim=-1)  # [vocab]
    other = int(probs.index_fill(0, torch.tensor([token]), -1.0).argmax())
    return float(probs[other]), other


def _margin(logits: torch.Tensor, token: int) -> tuple[float, int]:
    """How sure the draft is of ``token`` (its logit minus the best other one's) and that other token.

    logits: [vocab]. The position with the smallest margin is where the target
    most likely rejects the block, and the runner-up its most likely correction.
    """
    top = torch.topk(logits, 2)
    first, second = int(top.indices[0]), int(top.indices[1])
    other = second if first == token else first
    return float(logits[token] - logits[other]), other
