"""A drafter's chain of k tokens in one replay (``chain_step``, uncaptured on the CPU) chooses what k single steps of
the same static step choose (greedy, and every sampling mode by the host's functions), leaves the slot as they would,
and refuses what it cannot run."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit import chain_step, draws, graph_step
from specsplit.lmkit.probs_codec import quantize_probs
from specsplit.lmkit.sampling import SamplingParams, logits_to_probs

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


def _host_choice(logits: torch.Tensor, draw: chain_step.Draw | None, position: int) -> tuple[int, torch.Tensor | None]:
    """The token the model drafter's token-at-a-time loop chooses at ``position`` from [vocab] logits, by the host's
    functions: the argmax; coupled, draws.gumbel_max over q's support; else draws.inverse_cdf of q (rounded as it
    travels when quantized) at the DRAFT uniform."""
    if draw is None:
        return int(logits.argmax()), None
    q = logits_to_probs(logits[None], SamplingParams(temperature=draw.temperature, top_k=draw.top_k, top_p=draw.top_p))
    if draw.coupled:
        return draws.gumbel_max(q[0], lambda ids: draws.gumbel(draw.seed, draws.Stream.COUPLED, position, ids)), q[0]
    if draw.quantize:
        q = quantize_probs(q)
    u = float(draws.uniforms(draw.seed, draws.Stream.DRAFT, [position], 1)[0, 0])
    return draws.inverse_cdf(q[0].to(torch.float64), u), q[0]


def _one_by_one(graph, slot: int, context: list[int], k: int, draw: chain_step.Draw | None):
    """The chain's tokens, margins, runners-up and q chosen on the host, a step of the same static step a token, and
    each position's second choice for a tree with its probability, as the model drafter's loop chooses them
    (greedy: the likeliest other token; coupled: draws.gumbel_runner_up; else not used: left out)."""
    tokens, margins, others, rows, branches = [], [], [], [], []
    for _ in range(k):
        fed = [*context, *tokens]
        logits = graph.forward(slot, len(fed) - 1, fed[-1:])[-1].float()
        token, q = _host_choice(logits, draw, len(fed))
        top = torch.topk(logits, 2).indices.tolist()
        other = top[1] if top[0] == token else top[0]
        if draw is None:
            probs = torch.softmax(logits, dim=-1)
            branch = int(probs.index_fill(0, torch.tensor([token]), -1.0).argmax())
            branches.append((branch, float(probs[branch])))
        elif draw.coupled:
            noise = lambda ids, n=len(fed): draws.gumbel(draw.seed, draws.Stream.COUPLED, n, ids)  # noqa: E731
            branch = draws.gumbel_runner_up(q, noise, token)
            branches.append((branch, float(q[branch])) if branch is not None else None)
        tokens.append(token)
        others.append(other)
        margins.append(float(logits[token] - logits[other]))
        rows.append(q)
    return tokens, margins, others, torch.stack(rows) if draw is not None and draw.quantize else None, branches


DRAWS = {
    "greedy": None,
    "coupled": chain_step.Draw(1, 0.7),
    "coupled-hot": chain_step.Draw(2, 4.0),
    "coupled-top-k": chain_step.Draw(3, 1.5, top_k=40),
    "coupled-top-p": chain_step.Draw(4, 1.0, top_p=0.9),
    "token-only": chain_step.Draw(5, 1.2, top_p=0.8, coupled=False),
    "token-only-cold": chain_step.Draw(6, 0.3, coupled=False),
    "draft-probs": chain_step.Draw(7, 0.9, top_k=50, top_p=0.95, coupled=False, quantize=True),
}


@pytest.mark.parametrize("name", DRAWS)
def test_a_chain_chooses_what_single_steps_choose_and_leaves_their_cache(step, name):
    draw = DRAWS[name]
    prompt = _prompt(20, 0 if draw is None else draw.seed)
    step.clear(0)
    step.clear(1)
    step.forward(0, 0, prompt[:-1])
    step.forward(1, 0, prompt[:-1])
    for k in (1, 3, MAX_CHAIN):
        chained = step.chains.run(0, len(prompt) - 1, prompt[-1], k, draw)
        *single, rows, branches = _one_by_one(step, 1, prompt, k, draw)
        assert [chained.tokens, chained.margins, chained.others] == single, (name, k)
        if rows is None:
            assert chained.probs is None
        else:  # the q sent with the tokens: the host's, rounded as it travels
            assert torch.equal(chained.probs, rows)
        if draw is None or draw.coupled:  # a tree's second choices, with their probabilities
            assert [None if second < 0 else (branch, second) for branch, second
                    in zip(chained.branches, chained.seconds)] == branches, (name, k)
        # both slots now hold the prompt and the first k - 1 tokens: the next step reads the same keys and values
        following = [*prompt, *chained.tokens]
        torch.testing.assert_close(step.forward(0, len(following) - 1, following[-1:]),
                                   step.forward(1, len(following) - 1, following[-1:]), rtol=0, atol=0)
        prompt = following


def test_a_penalized_chain_adjusts_as_the_host_and_leaves_the_next_request_unadjusted(step):
    """Greedy under a repetition penalty, a bias and min_tokens: each position's logits adjusted by
    ``apply_penalties`` over the committed tokens and those drafted before it; then a plain greedy chain of the same
    context chooses the unadjusted argmax again."""
    from specsplit.lmkit.penalties import apply_penalties

    params = SamplingParams(repetition_penalty=1.8, frequency_penalty=0.3, logit_bias=((40, 3.0),), min_tokens=3,
                            eos_token_ids=(2,), prompt_length=8)
    prompt = _prompt(16, 12)
    step.clear(0)
    step.forward(0, 0, prompt[:-1])
    chained = step.chains.run(0, len(prompt) - 1, prompt[-1], MAX_CHAIN, None, (params, prompt))
    want, fed = [], list(prompt)
    step.clear(1)
    step.forward(1, 0, prompt[:-1])
    for _ in range(MAX_CHAIN):
        logits = step.forward(1, len(fed) - 1, fed[-1:])[-1].float()
        adjusted = apply_penalties(logits[None], params, prompt, [fed[len(prompt):]])[0]
        want.append(int(adjusted.argmax()))
        fed.append(want[-1])
    assert chained.tokens == want
    plain = step.chains.run(0, len(prompt) - 1, prompt[-1], MAX_CHAIN, None)
    assert plain.tokens == _one_by_one(step, 1, prompt, MAX_CHAIN, None)[0] != want


@pytest.mark.parametrize("coupled", [True, False])
def test_a_sampled_chain_depends_on_its_seed_and_a_greedy_one_does_not(step, coupled):
    prompt = _prompt(12, 9)
    step.forward(0, 0, prompt[:-1])

    def run(draw):
        return step.chains.run(0, len(prompt) - 1, prompt[-1], MAX_CHAIN, draw)[0]

    runs = {seed: run(chain_step.Draw(seed, 3.0, coupled=coupled)) for seed in range(4)}
    assert len({tuple(tokens) for tokens in runs.values()}) > 1
    assert run(chain_step.Draw(0, 3.0, coupled=coupled)) == runs[0]
    assert run(None) == run(None)


def test_what_a_chain_cannot_run_is_refused(step):
    with pytest.raises(ValueError, match="chains 1 to 6"):
        step.chains.run(0, 0, 5, MAX_CHAIN + 1, chain_step.GREEDY)
    with pytest.raises(ValueError, match="temperature > 0"):
        step.chains.run(0, 0, 5, 2, chain_step.Draw(1, 0.0))
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
        tokens, margins, others, probs, *_ = cache.draft_chain(context, 4)
        assert probs is None
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
