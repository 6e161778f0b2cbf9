"""A Llama-family decoder's packed-rows step as a few functions of tensors: what ``--compile`` compiles.

transformers' forward walks a module tree every step (hooks, keyword plumbing, output records, mask
builders): a few hundred small Python calls that cost more than a small model's arithmetic. This
module runs the same arithmetic over the model's own weights (no copy), the same ops in the same order
as transformers' Llama forward, so in float32 it returns the same logits bit for bit:

    per layer:  x -> rms_norm -> q, k, v projections -> rotary      (``attention_inputs``: every token)
                keys/values written into each row's KVBuffer; attention per row    (``_row_attention``)
                o projection -> + residual -> rms_norm -> MLP -> + residual   (``attention_outputs``)
    then        final rms_norm of the kept positions -> LM head

The two per-token functions see the packed tokens [1, T, hidden] whatever the rows are, so one
``torch.compile`` with a dynamic T serves every width and batch (``compiler``); attention stays per row,
against each session's cache in place, as ``packed_rows`` does it. Llama, Qwen2, Qwen3, Phi-3, Mistral and
Gemma 3 layouts (full and sliding-window layers, default or frequency-scaled RoPE, one base per layer kind)
are supported; ``unsupported`` names what is not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specsplit.lmkit.packed_linear import PackedLinear

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "mixtral")
COMPILE_MODES = ("off", "auto", "inductor", "cuda-graphs")  # serve-target --compile


def resolve_compile(mode: str, device_type: str) -> str:
    """The mode ``auto`` stands for on ``device_type``: the faster one measured there (``bench --suite step``,
    ``bench/gpu_check``; docs/performance.md has the figures). On the CPU the compiled step runs plain linears,
    which lose to the eager step's oneDNN-packed ones for a real model: ``off``. On CUDA the captured step's served
    figures (sessions batched, trees, features, the captured draft) are not measured yet: ``off`` there too."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
    if mode == "cuda-graphs" and device_type != "cuda":
        raise ValueError(f"--compile cuda-graphs captures CUDA graphs: it needs --device cuda, not {device_type}")
    return "off" if mode == "auto" else mode


def compiler(mode: str) -> Callable | None:
    """What wraps the step's per-token functions for ``mode`` (already resolved): None leaves them eager."""
    if mode == "inductor":
        # One graph per function for every token count T > 1 (and one for T = 1): widths and batches share it.
        return functools.partial(torch.compile, backend="inductor", dynamic=True)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: normalised and scaled by (1 + weight) in float32, then cast to the input's
    dtype."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


Norm = Callable[[torch.Tensor], torch.Tensor]  # an RMS norm over the last dimension, its weight bound


def norm_of(module) -> Norm:
    """``module`` (an RMS norm: Llama's kind, or Gemma's, which scales by 1 + weight) as one call."""
    if hasattr(module, "variance_epsilon"):
        return functools.partial(rms_norm, weight=local(module.weight), eps=float(module.variance_epsilon))
    return functools.partial(offset_rms_norm, weight=local(module.weight), eps=float(module.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, T, head_dim] of ``positions`` [1, T], as LlamaRotaryEmbedding computes them."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


Linear = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]


def linear(module, gather: bool = False) -> Linear:
    """A projection of ``module`` (an ``nn.Linear`` or a ``PackedLinear``) as one call, the same op its forward runs.

    A tensor-parallel shard (a ``DTensor`` weight, transformers' ``tp_plan``) runs on this rank's part: a
    column-parallel one gives this rank's slice of the output (``gather``: every rank's, gathered, as the LM head
    needs), a row-parallel one its partial sums, all-reduced: one collective per row-parallel projection, as
    Megatron-LM's layers have it."""
    if isinstance(module, PackedLinear):
        weight, bias = module.packed_weight, module.bias
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if type(module) is not torch.nn.Linear:
        raise ValueError(f"the decoder step runs nn.Linear projections, not {type(module).__name__}")
    weight, bias = module.weight, module.bias
    if _sharded(weight):
        placement, weight, bias = weight.placements[0], weight.to_local(), local(bias)
        if placement.is_shard(0) and gather:
            return lambda x: _all_gather_last(F.linear(x, weight, bias))
        if placement.is_shard(1):
            return lambda x: _all_reduce(F.linear(x, weight))  # a bias would be added once, after: refused
    return lambda x: F.linear(x, weight, bias)


def _sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor):
    """This rank's part of a tensor-parallel ``tensor``; any other tensor (or None) as it is."""
    return tensor.to_local() if _sharded(tensor) else tensor


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x)
    return x


def _all_gather_last(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def embedding(weight) -> Callable[[torch.Tensor], torch.Tensor]:
    """The token embedding as one call: over a vocabulary split across ranks (transformers' ``embedding_rowwise``),
    each rank looks up the ids in its rows, zeroes the others and the ranks' rows are all-reduced."""
    if not _sharded(weight) or not weight.placements[0].is_shard(0):
        table = local(weight)
        return lambda ids: F.embedding(ids, table)
    import torch.distributed as dist

    table = weight.to_local()
    first = dist.get_rank() * table.shape[0]

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= first) & (ids < first + table.shape[0])
        rows = F.embedding(torch.where(mine, ids - first, 0), table) * mine[..., None].to(table.dtype)
        return _all_reduce(rows)

    return lookup


def _sharding_unsupported(model) -> str | None:
    """Why the step cannot run a tensor-parallel ``model`` (None: it can, or it is not sharded)."""
    weights = {name: p for name, p in model.named_parameters() if _sharded(p)}
    if not weights:
        return None
    import torch.distributed as dist

    if any(routed(getattr(layer, "mlp", None)) for layer in model.model.layers):
        return "its routed experts are sharded"
    if any(len(p.placements) != 1 for p in weights.values()):
        return "its weights are sharded over a mesh of more than one dimension"
    if any(name.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for name in weights):
        return "its fused projections are sharded"
    if any(isinstance(m, torch.nn.Linear) and _sharded(m.weight) and m.weight.placements[0].is_shard(1)
           and m.bias is not None for m in model.modules()):
        return "a row-parallel projection has a bias"
    vocab = int(model.config.vocab_size)
    if vocab % dist.get_world_size():
        return f"its vocabulary of {vocab} does not split evenly over {dist.get_world_size()} ranks"
    return None


Projections = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # [..., in] -> several [..., out_i]


def separate(*projections: Linear) -> Projections:
    """Several projections of one input, each its own module (Llama's q, k, v; gate, up)."""
    return lambda x: tuple(projection(x) for projection in projections)


def fused(projection: Linear, sizes: Sequence[int]) -> Projections:
    """Several projections computed as one and split (Phi-3's qkv_proj and gate_up_proj)."""
    return lambda x: projection(x).split(list(sizes), dim=-1)


def attention_inputs(
    hidden: torch.Tensor,  # [1, T, hidden]
    norm: Norm, qkv: Projections,
    qk_norms: tuple[Norm, Norm] | None,  # Qwen3's and Gemma 3's norms of each head's q and k; None: none
    cos: torch.Tensor, sin: torch.Tensor,  # [1, T, head_dim]
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries [1, heads, T, head_dim], keys and values [1, kv_heads, T, head_dim], rotary applied."""
    x = norm(hidden)
    shape = (*hidden.shape[:-1], -1, head_dim)
    q, k, v = (projected.view(shape) for projected in qkv(x))
    if qk_norms is not None:
        q, k = qk_norms[0](q), qk_norms[1](k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin), v


def attention_outputs(
    residual: torch.Tensor,  # [1, T, hidden]
    attended: torch.Tensor,  # [1, T, heads, head_dim]
    o_proj: Linear,
    norms: tuple[Norm | None, Norm, Norm | None],  # after attention (Gemma 3), before the MLP, after it (Gemma 3)
    feed_forward: Linear,  # ``gated_mlp``'s, or a routed-experts block (Mixtral's own module)
) -> torch.Tensor:
    """The layer's output [1, T, hidden]: o projection and residual, then the MLP and residual."""
    attention = o_proj(attended.reshape(*residual.shape[:-1], -1).contiguous())
    hidden = residual + (attention if norms[0] is None else norms[0](attention))
    mlp = feed_forward(norms[1](hidden))
    return hidden + (mlp if norms[2] is None else norms[2](mlp))


def gated_mlp(gate_up: Projections, down_proj: Linear, act: Callable[[torch.Tensor], torch.Tensor]) -> Linear:
    """A gated MLP as one call: down(act(gate(x)) * up(x))."""
    def feed_forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x)
        return down_proj(act(gate) * up)

    return feed_forward


def routed(mlp) -> bool:
    """Whether a layer's feed-forward ``mlp`` is a block of routed experts (Mixtral's: a router, then experts)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and not hasattr(mlp, "down_proj")


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights (the model's own tensors) and settings."""

    index: int
    inputs: tuple  # attention_inputs' weight arguments: norm, qkv, qk_norms
    outputs: tuple  # attention_outputs' weight arguments: o_proj, norms, feed_forward
    scaling: float
    window: int | None  # the sliding window it attends within; None: full attention
    rope: str  # the rotary embedding it takes (``DecoderStep.rotations``' key)


def windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (key position p is seen from query position q when q - p < window), or None
    for a layer of full attention: Mistral's layers all slide, Gemma 3's mix sliding and full ones. Raises
    ValueError for a layer of another kind (linear or chunked attention, say)."""
    size = getattr(config, "sliding_window", None)
    count = int(config.num_hidden_layers)
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        kinds = ["sliding_attention" if size and getattr(config, "use_sliding_window", True) else "full_attention"]
        kinds *= count
    other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"its layers include {', '.join(other)}; packed rows and the decoder step run full "
                         "and sliding-window attention")
    if "sliding_attention" in kinds and not size:
        raise ValueError("its layers slide but its config gives no sliding_window")
    return tuple(int(size) if kind == "sliding_attention" else None for kind in kinds[:count])


def _rotaries(decoder) -> dict[str, tuple[torch.Tensor, float]]:
    """The model's rotary embeddings as (inverse frequencies, scaling), by the layer kind that takes each: one
    for every layer (``full_attention``), or one a kind (Gemma 3's rotary base of its sliding layers differs)."""
    rotary_emb = decoder.rotary_emb
    if hasattr(rotary_emb, "inv_freq"):
        return {"full_attention": (rotary_emb.inv_freq, float(rotary_emb.attention_scaling))}
    return {kind: (getattr(rotary_emb, f"{kind}_inv_freq"), float(getattr(rotary_emb, f"{kind}_attention_scaling")))
            for kind in rotary_emb.layer_types}


def unsupported(model, static: bool = False) -> str | None:
    """Why ``DecoderStep`` cannot run ``model`` (None: it can); ``static``: as the static step (``graph_step``) runs
    it, replayable as CUDA graphs."""
    config = model.config
    if config.model_type not in SUPPORTED_TYPES:
        return (f"{type(model).__name__} ({config.model_type}) is not a Llama, Mistral, Mixtral, Qwen2, Qwen3, Phi-3 "
                "or Gemma 3 layout")
    try:
        windows(config)
    except ValueError as exc:
        return str(exc)
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "its rotary embedding turns part of each head (partial_rotary_factor)"
    rotary_emb = getattr(getattr(model, "model", None), "rotary_emb", None)
    rope_types = getattr(rotary_emb, "rope_type", "default")
    rope_types = set(rope_types.values()) if isinstance(rope_types, dict) else {rope_types}
    if rotary_emb is None or rope_types & {"dynamic", "longrope"}:
        return "its rotary embedding depends on the forward's positions (dynamic or longrope)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "it splits its projections (pretraining_tp > 1)"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return "it caps its logits (attn_logit_softcapping or final_logit_softcapping, Gemma 2)"
    if not isinstance(getattr(getattr(model.model, "norm", None), "weight", None), torch.Tensor):
        return "its final norm is not an RMS norm with a weight (an exit adapter before it, say)"
    projections = [getattr(part, name) for layer in model.model.layers for part, names in
                   ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")),
                    (getattr(layer, "mlp", None), ("gate_proj", "up_proj", "gate_up_proj", "down_proj")))
                   for name in names if hasattr(part, name)]
    if any(not hasattr(layer, "mlp") or not (hasattr(layer.mlp, "down_proj") or routed(layer.mlp))
           for layer in model.model.layers):
        return "its layers' feed-forward is neither a gated MLP nor routed experts"
    if static and any(routed(layer.mlp) for layer in model.model.layers):
        return "its routed experts send a varying number of tokens to each expert, which a captured graph cannot"
    odd = {type(m).__name__ for m in projections if type(m) not in (torch.nn.Linear, PackedLinear)}
    if odd:
        return f"its projections are {', '.join(sorted(odd))} (the step runs nn.Linear ones)"
    return _sharding_unsupported(model)


class DecoderStep:
    """The step of one model: ``DecoderStep(model)(ids, positions, rows, keep, feature_layers)``.

    ``compile_fn`` wraps the two per-token functions (``torch.compile``), or leaves them eager (None).
    """

    def __init__(self, model, compile_fn: Callable | None = None) -> None:
        reason = unsupported(model)
        if reason:
            raise ValueError(f"the decoder step cannot run this model: {reason}")
        decoder = model.model
        self.rotaries = _rotaries(decoder)
        self.embed = local(decoder.embed_tokens.weight)  # [vocab, hidden]; a shard: this rank's rows
        self.embedding = embedding(decoder.embed_tokens.weight)  # ids -> [..., hidden]
        scale = getattr(decoder.embed_tokens, "embed_scale", None)  # Gemma 3: embeddings times sqrt(hidden)
        if scale is not None:
            lookup, scale = self.embedding, scale.to(self.embed.dtype)
            self.embedding = lambda ids: lookup(ids) * scale
        self.norm = norm_of(decoder.norm)
        self.lm_head = linear(model.lm_head, gather=True)  # [..., hidden] -> [..., vocab]
        self.head_dim = decoder.layers[0].self_attn.head_dim
        count = model.config.num_hidden_layers
        kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * count
        self.layers = [self._layer(i, layer, window, kinds[i] if len(self.rotaries) > 1 else "full_attention")
                       for i, (layer, window) in enumerate(zip(decoder.layers[:count], windows(model.config)))]
        self.attention_inputs = compile_fn(attention_inputs) if compile_fn else attention_inputs
        self.attention_outputs = compile_fn(attention_outputs) if compile_fn else attention_outputs

    @staticmethod
    def _layer(index: int, layer, window: int | None, rope: str) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # Phi-3: one projection, split as its forward splits it
            q_size = attn.config.num_attention_heads * attn.head_dim
            kv_size = attn.num_key_value_heads * attn.head_dim
            qkv = fused(linear(attn.qkv_proj), (q_size, kv_size, kv_size))
        else:
            qkv = separate(linear(attn.q_proj), linear(attn.k_proj), linear(attn.v_proj))
        # Qwen3, Gemma 3: each head's q and k RMS-normed before the rotary embedding
        qk_norms = (norm_of(attn.q_norm), norm_of(attn.k_norm)) if hasattr(attn, "q_norm") else None
        if routed(mlp):  # Mixtral: its own block of routed experts, whatever implementation transformers picked
            feed_forward = mlp
        else:
            if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate and up as one projection, gate first
                half = mlp.gate_up_proj.out_features // 2
                gate_up = fused(linear(mlp.gate_up_proj), (half, half))
            else:
                gate_up = separate(linear(mlp.gate_proj), linear(mlp.up_proj))
            feed_forward = gated_mlp(gate_up, linear(mlp.down_proj),
                                     mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn)
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: the attention's and the MLP's outputs normed too
            norms = (norm_of(layer.post_attention_layernorm), norm_of(layer.pre_feedforward_layernorm),
                     norm_of(layer.post_feedforward_layernorm))
        else:
            norms = (None, norm_of(layer.post_attention_layernorm), None)
        inputs = (norm_of(layer.input_layernorm), qkv, qk_norms)
        outputs = (linear(attn.o_proj), norms, feed_forward)
        return _Layer(index, inputs, outputs, float(attn.scaling), window, rope)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rotations(self, positions: torch.Tensor, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [..., T, head_dim] of ``positions`` [..., T], by the rotary embedding's key (``_Layer.rope``)."""
        return {kind: rotary(inv_freq, scaling, positions, dtype)
                for kind, (inv_freq, scaling) in self.rotaries.items()}

    @torch.inference_mode()
    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: Sequence, keep: torch.Tensor,
        feature_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [K, vocab] of the ``keep`` positions of the packed ``ids``/``positions`` [1, T], and the hidden
        states [1, T, hidden] entering each decoder layer in ``feature_layers`` (0 = the embeddings; the number of
        layers = the final norm's output).

        ``rows`` are ``packed_rows._Row``s: each row's keys/values are written into its buffer at its positions."""
        hidden = self.embedding(ids)  # [1, T, hidden]
        rotations = self.rotations(positions, hidden.dtype)
        wanted = set(feature_layers)
        features = {}
        for layer in self.layers:
            if layer.index in wanted:
                features[layer.index] = hidden
            q, k, v = self.attention_inputs(hidden, *layer.inputs, *rotations[layer.rope], self.head_dim)
            attended = _row_attention(layer, q, k, v, rows)
            hidden = self.attention_outputs(hidden, attended, *layer.outputs)
        if self.num_layers in wanted:  # the final hidden state, after the norm (what the LM head reads)
            features[self.num_layers] = self.norm(hidden)
            return self.lm_head(features[self.num_layers][:, keep])[0], features
        kept = self.norm(hidden[:, keep])
        return self.lm_head(kept)[0], features


def _row_attention(layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """Each row's new keys/values written into its buffer, then its queries against it: [1, T, heads, head_dim]."""
    for row in rows:
        fed = slice(row.offset, row.offset + row.width)
        row.kv.write(layer.index, row.start, k[:, :, fed], v[:, :, fed])
    return attend_rows(layer.index, q, rows, layer.scaling, gqa=q.shape[1] != k.shape[1], window=layer.window)


def attend_rows(layer: int, q: torch.Tensor, rows: Sequence, scaling: float, gqa: bool,
                window: int | None = None) -> torch.Tensor:
    """Each row's queries (q: [1, heads, T, head_dim]) against its own buffer of ``layer`` (no copy), under its
    mask for the layer's ``window`` (causal, or a token tree's ancestor mask, within the window where the layer
    slides): [1, T, heads, head_dim]. Grouped-query attention runs through ``enable_gqa`` instead of repeating the
    keys/values per query head (the same numbers, without the copy)."""
    out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    for row in rows:
        keys, values = row.kv.view(layer, row.start + row.width)
        mask, front = row.masks[window], row.kv.fronts[layer]
        if front:  # a sliding layer's buffer holds positions front.. only
            mask = mask[:, front:]
        fed = slice(row.offset, row.offset + row.width)
        attended = F.scaled_dot_product_attention(
            q[:, :, fed], keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa
        )  # [1, heads, width, head_dim]
        out[:, fed] = attended.transpose(1, 2)
    return out
