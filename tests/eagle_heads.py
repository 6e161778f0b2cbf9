"""EAGLE-3 heads for tests, written tensor by tensor in the layout EAGLE-3 released (not by specsplit's own writer).

``config.json`` carries the keys of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's (no
specsplit keys, so the target layers are EAGLE-3's default); the weights are a
``pytorch_model.bin`` named ``fc.weight``, ``midlayer.*`` (or ``layers.0.*``),
``norm.weight``, ``lm_head.weight``, ``d2t`` (draft id -> target id offsets) and
``t2d``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MIDLAYER = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)


def eagle3_state(hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, draft_ids: torch.Tensor,
                 target_hidden: int, layers: int = 3, std: float = 0.02, seed: int = 0,
                 prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """A random head's tensors by their released names."""
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    draft_ids = torch.sort(draft_ids).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    state = {prefix + name: rand(*shape) for name, shape in shapes.items()}
    for norm in ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
        state[prefix + norm] = torch.ones(hidden)
    state.update({
        "fc.weight": rand(hidden, layers * target_hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(len(draft_ids), hidden),
        "d2t": draft_ids - torch.arange(len(draft_ids)),
        "t2d": t2d,
    })
    return state


def eagle3_config(hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, draft_vocab: int,
                  target_hidden: int | None = None) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float16",
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "bos_token_id": 1, "eos_token_id": 2,
    }
    if target_hidden is not None:
        config["target_hidden_size"] = target_hidden
    return config


def write_eagle3_head(folder: Path, target_config, draft_ids: torch.Tensor, seed: int = 0, std: float = 0.02,
                      hidden: int | None = None, vocab: int | None = None, prefix: str = "midlayer.",
                      state_edit=None) -> Path:
    """A random head for a target (its hidden size and vocabulary unless overridden), saved as EAGLE-3 released."""
    hidden = hidden or int(target_config.hidden_size)
    vocab = vocab or int(target_config.vocab_size)
    heads, kv_heads, inter = 4, 2, 2 * hidden
    state = eagle3_state(hidden, heads, kv_heads, inter, vocab, draft_ids, hidden, std=std, seed=seed, prefix=prefix)
    if state_edit is not None:
        state_edit(state)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(eagle3_config(hidden, heads, kv_heads, inter, vocab, len(draft_ids))))
    return folder
