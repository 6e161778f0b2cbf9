"""A drafter's chain of k tokens in one replay (``chain_step``, uncaptured on the CPU) chooses what k single steps of
the same static step choose, leaves the slot as they would, and refuses what it cannot run."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import chain_step, draws, graph_step

pytestmark = pytest.mark.unit

VOCAB = 49152
MAX_CHAIN = 6


@pytest.fixture(scope="module")
def step(tiny_target_dir):
    from specsplit.lmkit import models

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    graph = graph_step.GraphStep(model, slots=2, capacity=96, max_width=8)
    graph.chains = chain_step.ChainStep(graph, MAX_CHAIN)
    return graph


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(17, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _one_by_one(graph, slot: int, context: list[int], k: int, kind: str, seed: int, temperature: float):
    """The chain's tokens, margins and runners-up chosen on the host, a step of the same static step a token."""
    tokens, margins, others = [], [], []
    temperature_t = torch.tensor(temperature)
    for i in range(k):
        fed = [*context, *tokens]
        logits = graph.forward(slot, len(fed) - 1, fed[-1:])[-1].float()
        key = chain_step.coupled_keys(seed, len(fed), 1)
        token = int(chain_step.choose(kind, logits, temperature_t, key, torch.arange(VOCAB)))
        if kind == chain_step.GUMBEL:  # the host's coupled draft token: draws.gumbel_max over q's support
            q = torch.softmax((logits - logits.amax()) / temperature, dim=-1)
            assert token == draws.gumbel_max(q, lambda ids: draws.gumbel(seed, draws.Stream.COUPLED, len(fed), ids))
        top = torch.topk(logits, 2).indices.tolist()
        other = top[1] if top[0] == token else top[0]
        tokens.append(token)
        others.append(other)
        margins.append(float(logits[token] - logits[other]))
    return tokens, margins, others


@pytest.mark.parametrize("kind, seed, temperature", [
    (chain_step.GREEDY, 0, 1.0), (chain_step.GUMBEL, 1, 0.7), (chain_step.GUMBEL, 2, 1.5), (chain_step.GUMBEL, 3, 4.0),
])
def test_a_chain_chooses_what_single_steps_choose_and_leaves_their_cache(step, kind, seed, temperature):
    prompt = _prompt(20, seed)
    step.clear(0)
    step.clear(1)
    step.forward(0, 0, prompt[:-1])
    step.forward(1, 0, prompt[:-1])
    for k in (1, 3, MAX_CHAIN):
        keys = chain_step.coupled_keys(seed, len(prompt), k) if kind == chain_step.GUMBEL else None
        chained = step.chains.run(0, len(prompt) - 1, prompt[-1], k, kind, keys, temperature)
        single = _one_by_one(step, 1, prompt, k, kind, seed, temperature)
        assert chained == single, (kind, k)
        # both slots now hold the prompt and the first k - 1 tokens: the next step reads the same keys and values
        following = [*prompt, *chained[0]]
        torch.testing.assert_close(step.forward(0, len(following) - 1, following[-1:]),
                                   step.forward(1, len(following) - 1, following[-1:]), rtol=0, atol=0)
        prompt = following


def test_a_gumbel_chain_depends_on_its_seed_and_a_greedy_one_does_not(step):
    prompt = _prompt(12, 9)
    step.forward(0, 0, prompt[:-1])
    runs = {seed: step.chains.run(0, len(prompt) - 1, prompt[-1], MAX_CHAIN, chain_step.GUMBEL,
                                  chain_step.coupled_keys(seed, len(prompt), MAX_CHAIN), 3.0)[0] for seed in range(4)}
    assert len({tuple(tokens) for tokens in runs.values()}) > 1
    again = step.chains.run(0, len(prompt) - 1, prompt[-1], MAX_CHAIN, chain_step.GUMBEL,
                            chain_step.coupled_keys(0, len(prompt), MAX_CHAIN), 3.0)[0]
    assert again == runs[0]


def test_what_a_chain_cannot_run_is_refused(step):
    with pytest.raises(ValueError, match="chains 1 to 6"):
        step.chains.run(0, 0, 5, MAX_CHAIN + 1, chain_step.GREEDY)
    with pytest.raises(ValueError, match="kind must be one of"):
        step.chains.run(0, 0, 5, 2, "beam")
    with pytest.raises(ValueError, match="needs 2 position keys"):
        step.chains.run(0, 0, 5, 2, chain_step.GUMBEL)
    with pytest.raises(ValueError, match="do not fit a slot"):
        step.chains.run(0, 94, 5, 3, chain_step.GREEDY)
    with pytest.raises(ValueError, match="slot 2 is not one of the 2 slots"):
        step.chains.run(2, 0, 5, 1, chain_step.GREEDY)
    with pytest.raises(ValueError, match="a chain holds 1 to 96 tokens"):
        chain_step.ChainStep(step, 97)


def test_a_session_cache_drafts_its_chains_through_rejected_and_accepted_blocks(tiny_target_dir):
    """``GraphSessionCache.draft_chain`` round after round: a block rejected at once, taken in part, taken whole
    (the cache then reads the last drafted token before chaining from the target's), each chain's tokens and margins
    those of transformers' forward over the whole sequence, and the cache holding exactly what it says."""
    from specsplit.lmkit import forward, models
    from specsplit.lmkit.kvcache import SessionCache

    model = models.load_model(models.ModelSpec(str(tiny_target_dir)))
    new_cache, _ = forward.slots(model, sessions=1, context=96, width=8, batch=1, graphs=False, chain=4)
    cache, context = new_cache(), _prompt(15, 4)
    for taken in (0, 2, 4, 4, 1):
        tokens, margins, others = cache.draft_chain(context, 4, chain_step.GREEDY)
        assert cache.tokens == [*context, *tokens[:-1]]
        reference, fed = SessionCache(model), list(context)
        for token, margin, other in zip(tokens, margins, others):
            logits = reference.logits(fed, [])[-1]
            assert token == int(logits.argmax())
            assert margin == pytest.approx(float(logits[token] - logits[other]), rel=1e-4, abs=1e-4)
            fed.append(token)
        bonus = (tokens[taken] + 1) % VOCAB if taken < 4 else 17
        context = [*context, *tokens[:taken], bonus]
    cache.release()
