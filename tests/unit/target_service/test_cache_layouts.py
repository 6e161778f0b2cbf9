"""Model families beyond Llama: sliding-window layers, learned absolute positions, dynamic RoPE.

Tiny random models of each family, with a sliding window (6) much shorter than
the generation (5 prompt + 24 new tokens), decode through the target engine
with draft blocks that are partly wrong, so blocks are rejected and rolled back
far past the window. Greedy output must equal the model's own ``generate``,
solo and with four sessions verified in shared forwards.
"""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.kvcache import check_cache_layout, rows_share_rope
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.target_service.engine import TargetEngine, VerifyItem, VerifyOutcome

pytestmark = pytest.mark.unit

VOCAB = 128
WINDOW = 6
NEW = 24
PROMPTS = [[3, 17, 5, 99, 42], [7, 7, 7, 1, 2], [120, 4, 64, 32, 16], [9, 8, 7, 6, 5]]
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def family(name: str):
    import transformers as tf

    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=WINDOW))
    if name == "qwen2-window":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1))
    if name == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=16, sliding_window=WINDOW))
    if name == "gemma3":
        config = tf.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=WINDOW,
                                     layer_types=["sliding_attention", "full_attention"])
        return tf.Gemma3ForCausalLM(config)
    if name == "gpt2":  # learned absolute positions, a table that ends at the context
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32))
    if name == "llama-dynamic-rope":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            **SMALL, max_position_embeddings=64,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    raise ValueError(name)


FAMILIES = ["mistral", "qwen2-window", "gemma2", "gemma3", "gpt2", "llama-dynamic-rope"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    torch.manual_seed(0)
    model = family(request.param).eval()
    with torch.no_grad():  # larger logits: argmax near-ties (fp32 reduction-order flips) vanish
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def reference(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def guess(expected: list[int], done: int, k: int, rng: random.Random) -> list[int]:
    """The next k expected tokens, one of them wrong half the time: rejections at every depth."""
    block = expected[done : done + k]
    if block and rng.random() < 0.5:
        i = rng.randrange(len(block))
        block[i] = (block[i] + 1) % VOCAB
    return block


def engine_for(model) -> TargetEngine:
    return TargetEngine(model, model_id="tiny", vocab_fingerprint="", limits=SessionLimits(max_block=8))


def test_greedy_with_rollbacks_past_the_window_equals_generate_solo(model):
    engine, rng = engine_for(model), random.Random(0)
    for n, prompt in enumerate(PROMPTS[:2]):
        expected = reference(model, prompt)
        session = engine.open(f"s{n}", prompt, SamplingParams(), VerificationMode.GREEDY)
        while len(session.tokens) - len(prompt) < NEW:
            done = len(session.tokens) - len(prompt)
            block = guess(expected, done, min(rng.choice([1, 3, 5, 8]), NEW - done - 1), rng)
            engine.verify(session, len(session.tokens), block, None)
        assert session.tokens[len(prompt):][:NEW] == expected


def test_greedy_with_rollbacks_past_the_window_equals_generate_batched(model):
    engine, rng = engine_for(model), random.Random(1)
    expected = [reference(model, p) for p in PROMPTS]
    sessions = [engine.open(f"b{n}", p, SamplingParams(), VerificationMode.GREEDY) for n, p in enumerate(PROMPTS)]
    for session in sessions:  # prefills run alone; the rounds after share forwards
        engine.verify(session, len(session.tokens), [], None)
    shared = 0
    while any(len(s.tokens) - len(p) < NEW for s, p in zip(sessions, PROMPTS)):
        items = []
        for s, p, e in zip(sessions, PROMPTS, expected):
            done = len(s.tokens) - len(p)
            if done < NEW:
                items.append(VerifyItem(s, len(s.tokens), guess(e, done, min(rng.choice([1, 3, 5]), NEW - done - 1), rng),
                                        None))
        results = engine.verify_batch(items)
        assert all(isinstance(r, VerifyOutcome) for r in results), results
        shared = max(shared, *(r.batch.size for r in results))
    for s, p, e in zip(sessions, PROMPTS, expected):
        assert s.tokens[len(p):][:NEW] == e
    assert shared == (len(PROMPTS) if rows_share_rope(model) else 1)


def test_rows_near_the_end_of_a_learned_position_table_batch_without_overflow():
    torch.manual_seed(0)
    model = family("gpt2").eval()
    engine = engine_for(model)
    long_prompt, short_prompt = list(range(1, 30)), [5, 6]  # 29 of 32 positions used: pads must not pass 31
    sessions = [engine.open(f"g{n}", p, SamplingParams(), VerificationMode.GREEDY)
                for n, p in enumerate([long_prompt, short_prompt])]
    for s in sessions:
        engine.verify(s, len(s.tokens), [], None)
    alone = engine_for(model)
    twins = [alone.open(f"t{n}", list(s.tokens), SamplingParams(), VerificationMode.GREEDY) for n, s in enumerate(sessions)]
    blocks = [[1], [2, 3, 4, 5]]  # the long row's block is narrower: its pad slots sit at its last position
    together = engine.verify_batch([VerifyItem(s, len(s.tokens), b, None) for s, b in zip(sessions, blocks)])
    solo = [alone.verify(t, len(t.tokens), b, None) for t, b in zip(twins, blocks)]
    assert [(r.accepted, r.next_token) for r in together] == [(r.accepted, r.next_token) for r in solo]
    assert together[0].batch.size == 2


def test_batch_dependent_rope_verifies_each_session_alone():
    assert not rows_share_rope(family("llama-dynamic-rope"))
    assert rows_share_rope(family("mistral"))


def test_layer_types_without_per_position_keys_are_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention layers"):
        check_cache_layout(model)
    with pytest.raises(ValueError, match="linear_attention"):
        TargetEngine(model, model_id="x", vocab_fingerprint="", limits=SessionLimits())
