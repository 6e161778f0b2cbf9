"""What the step suite's memory bound counts: every weight a one-token step reads, once."""

from __future__ import annotations

import copy

import pytest

from specsplit.bench.step import weights_read
from specsplit.lmkit import models
from specsplit.lmkit.packed_linear import pack_linears

pytestmark = pytest.mark.unit


def test_weights_read_counts_packed_copies_and_one_embedding_row(tiny_target_dir):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    embedding = model.get_input_embeddings().weight
    row = embedding.shape[1] * embedding.element_size()
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    norm = model.model.norm.weight.numel() * 4
    rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())  # the inverse frequencies
    # Untied: the LM head is read whole, of the embedding only the token's row.
    head = model.lm_head.weight
    assert head is not embedding
    assert weights_read(model) == layers + norm + rotary + row + head.numel() * head.element_size()
    packed = copy.deepcopy(model)
    assert pack_linears(packed) == 1  # the LM head's packed copy takes the head's place
    assert weights_read(packed) == weights_read(model)
    # Tied: the LM head is the embedding, so a step reads all of it (the head; the token's row is in it).
    tied = copy.deepcopy(model)
    tied.lm_head.weight = tied.get_input_embeddings().weight
    assert weights_read(tied) == layers + norm + rotary + embedding.numel() * embedding.element_size()
