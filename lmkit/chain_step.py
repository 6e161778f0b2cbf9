"""A model drafter's chain of k tokens as one replay of the static step (``graph_step``): no host sync between tokens.

A model drafter proposes k tokens, each the next token after the last. Captured, a small draft's step costs about a
millisecond on a GPU, and choosing each token on the host between steps (a copy to the host, Python, a copy back)
adds a good part of that again per token. vLLM's V2 speculator, SGLang's EAGLE draft runner and TensorRT-LLM's
ChainDrafter capture the whole drafting loop instead; so does this: one graph per chain length k and kind runs k
one-token steps over the session's KV blocks (reading the whole span a slot may hold), each choosing its token on
the device and feeding it to the next step, and writes the k tokens, with each one's margin over its runner-up and
that runner-up (and, sampling, the q each was drawn from), to buffers the host reads once. How a token is chosen:

    greedy    the argmax of the logits
    sample    from q = ``sampling.static_probs`` of the logits (temperature, top-k, top-p: the request's, as tensors
              the graph reads), by the noise of the token's position computed on the device from its key: coupled,
              argmax(log q + G) with the COUPLED Gumbel noise (``draws.gumbel_rows``); else the inverse CDF of q
              at the position's DRAFT uniform (``draws.uniform_rows``), q first rounded as it travels
              (``probs_codec.quantize_unchecked``) when the draft sends its probabilities

Each position also writes its second choice for a token tree and that choice's probability: greedy, the likeliest
other token; coupled, the runner-up of log q + G. Each chooses what ``ModelDrafter``'s token-at-a-time loop
chooses, by the same arithmetic over the same values. A request's penalties, biases and min_tokens adjust each
position's logits first (``penalties.adjust``: the host's arithmetic), from its committed tokens' counts, each
drafted token counted in on the device. Off CUDA
the chain runs eagerly: the tests' path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from specsplit.lmkit import draws, penalties, probs_codec, sampling
from specsplit.lmkit.penalties import PenaltyParams

GREEDY, SAMPLE = "greedy", "sample"
_NEUTRAL = sampling.SamplingParams()  # adjusts nothing
KINDS = (GREEDY, SAMPLE)
MAX_CHAIN = 16  # the longest chain captured (a graph per length and kind); longer blocks draft token by token


@dataclass(frozen=True)
class Draw:
    """How a sampled chain draws (``ChainStep.run``): the request's seed and q's settings; ``coupled``: Gumbel-max
    with the COUPLED noise, else the inverse CDF at the DRAFT uniforms; ``quantize``: q rounded as it travels."""

    seed: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    coupled: bool = True
    quantize: bool = False


@dataclass
class _Settings:
    """A sampled chain's settings as tensors its graph reads (one set for every chain: they run one at a time)."""

    temperature: torch.Tensor  # [] float32
    top_k: torch.Tensor  # [] int64
    top_p: torch.Tensor  # [] float64
    coupled: torch.Tensor  # [] bool
    quantize: torch.Tensor  # [] bool
    probs: torch.Tensor  # [max_length, vocab] float32: row i, the q drawn from at the chain's i-th position

    def load(self, draw: Draw) -> None:
        """``draw``'s settings into these tensors (the graph's inputs keep their addresses)."""
        for name in ("temperature", "top_k", "top_p", "coupled", "quantize"):
            getattr(self, name).fill_(getattr(draw, name))


@dataclass
class _Chain:
    """One chain graph's static inputs and outputs."""

    step: object  # the width-1 inputs of the static step (``GraphStep.new_inputs``); ids and positions advance
    keys: torch.Tensor  # [k] int64: each drafted position's key (sample): COUPLED when coupled, else DRAFT
    tokens: torch.Tensor  # [k] long
    others: torch.Tensor  # [k] long: each position's runner-up
    margins: torch.Tensor  # [k] float32: each token's logit minus its runner-up's
    branches: torch.Tensor  # [k] long: each position's second choice for a tree (greedy, coupled)
    seconds: torch.Tensor  # [k] float32: its probability; -1 where there is none (a support of one token)


class Chained(NamedTuple):
    """What a chain drafted: k tokens, each one's margin over its runner-up and that runner-up, the q each was
    drawn from (where it travels), and each position's second choice for a tree with its probability."""

    tokens: list[int]
    margins: list[float]
    others: list[int]
    probs: torch.Tensor | None
    branches: list[int]
    seconds: list[float]


class ChainStep:
    """``ChainStep(graph, max_length, graphs)``; ``run(slot, start, token, k, draw)`` -> the k tokens after ``token``
    fed at ``start`` of ``slot`` (greedy, or drawn as ``draw`` says), with their margins, runners-up and q."""

    def __init__(self, graph, max_length: int, graphs: bool = False) -> None:
        if not 1 <= max_length <= graph.capacity:
            raise ValueError(f"a chain holds 1 to {graph.capacity} tokens, got {max_length}")
        self.graph, self.max_length = graph, max_length
        device = graph.device
        long = dict(dtype=torch.long, device=device)
        vocab = int(graph.step.embed.shape[0])
        with torch.inference_mode():
            # a penalized request's adjustments, neutral otherwise (``penalties.chain_state``): one set, every chain
            self.penalties = {name: value.to(device) for name, value in
                              penalties.chain_state(_NEUTRAL, [], vocab).items()}
            self._penalized = False
            self.chains = {(kind, k): _Chain(
                graph.new_inputs(1, 1), torch.zeros(k, **long), torch.zeros(k, **long), torch.zeros(k, **long),
                torch.zeros(k, dtype=torch.float32, device=device), torch.zeros(k, **long),
                torch.zeros(k, dtype=torch.float32, device=device),
            ) for kind in KINDS for k in range(1, max_length + 1)}
            self.vocab = torch.arange(vocab, device=device)
            self.settings = settings_of(Draw(0, 1.0), device, (max_length, self.vocab.numel()))
            self._one = torch.ones(1, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        if graphs:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        stream = torch.cuda.Stream(self.graph.device)
        stream.wait_stream(torch.cuda.current_stream(self.graph.device))
        with torch.cuda.stream(stream):
            for key, chain in self.chains.items():  # warm-up: lazy initialisation stays out of the graphs
                self._run(chain, *key)
        torch.cuda.current_stream(self.graph.device).wait_stream(stream)
        pool = None
        for key in sorted(self.chains, key=lambda kind_k: kind_k[1], reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(self.chains[key], *key)
            pool = graph.pool()
            self.graphs[key] = graph

    def _run(self, chain: _Chain, kind: str, k: int) -> None:
        """k steps, each feeding the token the last one chose: tensor operations only."""
        for i in range(k):
            self.graph.run(chain.step, self.graph.spans[-1])
            position = chain.step.positions[0, 0] + 1  # the drafted token's
            logits = penalties.adjust(chain.step.logits[0, 0].float(), self.penalties, position)  # [vocab]
            if kind == GREEDY:
                token = logits.argmax()
                # the tree's second choice: the likeliest other token (the first of a tie: never the token itself)
                probs = torch.softmax(logits, dim=-1)
                branch = probs.index_fill(0, token.view(1), -1.0).argmax()
                second = probs[branch]
            else:
                token, q, scores = choose(logits[None], self.settings, chain.keys[i : i + 1], self.vocab)
                token = token[0]
                self.settings.probs[i] = q[0]
                # coupled: the runner-up of log q + G, what the target's coupled token is when it is not this one
                runner = scores[0].index_fill(0, token.view(1), float("-inf"))
                branch = runner.argmax()
                second = torch.where(runner[branch] > float("-inf"), q[0, branch], -1.0)
            top = torch.topk(logits, 2).indices
            other = torch.where(top[0] == token, top[1], top[0])
            chain.tokens[i] = token
            chain.others[i] = other
            chain.margins[i] = logits[token] - logits[other]
            chain.branches[i] = branch
            chain.seconds[i] = second
            self.penalties["generated"].index_add_(0, token.view(1), self._one)  # counted in for the next position
            self.penalties["seen"].index_fill_(0, token.view(1), True)
            chain.step.ids.copy_(token.view(1, 1))
            chain.step.positions.add_(1)
            chain.step.rope.add_(1)

    @torch.inference_mode()
    def run(self, slot: int, start: int, token: int, k: int, draw: Draw | None = None,
            penalized: tuple[PenaltyParams, Sequence[int]] | None = None) -> Chained:
        """Feed ``token`` at ``start`` of ``slot`` (whose positions < start hold the session's keys and values) and
        the k - 1 tokens chosen after it: the argmax (``draw`` None) or drawn as ``draw`` says, the token at position
        n with n's noise. Returns the k chosen tokens, each one's margin, its runner-up, (``draw.quantize``) the
        [k, vocab] q each was drawn from, on the device, and each position's second choice for a tree with its
        probability. ``penalized``: a request's penalties, biases and min_tokens with its committed tokens (prompt
        first), applied to each position's logits as ``penalties.apply_penalties`` applies them, the drafted tokens
        counted in. The slot then holds positions up to start + k - 1."""
        if not 1 <= k <= self.max_length:
            raise ValueError(f"a chain of {k} tokens; this step chains 1 to {self.max_length}")
        if start + k > self.graph.capacity:
            raise ValueError(f"positions {start}..{start + k - 1} do not fit a slot of {self.graph.capacity}")
        if not 0 <= slot < self.graph.slots:
            raise ValueError(f"slot {slot} is not one of the {self.graph.slots} slots")
        kind = GREEDY if draw is None else SAMPLE
        chain = self.chains[(kind, k)]
        self.graph.hold(slot, start + k)
        chain.step.ids.fill_(token)
        chain.step.positions.fill_(start)
        chain.step.rope.fill_(start)
        chain.step.slots.fill_(slot)
        if draw is not None:
            if not draw.temperature > 0:
                raise ValueError(f"a sampled chain needs a temperature > 0, got {draw.temperature}")
            stream = draws.Stream.COUPLED if draw.coupled else draws.Stream.DRAFT
            keys = draws.position_keys(draw.seed, stream, range(start + 1, start + 1 + k))
            chain.keys.copy_(draws.key_tensor(keys), non_blocking=True)
            self.settings.load(draw)
        if penalized is not None or self._penalized:  # loaded, or set back to neutral after a penalized chain
            params, context = penalized if penalized is not None else (_NEUTRAL, [])
            for name, value in penalties.chain_state(params, context, self.vocab.numel()).items():
                self.penalties[name].copy_(value, non_blocking=True)
            self._penalized = penalized is not None
        if (kind, k) in self.graphs:
            self.graphs[(kind, k)].replay()
        else:
            self._run(chain, kind, k)
        ids = torch.cat([chain.tokens, chain.others, chain.branches]).tolist()  # the one wait for the device
        probs = self.settings.probs[:k].clone() if draw is not None and draw.quantize else None
        return Chained(ids[:k], chain.margins.tolist(), ids[k : 2 * k], probs, ids[2 * k:], chain.seconds.tolist())


def choose(logits: torch.Tensor, settings: _Settings, keys: torch.Tensor,
           vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens a sampled chain step draws from [rows, vocab] float32 logits ([rows] long), the q [rows, vocab]
    each was drawn from and the coupled scores log q + G [rows, vocab] float64, by tensor operations only:
    q = ``sampling.static_probs`` under ``settings``; coupled, argmax(log q + G), G the Gumbel noise of ``vocab``
    (every token id) under the row's COUPLED key (``keys`` [rows]; Gumbel-max: a sample from q); else the inverse
    CDF of q (rounded as it travels where ``settings.quantize``) at the row's DRAFT uniform under its key."""
    q = sampling.static_probs(logits, settings.temperature, settings.top_k, settings.top_p)
    scores = q.to(torch.float64).log() + draws.gumbel_rows(keys, vocab)
    coupled = scores.argmax(dim=-1)
    q = torch.where(settings.quantize, probs_codec.quantize_unchecked(q), q)
    uniform = draws.uniform_rows(keys, torch.zeros(1, dtype=torch.long, device=keys.device))[:, 0]
    return torch.where(settings.coupled, coupled, draws.inverse_cdf_index(q.to(torch.float64), uniform)), q, scores


def settings_of(draw: Draw, device=None, probs: tuple[int, int] = (1, 1)) -> _Settings:
    """``draw``'s settings as the tensors ``choose`` reads, with a ``probs`` buffer of that shape (rows, vocab)."""
    return _Settings(torch.tensor(float(draw.temperature), dtype=torch.float32, device=device),
                     torch.tensor(draw.top_k, dtype=torch.long, device=device),
                     torch.tensor(draw.top_p, dtype=torch.float64, device=device),
                     torch.tensor(draw.coupled, device=device), torch.tensor(draw.quantize, device=device),
                     torch.zeros(probs, dtype=torch.float32, device=device))
