"""Random-weight model folders of real shapes for ``bench/gpu_check``: a draft and a target on one vocabulary.

The real pair is a Llama-3.2-1B-shaped draft and a Llama-3.1-8B-shaped target
(Llama 3's 128,256-token vocabulary); the tiny pair scales both down for the
CPU run inside the tests. Neither has weights on disk: each folder holds a
config, a tokenizer and ``specsplit.lmkit.models.RANDOM_WEIGHTS``, so a service builds
the model directly on its device. The tokenizer is synthetic (one word per id,
``t0`` .. ``t{V-1}``): no hub is reachable, and the services only need the two
folders to share a vocabulary fingerprint. The weights are shaped so that
greedy argmax margins are wide (``residual_scale``, ``head_from_embedding``):
a random model's near-ties flip in bf16 between a verify of several tokens
and a decode of one, which a trained model's margins rarely allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specsplit.lmkit import models

LLAMA3_VOCAB = 128256
TINY_VOCAB = 4096
EMBEDDING_SCALE = 8.0  # as the tests' tiny models: wide argmax margins (lmkit.models.random_model)


def residual_scale(shape: "Shape") -> float:
    """How much each layer's output projections shrink so that the token still dominates the residual stream
    after every layer: at real widths a random layer's outputs outgrow the (scaled) embedding row."""
    return 0.1 / shape.layers**0.5


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool  # the LM head shares the embedding matrix

    def parameters(self, vocab: int) -> int:
        """Parameters of the whole model (embedding, layers, norms, LM head)."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.heads * head_dim + 2 * self.hidden * self.kv_heads * head_dim
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def step_bytes(self, vocab: int, bytes_per_param: int) -> int:
        """Weight bytes one decode step must read: everything but the embedding table (one row is read)."""
        read = self.parameters(vocab) - (0 if self.tied else vocab * self.hidden)
        return read * bytes_per_param


LLAMA_3_1_8B = Shape("llama-3.1-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, tied=False)
LLAMA_3_2_1B = Shape("llama-3.2-1b", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, tied=True)
TINY_TARGET = Shape("tiny-target", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=False)
TINY_DRAFT = Shape("tiny-draft", hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, tied=True)


@dataclass(frozen=True)
class Pair:
    target: Shape
    draft: Shape
    vocab: int
    max_positions: int = 8192


REAL = Pair(LLAMA_3_1_8B, LLAMA_3_2_1B, LLAMA3_VOCAB)
TINY = Pair(TINY_TARGET, TINY_DRAFT, TINY_VOCAB, max_positions=1024)


def llama_config(shape: Shape, pair: Pair):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=pair.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=pair.max_positions,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tied,
        bos_token_id=None,
        eos_token_id=None,  # no end of sequence: every run decodes exactly its budget
        pad_token_id=None,
    )


def synthetic_tokenizer(vocab: int):
    """One whitespace-separated word per id; no special tokens."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(tk_models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def write_pair(root: Path, pair: Pair, seed: int = 0) -> tuple[Path, Path]:
    """The target and draft folders under ``root``; returns (target, draft)."""
    tokenizer = synthetic_tokenizer(pair.vocab)
    folders = []
    for offset, shape in enumerate((pair.target, pair.draft)):
        folders.append(models.write_random_weights(
            root / shape.name, llama_config(shape, pair), tokenizer, seed=seed + offset, embedding_scale=EMBEDDING_SCALE,
            head_from_embedding=not shape.tied, residual_scale=residual_scale(shape),
        ))
    return folders[0], folders[1]
