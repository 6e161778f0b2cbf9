"""Self-drafting: drafts derived from the target's own checkpoint, no separate draft model.

Two derivations, both built once at start-up from the model the draft service loaded
(``serve-draft --model``) and served through the ordinary ``ModelDrafter`` (own KV cache per
session, the same lazy crop-on-rollback):

* **layer-skip** (early exit; Elhoushi et al. 2024, "LayerSkip"; Zhang et al. 2023, "Draft &
  Verify: self-speculative decoding"): the first L decoder layers, then the final norm and the LM
  head, as a view that *shares* the full model's tensors (no extra weight memory); an optional
  trained ``ExitAdapter`` (``specsplit distill``) maps the layer-L hidden state towards the last's.
* **quantized**: the transformer layers in int8 (per-output-channel weight scales; ``int8`` also
  quantizes activations per token and multiplies in int8); the embedding and the LM head stay in
  the model's precision, because the head decides the argmax and a coarse head costs most of the
  agreement (docs/drafters.md).
"""

from __future__ import annotations

import copy
import enum
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_WEIGHTS = "exit_adapter.pt"
ADAPTER_META = "exit_adapter.json"


class QuantizeMode(enum.Enum):
    """How the quantized self-drafter stores its transformer layers."""

    INT8 = "int8"  # W8A8: int8 weights per output channel, activations quantized per token, int8 GEMM
    INT8_WEIGHT = "int8-weight"  # int8 weights per output channel, float activations (closer, slower on CPU)
    # torch.ao dynamic int8 (fbgemm), per-channel weights: fastest on CPU, but activations get one scale per
    # forward call, so logits depend on how the context was chunked into calls (see docs/drafters.md).
    INT8_DYNAMIC = "int8-dynamic"


class ExitAdapter(torch.nn.Module):
    """h + W·rmsnorm(h) on the layer-L hidden state; W starts at zero, so untrained it is the identity."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.proj = torch.nn.Linear(hidden_size, hidden_size, bias=False)
        torch.nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [batch, seq, hidden] -> same
        return hidden + self.proj(self.norm(hidden))


class _AdaptedNorm(torch.nn.Module):
    """The final norm preceded by the exit adapter (so the model's own forward applies both)."""

    def __init__(self, adapter: ExitAdapter, norm: torch.nn.Module) -> None:
        super().__init__()
        self.adapter = adapter
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.adapter(hidden))


def _decoder(model) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise ValueError(
            f"self-drafting needs a decoder-only model with .model.layers and .model.norm "
            f"(Llama, Mistral, Qwen, ...); {type(model).__name__} has no such layout"
        )
    return inner


def _shallow_clone(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object whose children can be replaced without touching the original's."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def _with_layers(model, layers: list[torch.nn.Module]):
    """A view of ``model`` over ``layers`` (embedding, final norm and head shared)."""
    inner = _decoder(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: len(layers)]
    view_inner = _shallow_clone(inner)
    view_inner.layers = torch.nn.ModuleList(layers)
    view_inner.config = config
    view = _shallow_clone(model)
    view.model = view_inner
    view.config = config
    return view.eval()


def layer_count(model) -> int:
    return len(_decoder(model).layers)


def layerskip_view(model, layers: int, adapter: ExitAdapter | None = None):
    """The first ``layers`` decoder layers of ``model``, then (adapter,) final norm and LM head.

    Shares every tensor with ``model``; its config says ``layers`` layers, so a
    ``DynamicCache`` built for it holds only those.
    """
    total = layer_count(model)
    if not 1 <= layers <= total:
        raise ValueError(f"--layerskip-layers must be in [1, {total}] for this model, got {layers}")
    view = _with_layers(model, list(_decoder(model).layers[:layers]))
    if adapter is not None:
        hidden = int(model.config.hidden_size)
        if adapter.proj.in_features != hidden:
            raise ValueError(f"the exit adapter is for hidden size {adapter.proj.in_features}, the model has {hidden}")
        adapter = adapter.to(next(model.parameters()).device, next(model.parameters()).dtype).eval()
        view.model.norm = _AdaptedNorm(adapter, _decoder(model).norm)
    return view


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ([rows, cols] int8, [rows] float32 scales) with x ≈ q · scale."""
    scale = x.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8WeightLinear(torch.nn.Module):
    """y = x·(W_int8 · scale)ᵀ + b with per-output-channel scales; activations stay in float."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight_int8, scale = _quantize_rows(linear.weight.detach().float())  # [out, in], [out]
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1]).float()
        if flat.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        else:
            out = flat @ (self.weight_int8.float() * self.scale[:, None]).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


class Int8Linear(torch.nn.Module):
    """W8A8: y = (q(x)·W_int8ᵀ) · s_x · s_w + b, int8 × int8 → int32 GEMM.

    Activations get one scale per token (not per call, as torch.ao's dynamic
    quantization does), so a token's output does not depend on which other
    tokens share the forward pass: feeding a context in one chunk or in many
    gives identical logits, and a drafter that rolls back and re-feeds proposes
    exactly what a fresh one would.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight_int8, scale = _quantize_rows(linear.weight.detach().float())  # [out, in], [out]
        self.register_buffer("weight_int8_t", weight_int8.T.contiguous())  # [in, out]
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1]).float()
        x_int8, x_scale = _quantize_rows(flat)  # [tokens, in], [tokens]
        out = torch._int_mm(x_int8, self.weight_int8_t).float() * x_scale[:, None] * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def _quantize_layer(layer: torch.nn.Module, mode: QuantizeMode) -> torch.nn.Module:
    layer = copy.deepcopy(layer).float()
    if mode is QuantizeMode.INT8_DYNAMIC:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
            warnings.simplefilter("ignore")
            return quantize_dynamic(layer, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    kind = Int8Linear if mode is QuantizeMode.INT8 else Int8WeightLinear
    for name, child in list(layer.named_modules()):
        if isinstance(child, torch.nn.Linear):
            parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            setattr(parent, name.rpartition(".")[2], kind(child))
    return layer


def quantized_view(model, mode: QuantizeMode):
    """``model`` with int8 copies of its decoder layers; embedding, final norm and LM head shared.

    ``INT8`` (``torch._int_mm``) and ``INT8_DYNAMIC`` (fbgemm) run on the CPU;
    on GPUs use ``INT8_WEIGHT``.
    """
    device = next(model.parameters()).device
    if mode is not QuantizeMode.INT8_WEIGHT and device.type != "cpu":
        raise ValueError(f"--quantize {mode.value} runs on the CPU; use --quantize int8-weight on GPUs")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("--quantize needs the model loaded in float32 (--dtype float32)")
    return _with_layers(model, [_quantize_layer(layer, mode) for layer in _decoder(model).layers])


@dataclass(frozen=True)
class AdapterMeta:
    """What an exit-adapter folder says about itself (``exit_adapter.json``)."""

    layers: int
    hidden_size: int
    target: str
    vocab_fingerprint: str


def save_adapter(folder: Path, adapter: ExitAdapter, meta: AdapterMeta) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(adapter.state_dict(), folder / ADAPTER_WEIGHTS)
    (folder / ADAPTER_META).write_text(json.dumps(meta.__dict__, indent=2) + "\n")


def load_adapter(folder: str | Path) -> tuple[ExitAdapter, AdapterMeta]:
    """Read a folder written by ``specsplit distill``; ValueError says what is wrong with it."""
    folder = Path(folder)
    if not (folder / ADAPTER_META).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{folder} is not an exit-adapter folder (needs {ADAPTER_META} and {ADAPTER_WEIGHTS})")
    try:
        meta = AdapterMeta(**json.loads((folder / ADAPTER_META).read_text()))
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder / ADAPTER_META} is malformed: {exc}") from None
    adapter = ExitAdapter(meta.hidden_size)
    adapter.load_state_dict(torch.load(folder / ADAPTER_WEIGHTS, map_location="cpu", weights_only=True))
    return adapter, meta
