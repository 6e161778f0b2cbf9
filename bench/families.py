"""Tiny models of the families people serve, built from each family's own config class and keys with the sizes
shrunk (hidden 64, 2 layers, grouped-query attention, the SmolLM2 vocabulary), random weights, no download.

Each keeps what sets its family apart: Llama 3's llama3 rope scaling and tied head, Qwen2.5's q/k/v biases and
rope theta of a million, Qwen3's q/k norms and explicit head size, Mistral's sliding window, Gemma 3's
alternating sliding and full layers, scaled embeddings and (1 + w) norms, Phi-3's fused projections, Mixtral's
routed experts. The windows are shrunk with the rest (16 and 8 positions), so that a test's context passes them.
The weights are drawn wider than the families' own initialisation (``initializer_range`` 0.2, biases 0.05), so
that the greedy token moves with the context rather than repeating one token.
"""

from __future__ import annotations

from pathlib import Path

import torch

HIDDEN, LAYERS, CONTEXT = 64, 2, 512


def _configs(vocab: int) -> dict:
    import transformers

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return {
        "llama3": lambda: transformers.LlamaConfig(
            **common, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2.5": lambda: transformers.Qwen2Config(
            **common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=16),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False),
        "phi3": lambda: transformers.Phi3Config(**common),
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    }


FAMILIES = ("llama3", "qwen2.5", "qwen3", "mistral", "gemma3", "phi3", "mixtral")


def save_family(path: Path, family: str, tokenizer, seed: int = 0, perturbed: float = 0.0,
                dtype: torch.dtype | None = None, max_shard_size: str = "50GB") -> Path:
    """A tiny ``family`` model saved as a Hugging Face folder (safetensors, config, tokenizer) at ``path``;
    ``perturbed``: every weight moved by this much Gaussian noise (seeded apart), a draft that agrees with the model
    of the same seed at most positions, not all. ``dtype`` and ``max_shard_size``: saved in that type, in shards of
    at most that size with their index, as published checkpoints are."""
    from transformers import AutoModelForCausalLM

    config = _configs(len(tokenizer))[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at zero, which would hide a dropped bias
                parameter.normal_(0.0, 0.05)
        if perturbed:
            noise = torch.Generator().manual_seed(seed + 1)
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=noise) * perturbed)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path
