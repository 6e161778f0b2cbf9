"""The decoder step over KV in fixed-size blocks, every shape static: replayable as CUDA graphs.

An eager step on a GPU is a launch per op (a few hundred for a Llama layer stack), each paid from Python
every step, so an 8B decode costs several times its memory floor (docs/performance.md, "On a GPU").
gpt-fast, vLLM and SGLang capture the step once per shape as a CUDA graph and replay it; a graph replays
the same kernels on the same addresses, so everything that changes between steps must be data in tensors
the graph reads, never a Python value or a new allocation:

    keys/values   one pool per layer: [kv_heads, (blocks + 1) * block_size, head_dim], allocated once; a session
                  holds the blocks its tokens fill (``Blocks`` hands them out as it grows and takes them back when
                  it ends), so memory follows the tokens held, not sessions x the longest context; the last block
                  is scratch, where positions no block was taken for (a row's padding) are written
    tables        which block holds each block-sized span of a session's positions: [slots + 1, max_blocks], a
                  row per session (its slot), entries past what it holds pointing at the scratch block; a graph
                  reads the rows of its batch
    inputs        ids and positions [batch, width] and each row's slot [batch]; where a fed token's keys and
                  values go (its block, then its offset) and which a row reads are computed inside the step; the
                  rotary positions [batch, width] (a token tree's node at its depth, not its place in the block)
                  and which fed tokens each fed token sees [batch, width, width] (a chain: those up to it; a tree:
                  the fed context before it and its ancestors)
    mask          computed inside the step: a fed token sees every position before its row's block and the fed
                  tokens its row of the block mask names, within the model's sliding window where it has one
    output        logits [batch, width, vocab] of every fed token, in a buffer the graph owns; with
                  ``feature_layers``, also the hidden states entering those layers (0 = the embeddings; the number
                  of layers = the final norm's output) [batch, width, layers, hidden], which feature drafters
                  (EAGLE, Medusa) read: a fixed set chosen at start-up, so every replay writes the same buffers

One graph per (batch, width, span) bucket: batches 1, 2, 4, ... up to ``max_batch`` sessions, widths 1, 2, 4, 8,
16, ... up to ``max_width`` tokens, spans (the blocks each row reads) from ``min_read`` positions doubling up to a
session's capacity; the graphs of one (batch, width) share its inputs and output buffer, so the spans add graphs,
not memory. A step replays the smallest bucket that holds its rows and the longest of their contexts, so a short
session reads a short span whatever the capacity, and a step's cost follows the tokens held. Rows are
padded to the bucket's width with copies of their last token, whose keys and values land past the row's block
(in the scratch block where the row holds no block there), which no query of this step sees (the mask) and the
next step overwrites before reading; missing rows run with the scratch slot, whose table points at the scratch
block. More sessions than ``max_batch`` replay in groups; a prompt longer than the widest bucket is fed in chunks
of it (chunked prefill). The arithmetic is ``decoder_step``'s (the same functions over the model's own weights),
so in float32 the logits equal the stock forward's to rounding; on the CPU the step runs eagerly, which is how
the tests check it. Attention is SDPA over the gathered blocks (a paged attention kernel, FlashAttention's or
FlashInfer's, is not used yet), so a step reads its span of blocks, not exactly its tokens.

Token trees and feature sessions replay the same graphs as chains (the block mask and rotary positions are inputs); after the verdict
the accepted path's keys and values move to consecutive positions (``keep_path``). ``GraphSessionCache`` is a
session's cache
in a slot (what the target engine holds per session under ``serve-target --compile cuda-graphs``);
``forward_steps`` runs several sessions' steps in one replay (the engine's batched verify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from specsplit.lmkit import chain_step, decoder_step, errors, token_tree
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


class Blocks:
    """Which KV blocks are free; ``take(n)`` hands out n (lowest first), ``release`` takes them back."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise errors.ResourceExhausted(f"{n} more KV blocks wanted, {len(self._free)} of {self.count} free; "
                                           "retry when a session ends")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
        self._free.sort(reverse=True)


@dataclass
class _Inputs:
    """One bucket's static inputs and output (their addresses are what its graph reads and writes)."""

    ids: torch.Tensor  # [batch, width] long
    positions: torch.Tensor  # [batch, width] long
    slots: torch.Tensor  # [batch] long: each row's slot (padding rows: the scratch slot)
    rope: torch.Tensor  # [batch, width] long: each fed token's rotary position
    sees: torch.Tensor  # [batch, width, width] bool: which of its row's fed tokens each fed token attends to
    logits: torch.Tensor | None = None  # [batch, width, vocab], the step's output
    features: torch.Tensor | None = None  # [batch, width, len(feature_layers), hidden]: the hidden states kept


class Row(NamedTuple):
    """One session's share of a step: ``tokens`` fed at ``start``.. of ``slot``, the last len(parents) of them a
    token tree after the fed context (``lmkit.token_tree``) where ``parents`` is given. A plain (slot, start,
    tokens) tuple is a chain's row."""

    slot: int
    start: int
    tokens: Sequence[int]
    parents: Sequence[int] | None = None


def row_layout(start: int, count: int, width: int, parents: Sequence[int] | None) -> tuple[list[int], torch.Tensor]:
    """A row's rotary positions [width] and block mask [width, width] for ``count`` fed tokens padded to ``width``:
    a chain causal; with ``parents``, the fed tokens' part of ``token_tree.step_layout`` (a tree node at the fed
    context's end plus its depth, seeing the fed context and its ancestors)."""
    rope = list(range(start, start + width))
    sees = torch.ones(width, width, dtype=torch.bool).tril()
    if parents:
        positions, mask = token_tree.step_layout(0, count - len(parents), parents)  # the block's part alone
        rope[:count], sees[:count, :count] = [start + position for position in positions], mask
    return rope, sees


class GraphStep:
    """``GraphStep(model, slots, capacity, max_width, graphs, max_batch=..., block_size=..., blocks=...)``;
    ``forward(slot, start, tokens)`` -> logits of one session; ``forward_rows(rows)`` -> each row's logits, the rows
    replayed together.

    ``slots``: the sessions held at once; ``capacity``: the most positions one holds (its block table's reach);
    ``blocks``: the KV pool, in blocks of ``block_size`` positions (default: every slot at capacity); ``min_read``:
    the shortest span of positions a step reads. ``graphs``: capture each bucket as a CUDA graph (a CUDA model
    only); off, the same static step runs eagerly (any device). ``compile_fn`` (``decoder_step.compiler``) compiles
    the per-token functions, whose kernels the graphs then capture. ``feature_layers``: the hidden states every
    replay also writes out, for feature drafters (none: the step gives no features)."""

    def __init__(self, model, slots: int, capacity: int, max_width: int = 16, graphs: bool = False,
                 compile_fn=None, max_batch: int = 1, block_size: int = 16, blocks: int | None = None,
                 min_read: int = 512, feature_layers: Sequence[int] = ()) -> None:
        if capacity < max_width:
            raise ValueError(f"capacity {capacity} must hold at least one block of max_width {max_width}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if reason := decoder_step.unsupported(model, static=True):
            raise ValueError(f"the static step cannot run this model: {reason}")
        # the weights and per-token functions (``compile_fn``: compiled first, then captured with the rest)
        self.step = decoder_step.DecoderStep(model, compile_fn)
        config = model.config
        first = model.model.layers[0].self_attn
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.feature_layers = tuple(sorted(set(feature_layers)))
        self.windows = sorted({layer.window for layer in self.step.layers}, key=lambda w: w or 0)  # None: full
        if any(not 0 <= i <= self.step.num_layers for i in self.feature_layers):
            raise ValueError(f"feature layers {list(self.feature_layers)} must be in [0, {self.step.num_layers}]")
        self.head_dim = int(first.head_dim)
        self.capacity, self.slots, self.max_width, self.max_batch = capacity, slots, max_width, max_batch
        self.block_size = block_size
        self.max_blocks = -(-capacity // block_size)  # a table's entries
        self.blocks = Blocks(slots * self.max_blocks if blocks is None else blocks)
        if self.blocks.count < 1:
            raise ValueError(f"a KV pool of {self.blocks.count} blocks holds nothing")
        self.scratch = slots  # the slot padding rows run in
        self.scratch_block = self.blocks.count
        self.held: list[list[int]] = [[] for _ in range(slots)]  # each slot's blocks, in position order
        weight = self.step.embed
        self.device, self.dtype = weight.device, weight.dtype
        self.widths, self.batches = buckets(max_width), buckets(max_batch)
        first_span = min(self.max_blocks, max(1, -(-min_read // block_size)))
        self.spans = tuple(span for span in buckets(self.max_blocks) if span >= first_span)
        with torch.inference_mode():
            shape = (self.kv_heads, (self.blocks.count + 1) * block_size, self.head_dim)
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.step.layers]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.step.layers]
            self.tables = torch.full((slots + 1, self.max_blocks), self.scratch_block, dtype=torch.long,
                                     device=self.device)
            self.offsets = torch.arange(block_size, device=self.device)
            # one set of inputs and outputs per (batch, width), which the graphs of every span read and write
            self.inputs = {(b, w): self.new_inputs(b, w) for b in self.batches for w in self.widths}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.chains = None  # a drafter's ``chain_step.ChainStep`` over these slots, where one is built
        if graphs:
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA model; this one is on {self.device}")
            self._capture()

    def new_inputs(self, batch: int, width: int) -> _Inputs:
        """Static inputs of one (batch, width) bucket, on the device."""
        long = dict(dtype=torch.long, device=self.device)
        positions = torch.arange(width, **long).repeat(batch, 1)
        sees = torch.ones(width, width, dtype=torch.bool, device=self.device).tril().repeat(batch, 1, 1)
        return _Inputs(torch.zeros(batch, width, **long), positions, torch.full((batch,), self.scratch, **long),
                       positions.clone(), sees)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every bucket (largest first, so the smaller ones reuse its memory pool)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for inputs in self.inputs.values():  # warm-up runs: lazy initialisation stays out of the graphs
                for span in self.spans:
                    for _ in range(2):
                        self.run(inputs, span)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = None
        buckets = [(b, w, n) for b, w in self.inputs for n in self.spans]
        for bucket in sorted(buckets, key=lambda bws: (bws[0] * bws[1] * bws[2], bws), reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.run(self.inputs[bucket[:2]], bucket[2])
            pool = graph.pool()
            self.graphs[bucket] = graph

    def run(self, inputs: _Inputs, span: int) -> None:
        """The step over ``inputs``, each row reading the first ``span`` blocks of its table, writing
        ``inputs.logits``: only tensor operations, no host value read."""
        step, size = self.step, self.block_size
        batch, width = inputs.ids.shape
        hidden = step.embedding(inputs.ids)  # [b, w, hidden]
        rotations = step.rotations(inputs.rope, hidden.dtype)
        tables = self.tables.index_select(0, inputs.slots)  # [b, max_blocks]
        written = tables.gather(1, torch.div(inputs.positions, size, rounding_mode="floor"))  # [b, w] blocks
        write_index = (written * size + inputs.positions % size).reshape(-1)  # [b * w]
        read_index = (tables[:, :span, None] * size + self.offsets).reshape(-1)  # [b * span * size]
        # a key before the row's block is seen by every fed token; one in the block as the block mask says
        places = torch.arange(span * size, device=self.device)  # [s]: the keys' places in the row's blocks
        offset = places - inputs.positions[:, :1]  # [b, s]: their places in the fed block
        fed = offset.clamp(0, width - 1)
        in_block = inputs.sees.gather(2, fed[:, None, :].expand(batch, width, -1))
        visible = ((offset < 0)[:, None, :] | ((offset < width)[:, None, :] & in_block))[:, None]  # [b, 1, w, s]
        masks = {None: visible}
        if self.windows != [None]:  # a sliding layer's: a key at position p is seen from position q when q - p <
            # window (a tree's by depth)
            key_positions = torch.where((offset >= 0) & (offset < width), inputs.rope.gather(1, fed), places)
            masks.update({window: visible & (key_positions[:, None, None, :] > inputs.rope[:, None, :, None] - window)
                          for window in self.windows if window})
        rows = (self.kv_heads, batch, span * size, self.head_dim)
        kept = dict.fromkeys(self.feature_layers)  # hidden states entering these layers
        for layer in step.layers:
            if layer.index in kept:
                kept[layer.index] = hidden
            q, k, v = step.attention_inputs(hidden, *layer.inputs, *rotations[layer.rope], self.head_dim)
            keys, values = self.keys[layer.index], self.values[layer.index]
            keys.index_copy_(1, write_index, k.transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim))
            values.index_copy_(1, write_index, v.transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim))
            attended = F.scaled_dot_product_attention(
                q,
                keys.index_select(1, read_index).view(rows).transpose(0, 1),
                values.index_select(1, read_index).view(rows).transpose(0, 1),
                attn_mask=masks[layer.window], scale=layer.scaling, enable_gqa=q.shape[1] != k.shape[1],
            )  # [b, heads, w, head_dim]
            hidden = step.attention_outputs(hidden, attended.transpose(1, 2), *layer.outputs)
        normed = step.norm(hidden)
        if step.num_layers in kept:  # the final hidden state, after the norm (what the LM head reads)
            kept[step.num_layers] = normed
        logits = step.lm_head(normed)
        if inputs.logits is None:
            inputs.logits = logits
        else:
            inputs.logits.copy_(logits)
        if kept:
            features = torch.stack([kept[i] for i in self.feature_layers], dim=2)  # [b, w, layers, hidden]
            if inputs.features is None:
                inputs.features = features
            else:
                inputs.features.copy_(features)

    def span_for(self, end: int) -> int:
        """The span bucket (in blocks) that reads positions 0..end-1."""
        need = -(-end // self.block_size)
        return next(span for span in self.spans if span >= need)

    @torch.inference_mode()
    def hold(self, slot: int, end: int) -> None:
        """Blocks for positions 0..end-1 of ``slot``, taken from the pool where it holds fewer (``Blocks.take``
        raises ResourceExhausted when the pool is short)."""
        held = self.held[slot]
        need = -(-end // self.block_size) - len(held)
        if need > 0:
            taken = self.blocks.take(need)
            self.tables[slot, len(held) : len(held) + need] = torch.tensor(taken, dtype=torch.long)
            held += taken

    @torch.inference_mode()
    def forward(self, slot: int, start: int, tokens: Sequence[int], parents: Sequence[int] | None = None
                ) -> torch.Tensor:
        """Feed ``tokens`` at positions start.. of ``slot`` (whose positions < start hold this session's keys and
        values), the last len(parents) of them a token tree where ``parents`` is given; returns their logits
        [len(tokens), vocab] on the device, valid until the next call."""
        return self.forward_with_features(slot, start, tokens, parents)[0]

    @torch.inference_mode()
    def forward_with_features(self, slot: int, start: int, tokens: Sequence[int],
                              parents: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, and the fed tokens' hidden states [len(tokens), len(feature_layers), hidden] (None when the
        step keeps none)."""
        if len(tokens) <= self.max_width:
            return self.forward_rows_with_features([(slot, start, tokens, parents)])[0]
        if parents and len(parents) > self.max_width:
            raise ValueError(f"a tree of {len(parents)} nodes is wider than max_width {self.max_width}")
        # chunked: each chunk's outputs are copied out before the next replay overwrites its bucket's buffers; a
        # tree and the fed context just before it go last, in one row
        last = len(tokens) - self.max_width
        parts = []
        for first in range(0, last, self.max_width):
            logits, kept = self.forward_rows_with_features([(slot, start + first,
                                                             tokens[first : min(first + self.max_width, last)])])[0]
            parts.append((logits.clone(), None if kept is None else kept.clone()))
        parts.append(self.forward_rows_with_features([(slot, start + last, tokens[last:], parents)])[0])
        logits = torch.cat([logits for logits, _ in parts])
        return logits, None if parts[0][1] is None else torch.cat([kept for _, kept in parts])

    @torch.inference_mode()
    def forward_rows(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Each row's step (its tokens, at most ``max_width``, fed at start.. of its slot), replayed together
        ``max_batch`` rows at a time; returns each row's logits [len(tokens), vocab] on the device, valid until
        the next call."""
        return [logits for logits, _ in self.forward_rows_with_features(rows)]

    @torch.inference_mode()
    def forward_rows_with_features(self, rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``forward_rows``, and each row's hidden states [len(tokens), len(feature_layers), hidden] (None when the
        step keeps none), valid until the next call."""
        rows = [Row(*row) for row in rows]
        for slot, _, tokens, parents in rows:
            if parents and len(parents) > len(tokens):
                raise ValueError(f"a tree of {len(parents)} nodes in a row of {len(tokens)} tokens")
            if not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not one of the {self.slots} slots")
            if not tokens:
                raise ValueError("feed at least one token")
            if len(tokens) > self.max_width:
                raise ValueError(f"a row of {len(tokens)} tokens is wider than max_width {self.max_width}")
        if len({row.slot for row in rows}) != len(rows):
            raise ValueError("a step feeds each slot at most once")
        groups = [rows[i : i + self.max_batch] for i in range(0, len(rows), self.max_batch)]
        out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for group in groups:  # a later group's replay may overwrite an earlier one's output: copies, then
            outputs = self._replay(group)
            if len(groups) > 1:
                outputs = [(logits.clone(), None if kept is None else kept.clone()) for logits, kept in outputs]
            out += outputs
        return out

    def _replay(self, rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        batch = next(b for b in self.batches if b >= len(rows))
        width = next(w for w in self.widths if w >= max(len(tokens) for _, _, tokens, _ in rows))
        for _, start, tokens, _ in rows:
            if start + width > self.capacity:
                raise ValueError(f"positions {start}..{start + len(tokens) - 1} (a block of {width} with its padding) "
                                 f"do not fit a slot of {self.capacity}")
        for slot, start, tokens, _ in rows:
            self.hold(slot, start + len(tokens))
        span = self.span_for(max(start + len(tokens) for _, start, tokens, _ in rows))
        inputs = self.inputs[(batch, width)]
        ids = torch.zeros(batch, width, dtype=torch.long)
        starts = torch.zeros(batch, 1, dtype=torch.long)
        slots = torch.full((batch,), self.scratch, dtype=torch.long)
        rope = torch.arange(width).repeat(batch, 1)
        sees = torch.ones(width, width, dtype=torch.bool).tril().repeat(batch, 1, 1)
        for row, (slot, start, tokens, parents) in enumerate(rows):
            ids[row] = torch.tensor([*tokens, *[tokens[-1]] * (width - len(tokens))])
            starts[row, 0], slots[row] = start, slot
            positions, mask = row_layout(start, len(tokens), width, parents)
            rope[row], sees[row] = torch.tensor(positions), mask
        inputs.ids.copy_(ids, non_blocking=True)
        inputs.positions.copy_(starts + torch.arange(width), non_blocking=True)
        inputs.slots.copy_(slots, non_blocking=True)
        inputs.rope.copy_(rope, non_blocking=True)
        inputs.sees.copy_(sees, non_blocking=True)
        if (batch, width, span) in self.graphs:
            self.graphs[(batch, width, span)].replay()
        else:
            self.run(inputs, span)
        return [(inputs.logits[row, : len(tokens)], None if inputs.features is None else inputs.features[row, : len(tokens)])
                for row, (_, _, tokens, _) in enumerate(rows)]

    def _positions(self, blocks: Sequence[int], length: int) -> torch.Tensor:
        """The pool indices of positions 0..length-1 held in ``blocks``."""
        index = (torch.tensor(blocks, dtype=torch.long)[:, None] * self.block_size + torch.arange(self.block_size))
        return index.reshape(-1)[:length].to(self.device)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        """Give back ``slot``'s blocks, zeroed: a step reads whole blocks and masks the positions past its row, and
        a masked non-finite value still reaches the sum (0 * NaN = NaN), so nothing a session left in a block may
        reach the next session to hold it."""
        held = self.held[slot]
        if held:
            index = self._positions(held, len(held) * self.block_size)
            for buffers in (self.keys, self.values):
                for layer in buffers:
                    layer.index_fill_(1, index, 0)
            self.tables[slot] = self.scratch_block
            self.blocks.release(held)
            self.held[slot] = []

    @torch.inference_mode()
    def copy(self, source: int, target: int, length: int) -> None:
        """Positions 0..length-1 of slot ``source`` into slot ``target`` (a fork's shared prompt)."""
        if length:
            self.hold(target, length)
            src = self._positions(self.held[source], length)
            dst = self._positions(self.held[target], length)
            for buffers in (self.keys, self.values):
                for layer in buffers:
                    layer.index_copy_(1, dst, layer.index_select(1, src))

    @torch.inference_mode()
    def keep_path(self, slot: int, start: int, offsets: Sequence[int]) -> None:
        """Positions start + offsets[0], start + offsets[1], ... of ``slot`` moved to start, start + 1, ...: a
        token tree's accepted path (offsets ascend, so entries only move towards ``start``)."""
        if list(offsets) != list(range(len(offsets))):
            held = self.held[slot]
            index = self._positions(held, len(held) * self.block_size)
            src = index[torch.tensor([start + o for o in offsets], device=self.device)]
            dst = index[start : start + len(offsets)]
            for buffers in (self.keys, self.values):
                for layer in buffers:
                    layer.index_copy_(1, dst, layer.index_select(1, src))  # a copy: sources and targets may overlap

    def held_positions(self) -> int:
        """Positions the pool's taken blocks hold."""
        return (self.blocks.count - self.blocks.free) * self.block_size


class GraphSessionCache(SessionCache):
    """A session's cache in one slot of a shared ``GraphStep``: chains and token trees, and the hidden features of
    the layers the step keeps (``GraphStep.feature_layers``).

    Cropping only forgets tokens: the slot's stale positions are overwritten by the next step before any
    query reads them; after a tree, the accepted path's positions move together (``keep_path``)."""

    def __init__(self, model, graph: GraphStep, slots: Slots) -> None:
        super().__init__(model)
        self.cache = None  # the keys and values live in the graph's buffers
        self._graph, self._slots = graph, slots
        self.slot: int | None = slots.take()

    @property
    def supports_trees(self) -> bool:
        return True

    @property
    def gives_features(self) -> bool:
        return bool(self._graph.feature_layers)

    def gives_layers(self, layers: Sequence[int]) -> bool:
        return set(layers) <= set(self._graph.feature_layers)

    @property
    def feature_layers_given(self) -> tuple[int, ...]:
        return self._graph.feature_layers

    @torch.inference_mode()
    def apply(
        self, keep: int, feed: Sequence[int], n_logits: int, parents: Sequence[int] | None = None
    ) -> torch.Tensor:
        self.start_step(keep, parents)
        logits, kept = self._graph.forward_with_features(self.slot, keep, feed, parents)
        logits = to_host(logits[-n_logits:])
        self.keep_step_features(kept, keep)
        self.end_step(feed)
        return logits

    def keep_step_features(self, kept: torch.Tensor | None, keep: int) -> None:
        """The session's feature layers of a step's fed positions (``kept``: [fed, the step's layers, hidden]),
        concatenated per position as the packed forward gives them: [fed, len(feature_layers) * hidden] float32 on
        the host, from position ``keep``."""
        if self.feature_layers and kept is not None:
            index = [self._graph.feature_layers.index(i) for i in self.feature_layers]
            self.features = to_host(kept[:, index].flatten(1).float())
            self.features_from = keep

    def start_step(self, keep: int, parents: Sequence[int] | None) -> None:
        """Before a step: what the step cannot run refused, saying so; the cache cropped to ``keep``."""
        if not self.gives_layers(self.feature_layers):
            raise ValueError(f"the CUDA-graph step keeps the hidden states of layers {list(self._graph.feature_layers)}"
                             f", not all of {list(self.feature_layers)}")
        if self.slot is None:
            raise ValueError("this session's cache was released")
        self.crop(keep)

    def end_step(self, feed: Sequence[int]) -> None:
        """After a step: ``feed`` is cached."""
        self.cached(feed)
        self.fed += len(feed)

    def crop(self, length: int) -> None:
        self._forget_from(length)

    def _move_path(self, length: int, path: Sequence[int]) -> None:
        self._graph.keep_path(self.slot, length, path)

    @property
    def chains(self):
        """The step's ``chain_step.ChainStep`` (a model drafter's: its k-token chains in one replay), or None."""
        return self._graph.chains

    def draft_chain(self, context: Sequence[int], k: int, draw: chain_step.Draw | None = None,
                    penalized=None) -> chain_step.Chained:
        """The k tokens after ``context`` chosen on the device in one replay of ``chains`` (the argmax, or drawn as
        ``draw`` says), with what ``ChainStep.run`` gives beside them; the cache then holds ``context`` and the first
        k - 1 of them. A context more than one token past the cache is read first, but its last token.
        ``penalized``: the request's penalty settings (``PenaltyParams``); they count ``context``."""
        keep, feed = self.plan(context, [])
        if len(feed) > 1:  # the chain starts from one fed token: the others are read first
            self.apply(keep, feed[:-1], 1)
            keep = len(context) - 1
        self.start_step(keep, None)
        chained = self._graph.chains.run(self.slot, keep, context[-1], k, draw,
                                         None if penalized is None else (penalized, context))
        self.end_step([context[-1], *chained.tokens[:-1]])
        return chained

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
            self._graph.clear(self.slot)
            self._slots.release(self.slot)
            self.slot = None


@torch.inference_mode()
def forward_steps(steps: Sequence) -> list[torch.Tensor]:
    """Several sessions' steps (``batched_forward.Step``s over ``GraphSessionCache``s of one ``GraphStep``) in one
    replay: each cache cropped to its ``keep``, fed its ``feed``; returns each step's last ``n_logits`` rows
    (float32, on the host), as each cache's ``apply`` would."""
    caches = [step.cache for step in steps]
    graph = caches[0]._graph
    for step, cache in zip(steps, caches):
        if not cache.runs_like(caches[0]):
            raise ValueError("a batched step runs slots of one CUDA-graph step")
        cache.start_step(step.keep, step.parents)
    outputs = graph.forward_rows_with_features([(cache.slot, step.keep, step.feed, step.parents)
                                                for step, cache in zip(steps, caches)])
    host = to_host(torch.cat([rows[-step.n_logits :] for (rows, _), step in zip(outputs, steps)]))  # one wait
    out = list(host.split([step.n_logits for step in steps]))
    for step, cache, (_, kept) in zip(steps, caches, outputs):
        cache.keep_step_features(kept, step.keep)
        cache.end_step(step.feed)
    return out
