"""The EAGLE-3 draft head: one decoder layer over the target's hidden features and the token embeddings.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"; EAGLE, Li et al. 2024). For row j (the target's features f_j of committed
position j, and the next token t_{j+1}):

    g      = fc([f_low, f_mid, f_high])                     # first step; later steps chain ``out``
    x      = [input_layernorm(embed(t_{j+1})), hidden_norm(g)]  # 2H wide
    h      = g + o_proj(attention(q/k/v_proj(x)))           # RoPE, grouped-query, causal over earlier rows
    out    = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))                             # over the draft vocabulary: predicts t_{j+2}

The LM head covers a reduced draft vocabulary (draft id d is target id ``d + d2t[d]``; ``t2d`` marks
the target ids it covers: FR-Spec / EAGLE-3). Checkpoints: EAGLE-3's released layout (``load_head``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.lmkit.features import eagle3_layers

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"
BUNDLED_DIR = Path(__file__).resolve().parent / "heads"
# Heads shipped with specsplit, by the target reference they were trained for.
BUNDLED = {"smollm2-135m": BUNDLED_DIR / "eagle3-smollm2-135m"}


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape, read from (and written to) ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int  # width of one target layer's features
    feature_layers: tuple[int, ...]  # target hidden-state indices read, in order (empty: EAGLE-3's default)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"head config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("head config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"head config: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")

    @classmethod
    def from_dict(cls, raw: dict) -> HeadConfig:
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ValueError(f"head config.json lacks {missing}; is this an EAGLE-3 head folder?")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"head config: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        rope = raw.get("rope_parameters") or {}
        heads = int(raw["num_attention_heads"])
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
            feature_layers=tuple(int(i) for i in raw.get("eagle_aux_hidden_state_layer_ids") or ()),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        )

    def to_dict(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        }

    def rotary_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """The head's decoder layer (``midlayer``): attention over [embedding, hidden], then an MLP."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(
        self,
        emb: torch.Tensor,  # [B, T, H] token embeddings
        hidden: torch.Tensor,  # [B, T, H] fc(features) or the previous step's output
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, T, head_dim]
        past: tuple[torch.Tensor, torch.Tensor] | None,  # keys, values [B, kv_heads, P, head_dim]
        mask: torch.Tensor | None,  # [T, P + T] bool (True = attend); None: attend to every key
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out [B, T, H], this step's keys and values
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.self_attn
        batch, width, _ = hidden.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(batch, width, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, width, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, width, attn.kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=attn.heads != attn.kv_heads)
        h = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class EagleHead(nn.Module):
    """fc, midlayer, norm, lm_head, d2t, t2d; the token embedding is the target's (not a parameter here)."""

    def __init__(self, config: HeadConfig, embedding: torch.Tensor) -> None:  # embedding: [vocab, H]
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if not config.feature_layers:
            raise ValueError("the head's feature layers are unknown; resolve them with the target (eagle3_layers)")
        self.config = config
        self.fc = nn.Linear(len(config.feature_layers) * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = EagleLayer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config.rotary_config())
        self.embedding = embedding.detach()  # a plain tensor: shared with the target model, never trained or saved

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def feature_width(self) -> int:
        return self.fc.in_features

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] target ids -> [B, T, H]
        return F.embedding(tokens, self.embedding).to(self.fc.weight.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T] -> cos, sin
        return self.rotary(self.fc.weight, positions)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., draft_vocab]
        return self.lm_head(self.norm(out))

    def set_vocabulary(self, draft_ids: torch.Tensor) -> None:
        """Draft vocabulary = these target ids (ascending): fills d2t and t2d."""
        draft_ids = torch.sort(draft_ids.to(torch.long)).values
        if draft_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{draft_ids.numel()} draft ids for a draft vocabulary of {self.config.draft_vocab_size}")
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_ids(self) -> torch.Tensor:  # [draft_vocab] the target ids of the draft vocabulary
        return self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))


# -- checkpoints -----------------------------------------------------------------------------------------------

_RENAMES = (("layers.0.", "midlayer."), ("model.", ""))


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / WEIGHTS).is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / WEIGHTS))
    elif (folder / LEGACY_WEIGHTS).is_file():
        state = torch.load(folder / LEGACY_WEIGHTS, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder} has no {WEIGHTS} or {LEGACY_WEIGHTS}; is it an EAGLE-3 head folder?")
    renamed = {}
    for name, tensor in state.items():
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = tensor
    return renamed


def read_config(folder: str | Path) -> tuple[HeadConfig, dict]:
    """The head's config and the raw ``config.json`` (with specsplit's own block, if any)."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{folder} is not an EAGLE head folder (no {CONFIG})")
    try:
        raw = json.loads((folder / CONFIG).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder / CONFIG} is malformed: {exc}") from None
    return HeadConfig.from_dict(raw), raw


def resolve_head(ref: str) -> Path:
    """A head folder, or the name of a bundled head (the target reference it was trained for)."""
    if ref in BUNDLED:
        return BUNDLED[ref]
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise ValueError(f"--eagle-head {ref}: no such folder (bundled heads: {sorted(BUNDLED)})")
    return path


def check_fits(config: HeadConfig, target_config, where: str) -> None:
    """Refuse a head trained for another target: hidden size, vocabulary or feature layers that do not fit."""
    hidden = int(target_config.hidden_size)
    layers = int(target_config.num_hidden_layers)
    vocab = int(target_config.vocab_size)
    if config.target_hidden_size != hidden:
        raise ValueError(
            f"the EAGLE head {where} reads target features of width {config.target_hidden_size} per layer, but "
            f"the target's hidden size is {hidden}: it was trained for another target"
        )
    if config.vocab_size != vocab:
        raise ValueError(
            f"the EAGLE head {where} is for a vocabulary of {config.vocab_size} tokens, but the target has "
            f"{vocab}: it was trained for another target"
        )
    if any(not 0 <= i <= layers for i in config.feature_layers):
        raise ValueError(
            f"the EAGLE head {where} reads target layers {list(config.feature_layers)}, but the target has "
            f"{layers}: it was trained for another target"
        )


def load_head(ref: str, target_model) -> EagleHead:
    """Load a head for ``target_model`` (its config and embedding); ValueError says what does not fit.

    The folder has the layout EAGLE-3 released (e.g. for Llama-3.1-8B-Instruct): ``config.json`` with
    Llama keys (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``rms_norm_eps``, ``rope_theta``/``rope_scaling``, ``vocab_size``) plus ``draft_vocab_size`` and
    optionally ``target_hidden_size``; weights in ``model.safetensors`` or ``pytorch_model.bin`` named
    ``fc.weight``, ``midlayer.*`` (``layers.0.*`` is read too), ``norm.weight``, ``lm_head.weight``,
    ``d2t``, ``t2d`` and optionally ``embed_tokens.weight`` (else the target's embedding is shared).
    The target layers read default to EAGLE-3's ``[2, L/2, L-3]``; a config may name them in
    ``eagle_aux_hidden_state_layer_ids``. ``save_head`` writes the same layout (fp16) plus that key and
    a ``specsplit`` block (target, vocabulary fingerprint).
    """
    from dataclasses import replace

    folder = resolve_head(ref)
    config, _ = read_config(folder)
    if not config.feature_layers:
        config = replace(config, feature_layers=eagle3_layers(int(target_model.config.num_hidden_layers)))
    check_fits(config, target_model.config, str(folder))
    embedding = target_model.get_input_embeddings().weight
    if config.hidden_size != embedding.shape[1]:
        raise ValueError(
            f"the EAGLE head {folder} has hidden size {config.hidden_size}, but the target's token embedding is "
            f"{embedding.shape[1]} wide: it was trained for another target"
        )
    state = _read_state(folder)
    own_embedding = state.pop("embed_tokens.weight", None)
    if own_embedding is not None:
        embedding = own_embedding
    if "d2t" not in state and config.draft_vocab_size == config.vocab_size:  # no reduced vocabulary: identity
        state["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    head = EagleHead(config, embedding)
    expected = set(head.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"the EAGLE head {folder} does not have the EAGLE-3 layout: missing {missing}, "
                         f"unexpected {unexpected}")
    param = next(target_model.parameters())
    try:
        head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items()})
    except RuntimeError as exc:
        raise ValueError(f"the EAGLE head {folder} has tensors of the wrong shape: {exc}") from None
    head.embedding = embedding.detach().to(param.device, param.dtype)
    return head.to(param.device, param.dtype).eval().requires_grad_(False)


def save_head(folder: str | Path, head: EagleHead, extra: dict | None = None, dtype=torch.float16) -> None:
    """Write the head in the EAGLE-3 layout (weights in ``dtype``; d2t and t2d as they are)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.startswith("rotary.")}
    save_file(state, str(folder / WEIGHTS))
    config = head.config.to_dict()
    if extra:
        config["specsplit"] = extra
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
