"""A session's KV cache over a token sequence, reused across rounds and cropped on rejection.

Both the target and the model drafter run a model over a context that grows by a few tokens per
round and sometimes loses its tail (rejected draft tokens). ``SessionCache`` keeps the tokens whose
keys/values are cached, reuses the longest common prefix with the next sequence, crops the rest and
feeds only what is new, so no round re-reads the prompt. Every layer keeps every position, sliding
windows included, so any rejected token can be rolled back; layer types with other state (linear
attention, chunked attention, shared KV) are refused at start-up (``check_cache_layout``).

A model with the packed-rows forward installed (``specsplit.lmkit.packed_rows``) keeps its
keys/values in a ``KVBuffer`` (written in place, cropped by length) and runs its steps through
``forward_rows``; any other model keeps a ``DynamicCache`` and its stock forward.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from specsplit.lmkit import decoder_step, packed_rows, token_tree
from specsplit.lmkit.kv_buffer import ROLLBACK, KVBuffer
from specsplit.lmkit.models import cache_kwargs
from specsplit.lmkit.transfer import to_device, to_host


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# Attention layer types whose whole state is keys and values per position (what SessionCache keeps).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE variants whose frequencies depend on the longest position in the forward: rows of a batch would
# change each other's rotary scaling, so such models verify each session alone.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_cache_layout(model) -> None:
    """Refuse (ValueError, naming it) a model whose layers keep state a ``SessionCache`` cannot hold or crop."""
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"{name} has {', '.join(unsupported)} layers; specsplit keeps per-position keys/values that it can "
            f"roll back, which supports {' and '.join(SUPPORTED_LAYER_TYPES)} layers only"
        )
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(f"{name} uses chunked attention (attention_chunk_size); specsplit does not support it")
    if getattr(config, "kv_sharing_modes", None):
        raise ValueError(f"{name} shares KV caches between layers (kv_sharing_modes); specsplit does not support it")


def rope_types(model) -> set[str]:
    """The RoPE variants a model uses (several for models with per-layer-type RoPE, e.g. Gemma 3)."""
    params = getattr(model.config.get_text_config(decoder=True), "rope_parameters", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)]
    return {str(p.get("rope_type", "default")) for p in (nested or [params])}


def rows_share_rope(model) -> bool:
    """True when a batched forward's rows cannot change each other's rotary embedding."""
    return not rope_types(model) & set(BATCH_DEPENDENT_ROPE)


class SessionCache:
    """KV cache of one session; not thread-safe (one compute thread per service).

    On the packed forward a sliding-window layer (Mistral's, Gemma 3's) keeps its window and
    ``kv_buffer.ROLLBACK`` positions more (``KVBuffer``), so its memory follows the window while a
    rejected block can still be rolled back; a step that would roll back further feeds the context again
    (``plan``). On the stock forward every layer keeps all its positions (the window is the attention
    mask's job): transformers' own ``DynamicSlidingWindowLayer`` keeps only the last window - 1 positions
    and cannot be cropped once full, so a rejected draft token past the window could not be rolled back.
    """

    def __init__(self, model, rollback: int = ROLLBACK) -> None:
        self._model = model
        self._device = next(model.parameters()).device
        self._rollback = rollback  # positions a sliding layer keeps beyond its window (``KVBuffer``)
        packed = packed_rows.installed(model)
        self.kv = self._new_kv() if packed else None
        # full layers only: a sliding window is the mask's job (class docstring)
        self.cache = None if packed else DynamicCache()
        self.tokens = []  # through the setter: no match remembered yet
        # Feature drafters (EAGLE): hidden states to keep from each forward, as indices into the
        # model's hidden states (0 = embeddings, i = input of decoder layer i); empty = none.
        self.feature_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None  # [fed, width] of the last forward, row 0 at features_from
        self.features_from = 0
        self.fed = 0  # positions this cache's own steps (``apply``) computed, for the service's counters

    def _new_kv(self) -> KVBuffer:
        return KVBuffer(int(self._model.config.num_hidden_layers), decoder_step.windows(self._model.config),
                        self._rollback)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The tokens whose keys/values are in the cache. Changed through the cache's own steps only: it remembers
        how many of them matched the context it last planned for (``plan``)."""
        return self._tokens

    @tokens.setter
    def tokens(self, tokens: list[int]) -> None:
        self._tokens = tokens
        self._matched = 0  # tokens[:_matched] equal the first tokens of the context the last plan saw

    def cached(self, feed: Sequence[int]) -> None:
        """A step computed ``feed`` after the kept positions: they are cached now."""
        self._tokens.extend(feed)

    def _forget_from(self, length: int) -> None:
        del self._tokens[length:]
        self._matched = min(self._matched, length)

    gives_features = True  # keeps the hidden states of ``feature_layers`` (EAGLE, Medusa)

    def gives_layers(self, layers: Sequence[int]) -> bool:
        """Whether this cache keeps the hidden states of every one of ``layers``."""
        return self.gives_features or not layers

    @property
    def supports_trees(self) -> bool:
        """Token-tree blocks need the packed-rows forward (a tree mask, positions by depth)."""
        return self.kv is not None

    def logits(
        self, context: Sequence[int], block: Sequence[int], parents: Sequence[int] | None = None,
        all_rows: bool = False, grown: bool = False,
    ) -> torch.Tensor:
        """Logits after ``context[-1]`` and after each token of ``block`` (``grown``: as in ``plan``).

        Returns [len(block) + 1, vocab] float32 on the CPU: row i predicts the
        token at position len(context) + i. Afterwards the cache holds
        context + block. With ``parents`` the block is a token tree
        (``specsplit.lmkit.token_tree``): row i + 1 follows node i's root path, and the
        cache holds context + every node until ``keep_path``. ``all_rows``: a row
        for every token fed, the context's not cached yet first (scoring a prompt).
        """
        keep, feed = self.plan(context, block, grown)
        return self.apply(keep, feed, len(feed) if all_rows else len(block) + 1, parents)

    def plan(self, context: Sequence[int], block: Sequence[int], grown: bool = False) -> tuple[int, list[int]]:
        """How many cached positions to keep, and which tokens to feed after them.

        ``grown``: ``context`` is the context of this cache's previous plan with tokens appended (a session's
        committed tokens): only the tokens after those that plan matched are compared, so planning a step costs
        what the context gained since, not its length.
        """
        if not context:
            raise ValueError("context must hold at least one token")
        limit = len(context) - 1  # the last context token is always fed so its logits exist
        start = min(self._matched, limit) if grown else 0
        keep = start + common_prefix(self._tokens[start:limit], context[start:limit])
        if keep < self.copy_floor:  # its sliding layers dropped positions that step would need: feed them again
            keep = 0
        self._matched = keep
        return keep, [*context[keep:], *block]

    @property
    def copy_floor(self) -> int:
        """The fewest positions, but 0, this cache can be cropped to or copied (``copy_prefix``): its sliding
        layers keep only the window and the roll-back positions before the last step."""
        return self.kv.floor if self.kv is not None else 0

    def row_step(
        self, keep: int, feed: Sequence[int], n_logits: int, parents: Sequence[int] | None = None
    ) -> packed_rows.RowStep:
        """This cache's share of a packed forward; ``parents``: the last len(parents) fed tokens form a tree."""
        rows = range(len(feed) - n_logits, len(feed))
        if parents is None:
            return packed_rows.RowStep(self.kv, keep, list(feed), rows, feature_layers=self.feature_layers)
        positions, mask = token_tree.step_layout(keep, len(feed) - len(parents), parents)
        return packed_rows.RowStep(self.kv, keep, list(feed), rows, positions, mask, self.feature_layers)

    @torch.inference_mode()
    def apply(
        self, keep: int, feed: Sequence[int], n_logits: int, parents: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Crop to ``keep`` positions, feed ``feed``, return the last ``n_logits`` rows [n_logits, vocab]."""
        if parents is not None and not self.supports_trees:
            raise ValueError("this model runs its stock forward, which cannot verify token trees")
        self.crop(keep)
        if self.kv is not None:
            step = self.row_step(keep, feed, n_logits, parents)
            logits, features = packed_rows.forward_rows_with_features(self._model, [step])
            if self.feature_layers:
                self.features, self.features_from = features[0], keep
        else:
            ids = to_device(torch.tensor([list(feed)], dtype=torch.long), self._device)
            out = self._model(
                input_ids=ids, **cache_kwargs(self._model, self.cache), use_cache=True, logits_to_keep=n_logits,
                output_hidden_states=bool(self.feature_layers),
            )
            self.keep_features(out.hidden_states, 0, keep, len(feed))
            logits = [to_host(out.logits[0])]  # small: [n_logits, vocab]; verification runs on the CPU
        self.cached(feed)
        self.fed += len(feed)
        return logits[0]

    def reset(self) -> None:
        """Forget every cached position (a failed step may have left the cache half-written)."""
        if self.kv is not None:
            self.kv = self._new_kv()
        else:
            self.cache = DynamicCache()
        self.tokens = []
        self.features = None

    def keep_features(self, hidden_states, row: int, start: int, fed: int) -> None:
        """Keep the chosen layers' hidden states of a forward's ``fed`` positions (row ``row``), from ``start`` on."""
        if self.feature_layers:
            # each hidden state: [batch, width of the forward, hidden]
            self.features = torch.cat([hidden_states[i][row, :fed] for i in self.feature_layers], dim=-1).float().cpu()
            self.features_from = start

    def runs_like(self, other: "SessionCache") -> bool:
        """Whether ``other`` caches the same model's keys and values in the same layout (a copy is exact)."""
        return self._model is other._model and (self.kv is None) == (other.kv is None)

    @property
    def can_copy(self) -> bool:
        """Whether ``copy_prefix`` may take this cache's positions (a sharded cache's live on other ranks too)."""
        return True

    @torch.inference_mode()
    def copy_prefix(self, source: "SessionCache", length: int) -> None:
        """Hold a copy of ``source``'s first ``length`` cached positions, and nothing else (a fork of a session
        whose context starts with those tokens: its next step feeds only what follows them)."""
        if not 0 <= length <= len(source.tokens):
            raise ValueError(f"cannot copy {length} of {len(source.tokens)} cached positions")
        if (self.kv is None) != (source.kv is None):
            raise ValueError("both caches must run the same forward (packed rows or the stock one)")
        if self.kv is not None:
            self.kv = source.kv.prefix_copy(length)
        else:
            layers = [(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone())
                      for layer in source.cache.layers] if length else None
            self.cache = DynamicCache(layers)
        self.tokens = source.tokens[:length]
        self.features = None

    def release(self) -> None:  # noqa: B027 - a hook; the plain cache is freed by the GC
        """Called once when the session ends (a sharded cache tells the other ranks)."""

    def keep_path(self, length: int, path: Sequence[int]) -> None:
        """After a tree step: keep ``length`` positions, then the tree nodes ``path`` (root first) after them."""
        nodes = self._tokens[length:]
        self._move_path(length, path)
        self._forget_from(length)
        self._tokens.extend(nodes[i] for i in path)

    def _move_path(self, length: int, path: Sequence[int]) -> None:
        """The keys and values of nodes ``path`` moved to positions length, length + 1, ... (``keep_path``)."""
        self.kv.keep_path(length, path)

    def crop(self, length: int) -> None:
        """Drop cached positions at index >= ``length`` (``KVBuffer.crop`` refuses a length its sliding layers no
        longer hold: ``plan`` feeds the context again there)."""
        extra = len(self._tokens) - length
        if extra > 0:
            if self.kv is not None:
                self.kv.crop(length)
            else:
                self.cache.crop(-extra)  # a negative count: transformers 5.x refuses a positive one
            self._forget_from(length)


def kv_bytes_per_token(model, tp_degree: int = 1) -> int:
    """Bytes of keys and values one position costs on each of ``tp_degree`` ranks: 2 (K and V) x layers x
    KV heads x head size x the element size; a rank of a tensor-parallel model holds 1/tp of the heads."""
    config = model.config
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or config.hidden_size // heads)
    element = next(model.parameters()).element_size()
    return max(2 * int(config.num_hidden_layers) * kv_heads * head_dim * element // max(tp_degree, 1), 1)
