"""The static-shape step (what CUDA graphs capture) gives the stock forward's logits, in float32 on the CPU.

Chunked prefills, decodes and verify blocks of two sessions in two slots, interleaved, with a rejected
block rolled back by feeding from an earlier position; each step's logits against transformers' forward
over the whole sequence. The KV lives in blocks of 4 positions here, so every session spans several, taken as
it grows from a pool that may hold fewer than every slot at capacity.
"""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import graph_step

pytestmark = pytest.mark.unit

VOCAB = 49152
PAGED = dict(block_size=4, min_read=8)  # blocks of 4 positions; spans of 2, 4, 8, ... blocks


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    from specsplit.lmkit import models

    return models.load_model(models.ModelSpec(str(tiny_target_dir)))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stock(model, sequence: list[int], first: int) -> torch.Tensor:
    """transformers' logits of positions first.. of ``sequence``, one forward from scratch."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0, first:]


def test_buckets_are_powers_of_two_up_to_the_widest_block():
    assert graph_step.buckets(1) == (1,)
    assert graph_step.buckets(16) == (1, 2, 4, 8, 16)
    assert graph_step.buckets(9) == (1, 2, 4, 8, 9)
    with pytest.raises(ValueError, match="max_width must be >= 1"):
        graph_step.buckets(0)


def test_prefill_decode_verify_and_rollback_in_two_slots_equal_the_stock_forward(model):
    step = graph_step.GraphStep(model, slots=2, capacity=64, max_width=8, **PAGED)
    a, b = _ids(37, 1), _ids(5, 2)  # a: prefilled in chunks of 8 (the last one padded), b: one padded bucket
    checks = []

    def feed(slot: int, sequence: list[int], start: int) -> None:
        got = step.forward(slot, start, sequence[start:])
        assert got.shape == (len(sequence) - start, VOCAB)
        checks.append((got.clone(), _stock(model, sequence, start)))

    feed(0, a, 0)
    feed(1, b, 0)
    a = a + _ids(4, 3)  # a verify block of 4 after a's prompt
    feed(0, a, 37)
    b = b + _ids(1, 4)  # b decodes one token
    feed(1, b, 5)
    a = a[:39] + _ids(3, 5)  # two of a's four accepted: the next block overwrites positions 39.. (rollback)
    feed(0, a, 39)
    b = b + _ids(7, 6)  # b: a block of 7 (bucket 8, padded)
    feed(1, b, 6)
    for got, want in checks:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_sessions_replayed_together_get_their_solo_logits_in_batch_buckets_and_groups(model):
    """Rows of different widths and positions in one replay (batch bucket 4 for 3 rows: one scratch row), then
    five rows with max_batch 4 (two groups): each row's logits are its stock forward's, and the scratch row
    and the padding leave every session's keys intact for its next step."""
    step = graph_step.GraphStep(model, slots=5, capacity=48, max_width=8, max_batch=4, **PAGED)
    sequences = [_ids(n, 10 + slot) for slot, n in enumerate((9, 3, 14, 6, 1))]
    for slot, sequence in enumerate(sequences):  # prompts, alone
        step.forward(slot, 0, sequence)
    checks = []
    for blocks in ([(0, 4), (1, 1), (2, 7)], [(0, 2), (1, 8), (2, 1), (3, 5), (4, 3)]):
        rows = []
        for slot, n in blocks:
            start = len(sequences[slot])
            sequences[slot] = sequences[slot] + _ids(n, 100 * slot + n)
            rows.append((slot, start, sequences[slot][start:]))
        for (slot, start, _), got in zip(rows, step.forward_rows(rows)):
            checks.append((got.clone(), _stock(model, sequences[slot], start)))
    assert step.batches == (1, 2, 4) and len(checks) == 8
    for got, want in checks:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match="each slot at most once"):
        step.forward_rows([(0, 30, [1]), (0, 31, [2])])
    with pytest.raises(ValueError, match="wider than max_width 8"):
        step.forward_rows([(0, 30, list(range(9)))])


def test_a_block_past_the_slot_and_a_bad_slot_are_refused(model):
    step = graph_step.GraphStep(model, slots=1, capacity=16, max_width=4, **PAGED)
    with pytest.raises(ValueError, match="do not fit a slot of 16"):
        step.forward(0, 14, [1, 2, 3])  # bucket 4 at 14..17
    with pytest.raises(ValueError, match="slot 1 is not one of the 1 slots"):
        step.forward(1, 0, [1])
    with pytest.raises(ValueError, match="must hold at least one block"):
        graph_step.GraphStep(model, slots=1, capacity=2, max_width=4, **PAGED)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        graph_step.GraphStep(model, slots=1, capacity=16, max_width=4, graphs=True)


def test_slots_are_handed_out_once_and_reused_after_release():
    from specsplit.lmkit import errors

    slots = graph_step.Slots(2)
    assert slots.take() == 0 and slots.take() == 1
    with pytest.raises(errors.ResourceExhausted, match="every one of the 2 KV slots is held"):
        slots.take()
    slots.release(0)
    with pytest.raises(ValueError, match="slot 0 is not held"):
        slots.release(0)
    assert slots.take() == 0


def test_a_released_slot_holds_nothing_of_its_last_session(model):
    """A step reads its slot's whole capacity and masks what lies past the row; a masked NaN would still reach the
    sum (0 * NaN). A session leaves non-finite keys and values past its tokens; the next session in that slot gets
    finite logits equal to the stock forward's."""
    step = graph_step.GraphStep(model, slots=2, capacity=16, max_width=4, **PAGED)
    slots = graph_step.Slots(2)
    first = graph_step.GraphSessionCache(model, step, slots)
    first.apply(0, [5, 6, 7], 3)
    block = step.held[first.slot][0]
    with torch.inference_mode():
        for buffers in (step.keys, step.values):
            for layer in buffers:
                layer[:, block * step.block_size + 3] = float("nan")  # past its three tokens, in its block
    slot = first.slot
    first.release()
    assert step.blocks.free == step.blocks.count
    second = graph_step.GraphSessionCache(model, step, slots)
    assert second.slot == slot and step.held[slot] == [] 
    got = second.apply(0, [5, 6, 7], 3)
    assert step.held[slot] == [block]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _stock(model, [5, 6, 7], 0), rtol=1e-4, atol=1e-4)


def test_two_groups_in_one_bucket_keep_their_own_logits(model):
    """Four rows of one width with max_batch 2: two groups replay the same (2, 4) bucket, whose output buffer the
    second overwrites; each row still gets its own stock logits."""
    step = graph_step.GraphStep(model, slots=4, capacity=32, max_width=4, max_batch=2, **PAGED)
    sequences = [_ids(5 + slot, 200 + slot) for slot in range(4)]
    for slot, sequence in enumerate(sequences):
        step.forward(slot, 0, sequence)
    rows = []
    for slot in range(4):
        start = len(sequences[slot])
        sequences[slot] = sequences[slot] + _ids(3, 300 + slot)
        rows.append((slot, start, sequences[slot][start:]))
    got = step.forward_rows(rows)
    for (slot, start, _), logits in zip(rows, got):
        torch.testing.assert_close(logits, _stock(model, sequences[slot], start), rtol=1e-4, atol=1e-4)


def test_after_a_rollback_the_next_block_is_fed_from_the_kept_position(model):
    """A session's cache keeps 2 of a 4-token block (crop), then is fed 3 other tokens: its logits are the stock
    forward's over the kept context and the new tokens, not over the rejected ones."""
    step = graph_step.GraphStep(model, slots=1, capacity=32, max_width=4, **PAGED)
    slots = graph_step.Slots(1)
    cache = graph_step.GraphSessionCache(model, step, slots)
    prompt, block, after = _ids(6, 400), _ids(4, 401), _ids(3, 402)
    cache.apply(0, prompt + block, 1)
    keep = len(prompt) + 2
    got = cache.apply(keep, after, len(after))
    torch.testing.assert_close(got, _stock(model, prompt + block[:2] + after, keep), rtol=1e-4, atol=1e-4)
    assert cache.tokens == prompt + block[:2] + after


def test_sessions_take_blocks_as_they_grow_and_a_step_reads_the_span_its_rows_hold(model):
    """Blocks of 4 in a pool of 12 for slots of capacity 64 (16 blocks each): a session holds the blocks its tokens
    fill, a step replays the span bucket of its longest row (a 5-token session reads 2 blocks, not 16), a pool too
    short refuses with what to do, and a released session's blocks serve the next."""
    from specsplit.lmkit import errors

    step = graph_step.GraphStep(model, slots=2, capacity=64, max_width=8, blocks=12, **PAGED)
    assert step.spans == (2, 4, 8, 16)
    slots = graph_step.Slots(2)
    a, b = graph_step.GraphSessionCache(model, step, slots), graph_step.GraphSessionCache(model, step, slots)
    read = []
    run = step.run
    step.run = lambda inputs, span: (read.append(span), run(inputs, span))
    short, long = _ids(5, 20), _ids(30, 21)
    torch.testing.assert_close(a.apply(0, short, 5), _stock(model, short, 0), rtol=1e-4, atol=1e-4)
    assert len(step.held[a.slot]) == 2 and read == [2]
    torch.testing.assert_close(b.apply(0, long, 30), _stock(model, long, 0), rtol=1e-4, atol=1e-4)
    assert len(step.held[b.slot]) == 8 and read[1:] == [2, 4, 8, 8]  # chunks of 8: 0..7, ..15, ..23, ..29
    assert step.held_positions() == 40
    long_more = long + _ids(8, 22)  # 38 positions: a tenth block
    torch.testing.assert_close(b.apply(30, long_more[30:], 8), _stock(model, long_more, 30), rtol=1e-4, atol=1e-4)
    assert len(step.held[b.slot]) == 10 and step.blocks.free == 0
    with pytest.raises(errors.ResourceExhausted, match="1 more KV blocks wanted, 0 of 12 free"):
        a.apply(5, _ids(4, 23), 1)  # position 8: a third block for a
    b.release()
    assert step.blocks.free == 10
    grown = short + _ids(4, 23)
    torch.testing.assert_close(a.apply(5, grown[5:], 4), _stock(model, grown, 5), rtol=1e-4, atol=1e-4)
    assert len(step.held[a.slot]) == 3


def test_a_fork_copies_the_prompt_into_blocks_of_its_own(model):
    step = graph_step.GraphStep(model, slots=2, capacity=32, max_width=4, **PAGED)
    slots = graph_step.Slots(2)
    source, fork = graph_step.GraphSessionCache(model, step, slots), graph_step.GraphSessionCache(model, step, slots)
    prompt = _ids(10, 30)
    source.apply(0, prompt, 1)
    fork.copy_prefix(source, 9)
    assert len(step.held[fork.slot]) == 3 and not set(step.held[fork.slot]) & set(step.held[source.slot])
    source.release()  # the fork's keys and values are its own
    more = prompt + _ids(3, 31)
    torch.testing.assert_close(fork.apply(9, more[9:], 4), _stock(model, more, 9), rtol=1e-4, atol=1e-4)


def test_a_token_tree_gives_each_node_its_root_paths_logits_and_the_kept_path_reads_as_a_chain(model):
    """A tree fed after two context tokens (padded to the width-8 bucket, a row beside a chain row): each node's
    logits are the stock forward's over the context and the node's root path; after ``keep_path`` keeps a branch
    whose nodes are not consecutive, the next step's logits are the stock forward's over the context and that
    branch. A tree longer than the widest bucket's room goes after its context's chunks."""
    step = graph_step.GraphStep(model, slots=2, capacity=64, max_width=8, max_batch=2, **PAGED)
    slots = graph_step.Slots(2)
    tree_cache = graph_step.GraphSessionCache(model, step, slots)
    chain_cache = graph_step.GraphSessionCache(model, step, slots)
    prompt, other = _ids(11, 40), _ids(6, 41)
    tree_cache.apply(0, prompt[:-2], 1)
    chain_cache.apply(0, other, 1)
    nodes, parents = _ids(5, 42), [-1, 0, 0, 2, -1]  # 0 -> {1, 2 -> 3}; 4 a second root
    paths = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 2, 3], 4: [4]}
    from specsplit.target_service.batched_forward import Step

    more = _ids(3, 43)
    logits = graph_step.forward_steps([
        Step(tree_cache, len(prompt) - 2, [*prompt[-2:], *nodes], len(nodes) + 2, tuple(parents)),
        Step(chain_cache, len(other), more, len(more)),
    ])
    torch.testing.assert_close(logits[1], _stock(model, other + more, len(other)), rtol=1e-4, atol=1e-4)
    rows = logits[0]
    torch.testing.assert_close(rows[:2], _stock(model, prompt, len(prompt) - 2), rtol=1e-4, atol=1e-4)
    for node, path in paths.items():
        want = _stock(model, prompt + [nodes[i] for i in path], len(prompt) + len(path) - 1)[0]
        torch.testing.assert_close(rows[2 + node], want, rtol=1e-4, atol=1e-4)
    tree_cache.keep_path(len(prompt), [0, 2, 3])
    kept = prompt + [nodes[0], nodes[2], nodes[3]]
    assert tree_cache.tokens == kept
    after = _ids(2, 44)
    got = tree_cache.apply(len(kept), after, 2)
    torch.testing.assert_close(got, _stock(model, kept + after, len(kept)), rtol=1e-4, atol=1e-4)
    # a context of 9 tokens and a tree of 3: the context's first 4 in a chunk, the rest with the tree in one row
    context = kept + after
    fresh = graph_step.GraphSessionCache(model, step, graph_step.Slots(1))
    fresh.slot = tree_cache.slot  # reuse the released row's table
    tree_cache.release()
    fresh.slot = slots.take()
    got = fresh.apply(0, [*context, *nodes[:3]], 4, [-1, 0, 0])
    torch.testing.assert_close(got[0], _stock(model, context, len(context) - 1)[0], rtol=1e-4, atol=1e-4)
    for node, path in {0: [0], 1: [0, 1], 2: [0, 2]}.items():
        want = _stock(model, context + [nodes[i] for i in path], len(context) + len(path) - 1)[0]
        torch.testing.assert_close(got[1 + node], want, rtol=1e-4, atol=1e-4)


def test_the_step_keeps_the_hidden_states_of_its_feature_layers_for_every_fed_token(model):
    """``feature_layers`` (0 = the embeddings, the layer count = the final norm's output): a chunked prefill and a
    batched step beside a row without features each give transformers' hidden states of every fed token."""
    layers = int(model.config.num_hidden_layers)
    step = graph_step.GraphStep(model, slots=2, capacity=64, max_width=4, max_batch=2, feature_layers=(layers, 0, 1),
                                **PAGED)
    assert step.feature_layers == (0, 1, layers)
    prompt, other = _ids(10, 50), _ids(3, 51)

    def hidden(sequence, first):
        with torch.no_grad():
            states = model(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
        return torch.stack([states[i][0, first:] for i in step.feature_layers], dim=1)

    logits, kept = step.forward_with_features(0, 0, prompt)  # chunks of 4, 4, 2
    torch.testing.assert_close(kept, hidden(prompt, 0), rtol=1e-4, atol=1e-4)
    step.forward(1, 0, other)
    more = _ids(3, 52)
    (_, first), (_, second) = step.forward_rows_with_features([(0, 10, more), (1, 3, more[:1])])
    torch.testing.assert_close(first, hidden(prompt + more, 10), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second, hidden(other + more[:1], 3), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"feature layers \[0, 9\] must be in \[0, 2\]"):
        graph_step.GraphStep(model, slots=1, capacity=16, max_width=4, feature_layers=(0, 9))
