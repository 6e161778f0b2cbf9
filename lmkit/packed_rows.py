"""Several sessions' tokens in one forward, packed into one sequence, each row attending to its own cache.

A step feeds some tokens of one session (a row): the tail of its context not cached yet, then its
draft block or token tree. All rows of a forward are packed end to end, with no padding:

    packed:  [ row 0 (n_0 tokens) | row 1 (n_1) | ... ]      input_ids, position_ids: [1, T]

The linear layers see T tokens whatever the rows are; attention runs per row (``_attention``,
registered with transformers' ``AttentionInterface``) against the row's own cache in place, so each
row computes what its solo step computes, and a wide row costs the forward its own tokens only. A
model given a decoder step (``use_step``; ``specsplit.lmkit.decoder_step``) runs the same arithmetic
as plain tensor functions instead of transformers' module tree.
Only the positions whose logits are needed go through the LM head (``logits_to_keep``). A layer that
attends within a sliding window (all of Mistral's, five in six of Gemma 3's) reads each row's mask for its
window, counted by position (a tree node's by its depth). A model with layers of another kind (linear
attention, say) or that does not dispatch attention through ``AttentionInterface`` is not installed and
keeps its stock forward and ``DynamicCache``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specsplit.lmkit import decoder_step
from specsplit.lmkit.kv_buffer import KVBuffer
from specsplit.lmkit.models import cache_kwargs
from specsplit.lmkit.transfer import to_host

log = logging.getLogger(__name__)

ATTENTION = "specsplit_packed_rows"
_INSTALLED = "_specsplit_packed_rows"
_STEP = "_specsplit_decoder_step"
# A 4D attention mask is passed through transformers untouched: in a packed forward the masks are per row.
_NO_MODEL_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


@dataclass(frozen=True)
class RowStep:
    """One session's share of a packed forward.

    The buffer is cropped to ``start`` positions, ``tokens`` are fed at
    ``positions`` (default start, start + 1, ...) under ``mask`` (default
    causal), and the logits of ``logit_rows`` (indices into ``tokens``) are
    returned. Afterwards the buffer holds start + len(tokens) positions.
    """

    kv: KVBuffer
    start: int
    tokens: Sequence[int]  # [n]
    logit_rows: Sequence[int]  # [m], indices into tokens
    positions: Sequence[int] | None = None  # [n]; None: start .. start + n - 1
    mask: torch.Tensor | None = None  # [n, start + n] bool, True = attends; None: causal
    # Hidden states to return for every fed token (a feature drafter's, EAGLE): indices into the model's
    # hidden states (0 = embeddings, i = input of decoder layer i); empty = none.
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Row:
    kv: KVBuffer
    start: int
    width: int
    offset: int  # where the row's tokens start in the packed sequence
    # by a layer's sliding window (None: full attention): [width, start + width] bool, or None: every cached and
    # fed position
    masks: dict[int | None, torch.Tensor | None]


def window_mask(start: int, positions: Sequence[int], size: int) -> torch.Tensor:  # -> [n, start + n] bool
    """Which keys each fed token sees inside a sliding window of ``size``: the cached positions 0..start-1 and the
    fed tokens' own ``positions`` (a tree's by depth), each seen from a query at position q when q - p < size."""
    keys = torch.tensor([*range(start), *positions])
    return keys[None, :] > torch.tensor(list(positions))[:, None] - size


def unsupported(model) -> str | None:
    """Why the packed forward cannot run ``model`` (None: it can): it needs layers of full or sliding-window
    attention, uncapped, a causal model and attention dispatched by name."""
    config = model.config
    name = f"{type(model).__name__} ({config.model_type})"
    try:
        decoder_step.windows(config)
    except ValueError as exc:
        return f"{name}: {exc}"
    if not getattr(config, "is_causal", True):
        return f"{name} is not causal"
    if getattr(config, "attn_logit_softcapping", None):
        return f"{name} caps its attention logits (attn_logit_softcapping), which SDPA cannot"
    if not getattr(model, "_can_set_attn_implementation", lambda: False)() or \
            config._attn_implementation not in ("sdpa", "eager", ATTENTION):
        return f"{name} runs attention {config._attn_implementation!r}, which cannot be swapped for packed rows"
    return None


def supports(model) -> bool:
    """Whether the packed forward can run ``model`` (``unsupported`` says why not)."""
    return unsupported(model) is None


def install(model) -> bool:
    """Route ``model``'s attention through the packed-rows function; returns whether it could.

    Outside a packed forward (e.g. ``model.generate``) the installed model
    still runs transformers' own SDPA attention and masks.
    """
    if not supports(model):
        return False
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    # A view of another model (a self-draft) may hold layers whose modules read a config of their own (copied
    # layers) or the other model's (shared ones): each must dispatch to the packed-rows attention too.
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION
    setattr(model, _INSTALLED, True)
    return True


def installed(model) -> bool:
    return bool(getattr(model, _INSTALLED, False))


def use_step(model, step) -> None:
    """Run the packed forwards of an installed ``model`` through ``step`` (a ``decoder_step.DecoderStep`` over its
    weights), or through transformers' forward again (None)."""
    if not installed(model):
        raise ValueError("install the packed-rows forward before giving it a decoder step")
    setattr(model, _STEP, step)


def install_fast_forward(model, compile_mode: str = "off", pack: Callable[[object], int] | None = None) -> str:
    """Install the packed-rows forward and, where the model allows, a decoder step compiled by ``compile_mode``
    (resolved: ``off`` or ``inductor``); returns what runs the packed forwards, for the log.

    ``pack`` (oneDNN-packed linears, ``packed_linear.pack_linears``) runs for an eager step or transformers'
    forward; inductor compiles plain linears, since it cannot lower packed weights of a dynamic token count.
    The inductor step is compiled here, by warm-up forwards of one and of several tokens; a failure leaves
    the eager step in place and says why."""
    step = False  # whether the eager decoder step runs the packed forwards
    if not install(model):
        kind = f"transformers' stock forward ({unsupported(model)})"
    elif reason := decoder_step.unsupported(model):
        kind = f"transformers' forward over packed rows ({reason})"
    else:
        if compile_mode == "inductor":
            began = time.perf_counter()
            try:
                use_step(model, decoder_step.DecoderStep(model, decoder_step.compiler("inductor")))
                warm_up(model)
                return f"the decoder step, compiled by inductor in {time.perf_counter() - began:.1f} s"
            except Exception as exc:  # a model or platform inductor cannot compile: run eager, say why once
                log.warning("could not compile the decoder step (%s: %s); running it eager", type(exc).__name__, exc)
        step, kind = True, "the decoder step, eager"
    if pack:
        pack(model)
    if step:
        use_step(model, decoder_step.DecoderStep(model))  # built after packing: it calls the packed linears
    return kind


def warm_up(model) -> None:
    """Run the packed forward once with one token and once with several (two rows), on scratch caches."""
    layers = int(model.config.num_hidden_layers)
    for widths in ((1,), (3, 2)):
        forward_rows(model, [RowStep(KVBuffer(layers), 0, [0] * width, [width - 1]) for width in widths])


def step_of(model):
    """The decoder step ``use_step`` gave ``model``; None: transformers' forward runs its packed steps."""
    return getattr(model, _STEP, None)


def causal_mask(start: int, width: int, device=None) -> torch.Tensor:  # -> [width, start + width] bool
    """Fed token i attends to every cached position and to fed tokens 0..i."""
    return torch.ones(width, start + width, dtype=torch.bool, device=device).tril(diagonal=start)


def forward_rows(model, steps: Sequence[RowStep]) -> list[torch.Tensor]:
    """Run every step in one packed forward; returns per step the logits of its ``logit_rows`` [m, vocab] (float32, CPU)."""
    return forward_rows_with_features(model, steps)[0]


@torch.inference_mode()
def forward_rows_with_features(
    model, steps: Sequence[RowStep]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``forward_rows``, and per step the hidden states of its ``feature_layers`` for every fed token,
    concatenated: [n, len(feature_layers) * hidden] float32 on the CPU (None for a step that asks for none)."""
    if not steps:
        return [], []
    device = next(model.parameters()).device
    rows, ids, positions, keep = [], [], [], []
    offset = 0
    windows = decoder_step.windows(model.config)  # each layer's
    sizes = set(windows)
    for step in steps:
        width = len(step.tokens)
        if width == 0:
            raise ValueError("a packed step must feed at least one token")
        step.kv.crop(step.start)
        mask = step.mask
        if mask is None and (width > 1 or sizes != {None}):
            mask = causal_mask(step.start, width)
        if mask is not None and tuple(mask.shape) != (width, step.start + width):
            raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {(width, step.start + width)}")
        fed = range(step.start, step.start + width) if step.positions is None else step.positions
        masks = {size: mask if size is None else mask & window_mask(step.start, fed, size) for size in sizes}
        rows.append(_Row(step.kv, step.start, width, offset,
                         {size: None if m is None else m.to(device) for size, m in masks.items()}))
        ids.extend(step.tokens)
        positions.extend(range(step.start, step.start + width) if step.positions is None else step.positions)
        keep.extend(offset + i for i in step.logit_rows)
        offset += width
    decoder = step_of(model)
    wanted = sorted({i for s in steps for i in s.feature_layers})
    if decoder is not None and all(i <= decoder.num_layers for i in wanted):
        logits, hidden = decoder(
            torch.tensor([ids], dtype=torch.long, device=device),
            torch.tensor([positions], dtype=torch.long, device=device),
            rows, torch.tensor(keep, dtype=torch.long, device=device), wanted,
        )
    else:
        out = model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            attention_mask=_NO_MODEL_MASK.to(device),
            **cache_kwargs(model, _RowsCache(rows, int(model.config.num_hidden_layers))),
            use_cache=True,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
            output_hidden_states=bool(wanted),
            specsplit_rows=rows,
            specsplit_windows=windows,
        )
        logits, hidden = out.logits[0], out.hidden_states
    logits = to_host(logits)  # [len(keep), vocab]
    results, features, first = [], [], 0
    for step, row in zip(steps, rows):
        step.kv.length = row.start + row.width
        results.append(logits[first : first + len(step.logit_rows)])
        first += len(step.logit_rows)
        fed = slice(row.offset, row.offset + row.width)  # each hidden state: [1, T, hidden]
        features.append(
            torch.cat([hidden[i][0, fed] for i in step.feature_layers], dim=-1).float().cpu()
            if step.feature_layers else None
        )
    return results, features


class _RowsLayer(CacheLayerMixin):
    """A layer of the packed forward's cache: writes each row's new keys/values into its session's buffer."""

    is_sliding = False

    def __init__(self, layer: int, rows: Sequence[_Row]) -> None:
        super().__init__()
        self.layer = layer
        self.rows = rows
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # nothing to allocate
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # [1, kv_heads, T, head_dim] each; attention reads the rows' buffers, not this return value
        for row in self.rows:
            fed = slice(row.offset, row.offset + row.width)
            row.kv.write(self.layer, row.start, key_states[:, :, fed], value_states[:, :, fed])
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _RowsCache(Cache):
    def __init__(self, rows: Sequence[_Row], n_layers: int) -> None:
        super().__init__(layers=[_RowsLayer(layer, rows) for layer in range(n_layers)])


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Per-row attention of a packed forward; anything else goes to transformers' SDPA attention.

    query: [1, heads, T, head_dim]. Returns [1, T, heads, head_dim], as the
    attention interface expects. Row i's queries attend to its own session's cached
    keys/values plus its new ones, which the cache adapter wrote there before attention
    reads them (``decoder_step.attend_rows``, which the decoder step runs too).
    """
    rows, windows = kwargs.pop("specsplit_rows", None), kwargs.pop("specsplit_windows", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return decoder_step.attend_rows(module.layer_idx, query, rows, scaling, gqa=query.shape[1] != key.shape[1],
                                    window=windows[module.layer_idx]), None
