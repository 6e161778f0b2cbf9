"""A model drafter's chain of k tokens as one replay of the static step (``graph_step``): no host sync between tokens.

A model drafter proposes k tokens, each the next token after the last. Captured, a small draft's step costs about a
millisecond on a GPU, and choosing each token on the host between steps (a copy to the host, Python, a copy back)
adds a good part of that again per token. vLLM's V2 speculator, SGLang's EAGLE draft runner and TensorRT-LLM's
ChainDrafter capture the whole drafting loop instead; so does this: one graph per chain length k runs k one-token
steps over the session's KV slot, each choosing its token on the device and feeding it to the next step, and writes
the k tokens, with each one's margin over its runner-up and that runner-up, to buffers the host reads once. How a
token is chosen:

    greedy    the argmax of the logits
    gumbel    coupled sampling: argmax(log q + G), q the softmax of the logits at the request's temperature and G
              the COUPLED Gumbel noise of the token's position, computed on the device from the position's key
              (``draws.gumbel_rows``)

Each chooses what ``ModelDrafter``'s token-at-a-time loop chooses, by the same functions over the same values.
Requests with top-k or top-p, penalties, biases or min_tokens, token-only or draft-probs sampling, and token trees
draft token by token over the same slot. Off CUDA the chain runs eagerly: the tests' path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.lmkit import draws

GREEDY, GUMBEL = "greedy", "gumbel"
KINDS = (GREEDY, GUMBEL)
MAX_CHAIN = 16  # the longest chain captured (a graph per length and kind); longer blocks draft token by token


@dataclass
class _Chain:
    """One chain graph's static inputs and outputs."""

    step: object  # the width-1 inputs of the static step (``GraphStep.new_inputs``); ids and positions advance
    keys: torch.Tensor  # [k] int64: each drafted position's COUPLED key (gumbel)
    temperature: torch.Tensor  # [] float32 (gumbel)
    tokens: torch.Tensor  # [k] long
    others: torch.Tensor  # [k] long: each position's runner-up
    margins: torch.Tensor  # [k] float32: each token's logit minus its runner-up's


class ChainStep:
    """``ChainStep(graph, max_length, graphs)``; ``run(slot, start, token, k, kind, keys, temperature)`` -> the k
    tokens after ``token`` fed at ``start`` of ``slot``, with their margins and runners-up."""

    def __init__(self, graph, max_length: int, graphs: bool = False) -> None:
        if not 1 <= max_length <= graph.capacity:
            raise ValueError(f"a chain holds 1 to {graph.capacity} tokens, got {max_length}")
        self.graph, self.max_length = graph, max_length
        device = graph.device
        with torch.inference_mode():
            self.chains = {(kind, k): _Chain(
                graph.new_inputs(1, 1), torch.zeros(k, dtype=torch.long, device=device),
                torch.ones((), dtype=torch.float32, device=device), torch.zeros(k, dtype=torch.long, device=device),
                torch.zeros(k, dtype=torch.long, device=device), torch.zeros(k, dtype=torch.float32, device=device),
            ) for kind in KINDS for k in range(1, max_length + 1)}
            self.vocab = torch.arange(int(graph.step.embed.shape[0]), device=device)
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
            self.graph.run(chain.step)
            logits = chain.step.logits[0, 0].float()  # [vocab]
            token = choose(kind, logits, chain.temperature, chain.keys[i : i + 1], self.vocab)
            top = torch.topk(logits, 2).indices
            other = torch.where(top[0] == token, top[1], top[0])
            chain.tokens[i] = token
            chain.others[i] = other
            chain.margins[i] = logits[token] - logits[other]
            chain.step.ids.copy_(token.view(1, 1))
            chain.step.positions.add_(1)

    @torch.inference_mode()
    def run(self, slot: int, start: int, token: int, k: int, kind: str, keys: torch.Tensor | None = None,
            temperature: float = 1.0) -> tuple[list[int], list[float], list[int]]:
        """Feed ``token`` at ``start`` of ``slot`` (whose positions < start hold the session's keys and values) and
        the k - 1 tokens chosen after it; returns the k chosen tokens, each one's margin and its runner-up. The slot
        then holds positions up to start + k - 1. ``keys``: [k] the positions' COUPLED keys (gumbel)."""
        if not 1 <= k <= self.max_length:
            raise ValueError(f"a chain of {k} tokens; this step chains 1 to {self.max_length}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if start + k > self.graph.capacity:
            raise ValueError(f"positions {start}..{start + k - 1} do not fit a slot of {self.graph.capacity}")
        if not 0 <= slot < self.graph.slots:
            raise ValueError(f"slot {slot} is not one of the {self.graph.slots} slots")
        chain = self.chains[(kind, k)]
        chain.step.ids.fill_(token)
        chain.step.positions.fill_(start)
        chain.step.slots.fill_(slot)
        if kind == GUMBEL:
            if keys is None or keys.shape != (k,):
                raise ValueError(f"a gumbel chain of {k} tokens needs {k} position keys")
            chain.keys.copy_(keys, non_blocking=True)
            chain.temperature.fill_(temperature)
        if (kind, k) in self.graphs:
            self.graphs[(kind, k)].replay()
        else:
            self._run(chain, kind, k)
        ids = torch.cat([chain.tokens, chain.others]).tolist()  # the one wait for the device
        return ids[:k], chain.margins.tolist(), ids[k:]


def choose(kind: str, logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor,
           vocab: torch.Tensor) -> torch.Tensor:
    """The token a chain step chooses from its [vocab] float32 logits, as a 0-d long tensor, by tensor operations
    only: the argmax (greedy), or argmax(log q + G) with q = softmax(logits / temperature) and G the Gumbel noise of
    ``vocab`` (every token id) under the position's ``key`` [1] (gumbel): a sample from q (Gumbel-max)."""
    if kind == GREEDY:
        return logits.argmax()
    q = torch.softmax((logits - logits.amax()) / temperature, dim=-1)
    return (q.to(torch.float64).log() + draws.gumbel_rows(key, vocab)[0]).argmax()


def coupled_keys(seed: int, first: int, k: int) -> torch.Tensor:
    """The COUPLED keys of positions first..first+k-1 (``ChainStep.run``'s ``keys``)."""
    return draws.key_tensor(draws.position_keys(seed, draws.Stream.COUPLED, list(range(first, first + k))))
