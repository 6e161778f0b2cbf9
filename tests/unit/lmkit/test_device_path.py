"""The pieces of the CUDA path that run the same on the CPU: ``--dtype auto``, random-weight folders,
the cache keyword of either transformers 5.x, host/device transfers."""

from __future__ import annotations

import pytest
import torch

from specsplit.bench import gpu_models
from specsplit.lmkit import models
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.models import cache_kwargs
from specsplit.lmkit.transfer import to_device, to_host

pytestmark = pytest.mark.unit


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_on_the_cpu():
    assert models.resolve_dtype("cpu", "auto") == "float32"
    assert models.resolve_dtype("cuda", "auto") == models.resolve_dtype("cuda:1", "auto") == "bfloat16"
    assert models.resolve_dtype("cuda", "float16") == "float16"
    assert models.ModelSpec("m").torch_dtype is torch.float32  # the default is auto
    assert models.ModelSpec("m", "cuda:0").torch_dtype is torch.bfloat16
    assert models.ModelSpec("m", "cuda", "float32").torch_dtype is torch.float32
    with pytest.raises(ValueError, match="choose one of auto, float32"):
        models.ModelSpec("m", dtype="fp8")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return gpu_models.write_pair(tmp_path_factory.mktemp("pair"), gpu_models.TINY)


def test_a_random_weight_folder_loads_its_shape_seeded_with_scaled_embeddings(tiny_pair, tmp_path):
    target_dir, draft_dir = tiny_pair
    target = models.load_model(models.ModelSpec(str(target_dir)))
    shape = gpu_models.TINY_TARGET
    assert sum(p.numel() for p in target.parameters()) == shape.parameters(gpu_models.TINY_VOCAB)
    assert torch.equal(target.lm_head.weight, models.load_model(models.ModelSpec(str(target_dir))).lm_head.weight)
    draft = models.load_model(models.ModelSpec(str(draft_dir)))
    assert draft.lm_head.weight is draft.model.embed_tokens.weight  # tied, as Llama-3.2-1B
    assert models.vocab_fingerprint(models.load_tokenizer(str(target_dir))) == models.vocab_fingerprint(
        models.load_tokenizer(str(draft_dir)))
    plain = models.write_random_weights(tmp_path / "plain", gpu_models.llama_config(shape, gpu_models.TINY),
                                        gpu_models.synthetic_tokenizer(gpu_models.TINY_VOCAB), seed=0)
    unscaled = models.load_model(models.ModelSpec(str(plain))).model.embed_tokens.weight
    assert torch.allclose(target.model.embed_tokens.weight, unscaled * gpu_models.EMBEDDING_SCALE)


def test_shaped_random_weights_give_wide_argmax_margins_where_plain_ones_near_tie(tmp_path):
    """A wide, deep random model's top two logits nearly tie (bf16 flips them between a verify and a decode);
    the bench's shaping (layer outputs scaled, an untied head of embedding rows) separates them."""
    shape = gpu_models.Shape("wide", hidden=512, intermediate=1024, layers=8, heads=8, kv_heads=2, tied=False)
    config = gpu_models.llama_config(shape, gpu_models.TINY)
    tokenizer = gpu_models.synthetic_tokenizer(gpu_models.TINY_VOCAB)
    ids = torch.randint(0, gpu_models.TINY_VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))

    def margins(folder) -> torch.Tensor:  # top-1 minus top-2 logit over the logits' std, last position of each
        model = models.load_model(models.ModelSpec(str(folder)))
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1]
        top = logits.topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]) / logits.std(dim=-1)

    plain = models.write_random_weights(tmp_path / "plain", config, tokenizer, embedding_scale=gpu_models.EMBEDDING_SCALE)
    shaped = models.write_random_weights(tmp_path / "shaped", config, tokenizer,
                                         embedding_scale=gpu_models.EMBEDDING_SCALE, head_from_embedding=True,
                                         residual_scale=gpu_models.residual_scale(shape))
    assert margins(plain).median() < 1.0
    assert margins(shaped).min() > 10.0
    model = models.load_model(models.ModelSpec(str(shaped)))
    head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is not embedding and torch.equal(head.sort(0).values, embedding.sort(0).values)  # rows reordered
    assert not torch.equal(head, embedding)


def test_random_weights_refuse_tensor_parallel(tiny_pair):
    with pytest.raises(ValueError, match="--tp 1"):
        models.load_model(models.ModelSpec(str(tiny_pair[0])), tensor_parallel=True)


def test_the_real_shapes_have_the_real_parameter_counts():
    assert round(gpu_models.LLAMA_3_1_8B.parameters(gpu_models.LLAMA3_VOCAB) / 1e9, 2) == 8.03
    assert round(gpu_models.LLAMA_3_2_1B.parameters(gpu_models.LLAMA3_VOCAB) / 1e9, 2) == 1.24


class _NewStyle(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False): ...


class _OldStyle(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False): ...


def test_the_cache_goes_by_the_name_the_installed_transformers_takes(tiny_pair):
    assert cache_kwargs(_NewStyle(), "c") == {"cache": "c"}  # transformers >= 5.2x
    assert cache_kwargs(_OldStyle(), "c") == {"past_key_values": "c"}  # 5.17, the GPU image's
    model = models.load_model(models.ModelSpec(str(tiny_pair[0])))
    cache = SessionCache(model)
    logits = cache.logits([5, 6, 7], [8, 9])
    assert logits.shape == (3, gpu_models.TINY_VOCAB)
    assert cache.cache.get_seq_length() == 5  # the model filled our cache, not one of its own


def test_host_transfers_on_the_cpu_keep_values_and_give_float32():
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(to_device(ids, torch.device("cpu")), ids)
    logits = torch.randn(2, 7, dtype=torch.bfloat16)
    host = to_host(logits)
    assert host.dtype is torch.float32 and host.device.type == "cpu"
    assert torch.equal(host, logits.float())
