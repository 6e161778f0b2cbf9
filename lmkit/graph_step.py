"""The decoder step over fixed-capacity KV slots, every shape static: replayable as CUDA graphs.

An eager step on a GPU is a launch per op (a few hundred for a Llama layer stack), each paid from Python
every step, so an 8B decode costs several times its memory floor (docs/performance.md, "On a GPU").
gpt-fast, vLLM and SGLang capture the step once per shape as a CUDA graph and replay it; a graph replays
the same kernels on the same addresses, so everything that changes between steps must be data in tensors
the graph reads, never a Python value or a new allocation:

    keys/values   one buffer per layer for every slot: [kv_heads, slots * capacity, head_dim], allocated once;
                  a session's slot is a range of ``capacity`` positions (``Slots`` hands them out)
    inputs        ids and positions [1, width], and the flat indices where the fed tokens' keys/values go
                  (slot * capacity + position) and where the slot's keys/values are read from
    mask          computed inside the step: key position p is visible to a fed token at position q when p <= q
    output        logits [width, vocab] of every fed token, in a buffer the graph owns

One graph per width bucket (1, 2, 4, 8, 16, ... up to ``max_width``): a block of w tokens replays the
smallest bucket >= w, padded with copies of its last token; the padding writes keys/values at positions
past the block, which no query of this step sees (the mask) and the next step overwrites before reading.
A prompt longer than the widest bucket is fed in chunks of it (chunked prefill). The arithmetic is
``decoder_step``'s (the same functions over the model's own weights), so in float32 the logits equal the
stock forward's to rounding; on the CPU the step runs eagerly, which is how the tests check it.

Chains only, one session per replay: token trees (a non-causal mask) and several sessions in one graph
are not captured here. ``GraphSessionCache`` is a session's cache in a slot (what the target engine holds
per session under ``serve-target --compile cuda-graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from specsplit.lmkit import decoder_step, errors
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.transfer import to_host


def buckets(max_width: int) -> tuple[int, ...]:
    """The widths graphs are captured for: powers of two below ``max_width``, then ``max_width``."""
    if max_width < 1:
        raise ValueError(f"max_width must be >= 1, got {max_width}")
    out, width = [], 1
    while width < max_width:
        out.append(width)
        width *= 2
    return (*out, max_width)


class Slots:
    """Which slots of the KV buffers are free; a released slot is handed out again, lowest first."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            raise errors.ResourceExhausted(f"every one of the {self.count} KV slots is held; retry when a session ends")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.count or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)
        self._free.sort(reverse=True)


@dataclass
class _Inputs:
    """One bucket's static inputs and output (their addresses are what its graph reads and writes)."""

    ids: torch.Tensor  # [1, width] long
    positions: torch.Tensor  # [1, width] long
    write_index: torch.Tensor  # [width] long: slot * capacity + position of each fed token
    read_index: torch.Tensor  # [capacity] long: slot * capacity + 0 .. capacity - 1
    logits: torch.Tensor | None = None  # [width, vocab], the step's output


class GraphStep:
    """``GraphStep(model, slots, capacity, max_width, graphs)``; ``forward(slot, start, tokens)`` -> logits.

    ``graphs``: capture each bucket as a CUDA graph (a CUDA model only); off, the same static step runs
    eagerly (any device). ``compile_fn`` (``decoder_step.compiler``) compiles the per-token functions, whose
    kernels the graphs then capture."""

    def __init__(self, model, slots: int, capacity: int, max_width: int = 16, graphs: bool = False,
                 compile_fn=None) -> None:
        if capacity < max_width:
            raise ValueError(f"capacity {capacity} must hold at least one block of max_width {max_width}")
        # the weights and per-token functions (``compile_fn``: compiled first, then captured with the rest)
        self.step = decoder_step.DecoderStep(model, compile_fn)
        config = model.config
        first = model.model.layers[0].self_attn
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(first.head_dim)
        self.capacity, self.slots, self.max_width = capacity, slots, max_width
        weight = self.step.embed
        self.device, self.dtype = weight.device, weight.dtype
        with torch.inference_mode():
            shape = (self.kv_heads, slots * capacity, self.head_dim)
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.step.layers]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.step.layers]
            self.key_positions = torch.arange(capacity, device=self.device)
            self.inputs = {w: self._new_inputs(w) for w in buckets(max_width)}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphs:
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA model; this one is on {self.device}")
            self._capture()

    def _new_inputs(self, width: int) -> _Inputs:
        long = dict(dtype=torch.long, device=self.device)
        return _Inputs(torch.zeros(1, width, **long), torch.zeros(1, width, **long), torch.zeros(width, **long),
                       torch.arange(self.capacity, **long))

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every bucket (widest first, so the narrower ones reuse its memory pool)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for inputs in self.inputs.values():  # warm-up runs: lazy initialisation stays out of the graphs
                for _ in range(2):
                    self._run(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = None
        for width in sorted(self.inputs, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(self.inputs[width])
            pool = graph.pool()
            self.graphs[width] = graph

    def _run(self, inputs: _Inputs) -> None:
        """The step over ``inputs``, writing ``inputs.logits``: only tensor operations, no host value read."""
        step = self.step
        hidden = F.embedding(inputs.ids, step.embed)  # [1, w, hidden]
        cos, sin = decoder_step.rotary(step.inv_freq, step.rope_scaling, inputs.positions, hidden.dtype)
        visible = self.key_positions[None, :] <= inputs.positions[0][:, None]  # [w, capacity]
        for layer in step.layers:
            q, k, v = step.attention_inputs(hidden, *layer.inputs, cos, sin, self.head_dim)
            keys, values = self.keys[layer.index], self.values[layer.index]
            keys.index_copy_(1, inputs.write_index, k[0])
            values.index_copy_(1, inputs.write_index, v[0])
            attended = F.scaled_dot_product_attention(
                q, keys.index_select(1, inputs.read_index)[None], values.index_select(1, inputs.read_index)[None],
                attn_mask=visible, scale=layer.scaling, enable_gqa=q.shape[1] != k.shape[1],
            )  # [1, heads, w, head_dim]
            hidden = step.attention_outputs(hidden, attended.transpose(1, 2), *layer.outputs)
        logits = step.lm_head(decoder_step.rms_norm(hidden, *step.norm))[0]
        if inputs.logits is None:
            inputs.logits = logits
        else:
            inputs.logits.copy_(logits)

    @torch.inference_mode()
    def forward(self, slot: int, start: int, tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens`` at positions start.. of ``slot`` (whose positions < start hold this session's keys and
        values); returns their logits [len(tokens), vocab] on the device, valid until the next call."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of the {self.slots} slots")
        if not tokens:
            raise ValueError("feed at least one token")
        if len(tokens) <= self.max_width:
            return self._chunk(slot, start, tokens)
        # chunked: each chunk's logits are copied out before the next replay overwrites its bucket's output
        return torch.cat([self._chunk(slot, start + first, tokens[first : first + self.max_width]).clone()
                          for first in range(0, len(tokens), self.max_width)])

    @torch.inference_mode()
    def copy(self, source: int, target: int, length: int) -> None:
        """Positions 0..length-1 of slot ``source`` into slot ``target`` (a fork's shared prompt)."""
        if length:
            src = slice(source * self.capacity, source * self.capacity + length)
            dst = slice(target * self.capacity, target * self.capacity + length)
            for buffers in (self.keys, self.values):
                for layer in buffers:
                    layer[:, dst] = layer[:, src]

    def _chunk(self, slot: int, start: int, tokens: Sequence[int]) -> torch.Tensor:
        width = len(tokens)
        bucket = next(b for b in self.inputs if b >= width)
        if start + bucket > self.capacity:
            raise ValueError(f"positions {start}..{start + width - 1} (a block of {bucket} with its padding) do not fit "
                             f"a slot of {self.capacity}")
        inputs = self.inputs[bucket]
        padded = [*tokens, *[tokens[-1]] * (bucket - width)]
        positions = torch.arange(start, start + bucket)
        inputs.ids.copy_(torch.tensor([padded]), non_blocking=True)
        inputs.positions.copy_(positions[None], non_blocking=True)
        inputs.write_index.copy_(positions + slot * self.capacity, non_blocking=True)
        inputs.read_index.copy_(torch.arange(self.capacity) + slot * self.capacity, non_blocking=True)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            self._run(inputs)
        return inputs.logits[:width]


class GraphSessionCache(SessionCache):
    """A session's cache in one slot of a shared ``GraphStep``: chains only, no hidden features.

    Cropping only forgets tokens: the slot's stale positions are overwritten by the next step before any
    query reads them."""

    gives_features = False

    def __init__(self, model, graph: GraphStep, slots: Slots) -> None:
        super().__init__(model)
        self.cache = None  # the keys and values live in the graph's buffers
        self._graph, self._slots = graph, slots
        self.slot: int | None = slots.take()

    @property
    def supports_trees(self) -> bool:
        return False

    @torch.inference_mode()
    def apply(
        self, keep: int, feed: Sequence[int], n_logits: int, parents: Sequence[int] | None = None
    ) -> torch.Tensor:
        if parents is not None:
            raise ValueError("the CUDA-graph step verifies chains only, not token trees")
        if self.feature_layers:
            raise ValueError("the CUDA-graph step returns no hidden features")
        if self.slot is None:
            raise ValueError("this session's cache was released")
        self.crop(keep)
        logits = to_host(self._graph.forward(self.slot, keep, feed)[-n_logits:])
        self.tokens = [*self.tokens, *feed]
        self.fed += len(feed)
        return logits

    def crop(self, length: int) -> None:
        self.tokens = self.tokens[:length]

    def reset(self) -> None:
        self.tokens = []
        self.features = None

    def runs_like(self, other: SessionCache) -> bool:
        return isinstance(other, GraphSessionCache) and other._graph is self._graph

    @torch.inference_mode()
    def copy_prefix(self, source: SessionCache, length: int) -> None:
        if not self.runs_like(source) or source.slot is None:
            raise ValueError("both caches must be slots of the same CUDA-graph step")
        if not 0 <= length <= len(source.tokens):
            raise ValueError(f"cannot copy {length} of {len(source.tokens)} cached positions")
        self._graph.copy(source.slot, self.slot, length)
        self.tokens = source.tokens[:length]
        self.features = None

    def release(self) -> None:
        if self.slot is not None:
            self._slots.release(self.slot)
            self.slot = None
