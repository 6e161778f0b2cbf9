"""The draft's models run the forward ``lmkit.forward`` sets up, as the target's does: transformers' stock forward,
the fast one (packed rows: the decoder step where the layout allows), or a slot of the static step
(``--compile cuda-graphs``, eager on the CPU). Whatever the forward, the model drafter proposes the same tokens
through drafts, rejections and rollbacks, for the draft model and its layer-skip and int8 self-drafts.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from specsplit.draft_service import self_draft
from specsplit.draft_service.engine import DraftEngine
from specsplit.draft_service.model_drafter import ModelDrafter
from specsplit.draft_service.server import build_parser
from specsplit.lmkit import errors, forward, models
from specsplit.draft_service.ngram import NgramConfig
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.kvcache import SessionCache
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits

pytestmark = pytest.mark.unit

PROMPT = [11, 300, 4000, 27, 9, 1200, 27, 9]
K = 4


def drafting(ref: str, mode: str) -> dict:
    model = models.load_model(models.ModelSpec(ref))
    views = {"model": model, "layer-skip": self_draft.layerskip_view(model, 1),
             "int8": self_draft.quantized_view(model, self_draft.QuantizeMode.INT8)}
    for view in views.values():
        forward.install(view, mode)
    return views


def rounds(drafter: ModelDrafter) -> list:
    """Five rounds: propose K, the target takes the first j of the block and its own next token (here: the draft's
    token at j bumped, so something is always rejected), the drafter commits; what each round proposed (tokens,
    probabilities, second guess)."""
    seen, committed = [], len(PROMPT)
    for j in (0, 2, K, 1, 3):
        block = drafter.propose(K)
        seen.append((block.tokens, None if block.probs is None else block.probs.clone(), block.second_guess))
        taken = [*block.tokens[:j], (block.tokens[j] + 1) % 49152 if j < K else 5]
        drafter.commit(committed, taken)
        committed += len(taken)
    return seen


def tree_rounds(drafter: ModelDrafter) -> list:
    """Five rounds of trees (the chain and up to 2 second choices as leaves): what each proposed (tokens, parents);
    the target takes the chain's first token and its own next one."""
    seen, committed = [], len(PROMPT)
    for _ in range(5):
        tree = drafter.propose_tree(K, 3, 8)
        seen.append((tree.tokens, tree.parents))
        taken = [tree.tokens[0], 5]
        drafter.commit(committed, taken)
        committed += len(taken)
    return seen


MODES = {  # (sampling, draft probabilities sent, coupled)
    "greedy": (SamplingParams(), False, False),
    "sampled": (SamplingParams(temperature=0.8, top_k=50, seed=3), True, False),
    "coupled": (SamplingParams(temperature=0.8, seed=3), False, True),
    "coupled-hot": (SamplingParams(temperature=2.5, seed=11), False, True),
    "coupled-top-k": (SamplingParams(temperature=1.2, top_k=40, seed=5), False, True),
    "coupled-top-p": (SamplingParams(temperature=0.9, top_p=0.9, seed=6), False, True),
    "token-only": (SamplingParams(temperature=1.1, top_p=0.85, seed=7), False, False),
    "penalized": (SamplingParams(temperature=0.8, frequency_penalty=0.5, seed=8), True, False),
    "penalized-greedy": (SamplingParams(repetition_penalty=1.3, logit_bias=((27, -1.0), (300, 2.5)), min_tokens=12,
                                        eos_token_ids=(9, 27), prompt_length=4), False, False),
    "penalized-coupled": (SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.2, seed=9),
                          False, True),
}


@pytest.mark.parametrize("mode", MODES)
def test_every_forward_proposes_the_stock_forwards_tokens(tiny_target_dir, mode):
    """Every request drafts through the slot's chains (each block in one replay, every token chosen on the device,
    penalties, biases and min_tokens applied there); every forward proposes the same blocks, second guesses, q and
    trees."""
    sampling, sampled, coupled = MODES[mode]
    stock, fast = drafting(str(tiny_target_dir), forward.STOCK), drafting(str(tiny_target_dir), "off")
    new_slot, _ = forward.slots(fast["model"], sessions=2, context=96, width=K + 1, batch=1, graphs=False)
    chained, _ = forward.slots(fast["model"], sessions=2, context=96, width=K + 1, batch=1, graphs=False, chain=K)
    for name in stock:
        want = rounds(ModelDrafter(stock[name], PROMPT, sampling, sampled, coupled))
        caches = [("fast", SessionCache)]
        if name == "model":
            caches += [("slot", lambda m: new_slot()), ("chained slot", lambda m: chained())]
        for label, new_cache in caches:
            drafter = ModelDrafter(fast[name], PROMPT, sampling, sampled, coupled, new_cache=new_cache)
            if label == "chained slot":
                assert drafter._chain_draw(K)[0]
            got = rounds(drafter)
            if name == "model" and (sampling.greedy or coupled):  # trees: the chain's second choices as leaves
                trees = tree_rounds(ModelDrafter(stock[name], PROMPT, sampling, sampled, coupled))
                assert tree_rounds(ModelDrafter(fast[name], PROMPT, sampling, sampled, coupled,
                                                new_cache=new_cache)) == trees, label
                assert any(parents for _, parents in trees)
            assert [tokens for tokens, *_ in got] == [tokens for tokens, *_ in want], (name, label)
            assert [guess for *_, guess in got] == [guess for *_, guess in want], (name, label)
            # int8 activations are rounded per token: a float32 difference in the forward's sums may cross a
            # rounding boundary, so its q moves by more than rounding; the tokens are the same. q travels rounded
            # through fp16: a float32 difference may move a probability across a boundary, one fp16 step (2**-10)
            atol = 1e-4 if name == "int8" else 1e-6
            for (_, q, _), (_, p, _) in zip(got, want):
                if p is not None:
                    torch.testing.assert_close(q, p, rtol=1e-3, atol=atol)


def test_the_engine_sets_up_each_drafting_model_and_a_closed_session_frees_its_slot(tiny_target_dir):
    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    derived = {DrafterKind.LAYERSKIP: self_draft.layerskip_view(model, 1),
               DrafterKind.QUANTIZED: self_draft.quantized_view(model, self_draft.QuantizeMode.INT8)}
    engine = DraftEngine(model, model_id="tiny", limits=SessionLimits(max_sessions=2, max_block=K), derived=derived,
                         forward_mode="cuda-graphs", graph_context=64)
    assert engine.forward_kinds[DrafterKind.MODEL].startswith("the static decoder step")
    assert engine.forward_kinds[DrafterKind.LAYERSKIP] == "the decoder step, eager"
    assert engine.forward_kinds[DrafterKind.QUANTIZED].startswith("transformers' stock forward (the decoder step "
                                                                  "cannot run it: its projections are Int8Linear")
    assert engine.max_context == 64
    for _ in range(3):  # two slots, three rounds of two sessions: a closed session's slot is taken again
        for i in range(2):
            engine.open(f"s{i}", PROMPT, SamplingParams(), DrafterKind.MODEL, False, NgramConfig())
        with pytest.raises(errors.ResourceExhausted, match="KV slots"):  # the two sessions hold both slots
            engine._new_cache(model)
        for i in range(2):
            engine.close(f"s{i}")


def test_serve_draft_takes_the_targets_forward_flags():
    parse = build_parser().parse_args
    assert forward.mode_of(parse(["--model", "m"])) == "off"  # auto on the CPU
    assert forward.mode_of(parse(["--model", "m", "--stock-forward"])) == forward.STOCK
    assert forward.mode_of(parse(["--model", "m", "--compile", "inductor"])) == "inductor"
    with pytest.raises(ValueError, match="needs --device cuda"):
        forward.mode_of(parse(["--model", "m", "--compile", "cuda-graphs"]))
    with pytest.raises(ValueError, match="drop --stock-forward"):
        forward.mode_of(parse(["--model", "m", "--compile", "inductor", "--stock-forward"]))
    assert isinstance(parse([]), argparse.Namespace)
