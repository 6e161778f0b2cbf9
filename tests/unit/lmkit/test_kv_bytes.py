"""The KV bytes one position costs, from the model's shape: what --kv-budget-bytes is divided by."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit.lmkit.kvcache import kv_bytes_per_token

pytestmark = pytest.mark.unit


def test_kv_bytes_follow_layers_kv_heads_head_size_and_dtype():
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    assert kv_bytes_per_token(model) == 2 * 3 * 2 * (64 // 8) * 4  # K and V, 3 layers, 2 KV heads of 8, fp32
    assert kv_bytes_per_token(model.to(torch.bfloat16), tp_degree=2) == 2 * 3 * 2 * 8 * 2 // 2

