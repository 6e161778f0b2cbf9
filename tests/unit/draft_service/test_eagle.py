"""The EAGLE drafter's parts without services: features on the wire, the EAGLE-3 head layout, the drafter's
rows against a fresh drafter, training's unrolled steps against drafting, and the target's features."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.draft_service import eagle_head, eagle_train
from specsplit.draft_service.eagle import EagleDrafter
from specsplit.lmkit import errors, models
from specsplit.lmkit.features import FeatureBlock, decode_features
from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.lmkit.sessions import SessionLimits
from specsplit.lmkit.wire import features_from_proto, features_to_proto, join_features
from specsplit.target_service.engine import TargetEngine, VerifyItem
from specsplit.v1 import specsplit_pb2 as pb
from tests.eagle_heads import write_eagle3_head

pytestmark = pytest.mark.unit

LAYERS = (2, 1, 0)  # EAGLE-3's default [2, L/2, L-3] for the 2-layer tiny target (L - 3 clamped to 0)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory):
    folder = write_eagle3_head(tmp_path_factory.mktemp("head"), tiny.config, torch.arange(0, 49152, 3), std=0.05)
    return eagle_head.load_head(str(folder), tiny)


def target_features(model, tokens: list[int], layers=LAYERS) -> torch.Tensor:  # [len(tokens), F]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


# -- features on the wire ---------------------------------------------------------------------------------------

def test_features_travel_as_fp16_rows():
    values = torch.randn(3, 5)
    msg = features_to_proto(FeatureBlock(7, values))
    assert (msg.position, msg.rows, msg.width, len(msg.values)) == (7, 3, 5, 30)
    back = features_from_proto(msg, 5)
    assert back.position == 7 and torch.equal(back.values, values.half().float())
    with pytest.raises(errors.InvalidArgument, match="expects 6 values per position"):
        features_from_proto(msg, 6)


@pytest.mark.parametrize("data,rows,width,fragment", [
    (b"\x00" * 10, 2, 3, "expected 12"),
    (torch.tensor([math.nan, 1.0]).half().numpy().tobytes(), 1, 2, "NaN"),
])
def test_bad_feature_bytes_are_refused(data, rows, width, fragment):
    with pytest.raises(ValueError, match=fragment):
        decode_features(data, rows, width)


def _block(position: int, rows: int) -> pb.HiddenFeatures:
    return features_to_proto(FeatureBlock(position, torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) + position))


def test_features_not_yet_forwarded_join_the_next_ones():
    joined = join_features(_block(0, 3), _block(3, 2))
    assert (joined.position, joined.rows) == (0, 5)
    assert torch.equal(features_from_proto(joined, 2).values[3:], features_from_proto(_block(3, 2), 2).values)
    overlap = join_features(_block(0, 3), _block(2, 2))  # the newer rows win
    assert (overlap.position, overlap.rows) == (0, 4)
    assert torch.equal(features_from_proto(overlap, 2).values[2:], features_from_proto(_block(2, 2), 2).values)
    assert join_features(_block(0, 3), _block(5, 1)).position == 5  # a gap: only the newer block
    assert join_features(None, _block(4, 1)).position == 4


def test_a_long_prefill_keeps_its_last_rows():
    block = FeatureBlock(10, torch.zeros(100, 8))  # 16 bytes per row in fp16
    cut = block.last_rows(max_bytes=16 * 30)
    assert (cut.position, cut.rows, cut.end) == (80, 30, 110)
    assert block.since(105).position == 105 and block.since(0).rows == 100


# -- the EAGLE-3 checkpoint layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_a_head_in_the_released_layout_loads(tiny, tmp_path, prefix):
    draft_ids = torch.tensor([5, 17, 300, 49151])
    folder = write_eagle3_head(tmp_path, tiny.config, draft_ids, seed=3, prefix=prefix)
    head = eagle_head.load_head(str(folder), tiny)
    assert head.feature_layers == LAYERS and head.feature_width == 3 * tiny.config.hidden_size
    saved = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, saved[prefix + "self_attn.q_proj.weight"])
    assert torch.equal(head.fc.weight, saved["fc.weight"])
    assert head.draft_ids().tolist() == draft_ids.tolist()  # target id = draft id + d2t[draft id]
    assert torch.equal(head.embedding, tiny.get_input_embeddings().weight)  # the target's own, shared


def test_specsplit_writes_the_same_layout(head, tiny, tmp_path):
    eagle_head.save_head(tmp_path, head, {"target": "tiny"}, dtype=torch.float32)
    again = eagle_head.load_head(str(tmp_path), tiny)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    _, raw = eagle_head.read_config(tmp_path)
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(LAYERS) and raw["specsplit"] == {"target": "tiny"}


@pytest.mark.parametrize("case,fragment", [
    ("hidden size", "hidden size is 64"),
    ("vocabulary", "vocabulary of 1000 tokens"),
    ("missing tensor", "missing ['fc.weight']"),
    ("wrong shape", "wrong shape"),
])
def test_heads_for_another_target_are_refused(tiny, tmp_path, case, fragment):
    ids = torch.arange(10)
    if case == "hidden size":
        folder = write_eagle3_head(tmp_path, tiny.config, ids, hidden=32)
    elif case == "vocabulary":
        folder = write_eagle3_head(tmp_path, tiny.config, ids, vocab=1000)
    elif case == "missing tensor":
        folder = write_eagle3_head(tmp_path, tiny.config, ids, state_edit=lambda s: s.pop("fc.weight"))
    else:
        folder = write_eagle3_head(tmp_path, tiny.config, ids,
                                   state_edit=lambda s: s.update({"norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        eagle_head.load_head(str(folder), tiny)


def test_a_folder_that_is_no_head_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        eagle_head.resolve_head(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="not an EAGLE head folder"):
        eagle_head.read_config(tmp_path)


# -- the drafter ----------------------------------------------------------------------------------------------

SEQUENCE = [504, 2365, 6354, 16438, 28, 94, 727, 1869, 2025, 3, 77, 4001, 12, 9, 310, 5, 6, 7, 8, 99]


GREEDY = SamplingParams()


def drafter(head, tokens, sampling=GREEDY) -> EagleDrafter:
    return EagleDrafter(head, tokens, sampling, return_probs=not sampling.greedy)


def fresh_proposal(head, features, tokens, k):
    """What a drafter that gets everything at once proposes."""
    d = drafter(head, tokens)
    d.add_features(FeatureBlock(0, features[: len(tokens) - 1]))
    return d.propose(k).tokens


def test_nothing_is_proposed_before_the_prompts_features(head):
    d = drafter(head, SEQUENCE[:5])
    assert d.propose(4).tokens == []
    assert d.features_end == 0


def test_rounds_of_features_and_rollbacks_propose_what_a_fresh_drafter_would(head, tiny):
    features = target_features(tiny, SEQUENCE)
    d = drafter(head, SEQUENCE[:6])
    d.add_features(FeatureBlock(0, features[:5]))  # the prefill: rows 0..4 (token 5 is the next token)
    assert d.propose(3).tokens == fresh_proposal(head, features, SEQUENCE[:6], 3)
    # Next round: positions 6..8 committed (whatever was drafted); features of 5..7 arrive with them.
    d.commit(6, SEQUENCE[6:9])
    d.add_features(FeatureBlock(5, features[5:8]))
    assert d.propose(4).tokens == fresh_proposal(head, features, SEQUENCE[:9], 4)
    # Overlap: the draft is told a block it drafted is committed before its features come (chained rows) ...
    block = d.propose(3).tokens
    d.commit(9, block)
    ahead = d.propose(2).tokens
    assert len(ahead) == 2
    # ... then the target's decision rolls it back and the features replace the chained rows.
    d.commit(9, SEQUENCE[9:12])
    d.add_features(FeatureBlock(8, features[8:11]))
    assert d.propose(4).tokens == fresh_proposal(head, features, SEQUENCE[:12], 4)
    # Features that overlap rows already held are skipped; a gap restarts the context at the block.
    d.add_features(FeatureBlock(9, features[9:11]))
    assert d.features_end == 11
    d.commit(12, SEQUENCE[12:16])
    d.add_features(FeatureBlock(13, features[13:15]))
    restarted = drafter(head, SEQUENCE[:16])
    restarted.add_features(FeatureBlock(13, features[13:15]))
    assert d.propose(3).tokens == restarted.propose(3).tokens


def test_features_past_the_context_or_of_another_width_are_refused(head):
    d = drafter(head, SEQUENCE[:4])
    with pytest.raises(ValueError, match="past the context"):
        d.add_features(FeatureBlock(0, torch.zeros(5, head.feature_width)))
    with pytest.raises(ValueError, match="width"):
        d.add_features(FeatureBlock(0, torch.zeros(2, 7)))


def test_sampled_drafts_come_from_the_head_restricted_to_the_draft_vocabulary(head, tiny):
    features = target_features(tiny, SEQUENCE)
    d = drafter(head, SEQUENCE[:8], SamplingParams(temperature=1.0, top_k=20, seed=4))
    d.add_features(FeatureBlock(0, features[:7]))
    block = d.propose(5)
    allowed = set(head.draft_ids().tolist())
    assert len(block.tokens) == 5 and set(block.tokens) <= allowed
    assert block.probs.shape == (5, tiny.config.vocab_size)
    assert torch.allclose(block.probs.sum(-1), torch.ones(5))
    assert all(int((row > 0).sum()) <= 20 for row in block.probs)  # top-k applied to q as to p
    outside = torch.ones(tiny.config.vocab_size, dtype=torch.bool)
    outside[head.draft_ids()] = False
    assert float(block.probs[:, outside].sum()) == 0.0


# -- training against drafting ----------------------------------------------------------------------------------

def test_the_training_time_test_mask():
    mask = eagle_train.ttt_mask(4, 2).int().tolist()
    # step 2, row 3: true rows up to 1, the step-1 row 2, itself (the step-2 row 3)
    assert mask[3] == [1, 1, 0, 0] + [0, 0, 1, 0] + [0, 0, 0, 1]
    assert mask[0] == [0, 0, 0, 0] + [0, 0, 0, 0] + [1, 0, 0, 0]


def test_unrolled_training_steps_compute_what_drafting_computes(head, tiny):
    """Step s of the unrolled forward at row r is the (s+1)-th token drafted after row r - s."""
    prompt = SEQUENCE[:8]
    d = drafter(head, prompt)
    d.add_features(FeatureBlock(0, target_features(tiny, prompt)[:7]))
    drafted = d.propose(3).tokens
    sequence = prompt + drafted  # teacher forcing along the draft's own choices
    features = target_features(tiny, sequence)
    outs = eagle_train.unrolled(head, features[None, :-1], torch.tensor([sequence[1:]]), 3)
    last = len(prompt) - 2  # the row that drafted the first token
    for step in range(3):
        choice = head.draft_to_target(head.logits(outs[step][0, last + step]).argmax())
        assert int(choice) == drafted[step], step


# -- the target's features ----------------------------------------------------------------------------------------

def test_the_target_returns_the_committed_positions_features_solo_and_batched(tiny, tiny_target_dir):
    engine = TargetEngine(tiny, model_id="tiny", vocab_fingerprint="", limits=SessionLimits())
    greedy = SamplingParams()
    prompt = SEQUENCE[:6]
    solo = engine.open("a", prompt, greedy, VerificationMode.GREEDY, feature_layers=LAYERS)
    first = engine.verify(solo, 6, [1, 2], None)
    assert first.features.position == 0 and first.features.rows == 6 + first.accepted  # the prompt's, and accepted
    committed = prompt + [1, 2][: first.accepted] + [first.next_token]
    expected = target_features(tiny, committed)
    assert torch.allclose(first.features.values, expected[: first.features.rows], atol=1e-5)
    # Batched: two sessions in one forward get what each would alone.
    other = engine.open("b", SEQUENCE[:9], greedy, VerificationMode.GREEDY, feature_layers=LAYERS)
    engine.verify(other, 9, [], None)
    block = [committed[-1], 5]
    results = engine.verify_batch([
        VerifyItem(solo, len(committed), block, None), VerifyItem(other, len(other.tokens), [11, 12], None),
    ])
    assert results[0].batch.size == 2
    assert results[0].features.position == len(committed) - 1  # the previous round's next token
    full = target_features(tiny, committed + block[: results[0].accepted])
    assert torch.allclose(results[0].features.values, full[len(committed) - 1 :], atol=1e-5)
    plain = engine.open("c", prompt, greedy, VerificationMode.GREEDY)
    assert engine.verify(plain, 6, [1], None).features is None  # only when asked


def test_the_target_refuses_layers_it_does_not_have(tiny):
    engine = TargetEngine(tiny, model_id="tiny", vocab_fingerprint="", limits=SessionLimits())
    with pytest.raises(errors.InvalidArgument, match=r"outside \[0, 2\]"):
        engine.open("a", [1, 2], SamplingParams(), VerificationMode.GREEDY, feature_layers=(1, 3))
