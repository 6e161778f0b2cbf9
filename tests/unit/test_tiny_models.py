"""The suite's tiny reference models use their context: the greedy tests that state the product's promise can fail.

A model whose greedy token ignored the context (the last prompt token repeated, say) would pass every equality
test with a cache written at the wrong positions or dropped altogether; these tests state the property the
shared tiny target and draft of ``tests/conftest.py`` are built to have.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_PROMPTS

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_target_dir).eval()


@pytest.fixture(scope="module")
def sequences(tiny_reference):
    """Each prompt followed by the target's own 24 greedy tokens, and where the continuation starts."""
    prompts, outputs = tiny_reference
    return [(prompt + output, len(prompt)) for prompt, output in zip(prompts, outputs)]


def _argmax(model, ids: list[int], positions: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {"position_ids": torch.tensor([positions])} if positions is not None else {}
        return model(torch.tensor([ids]), **kwargs).logits[0].argmax(-1)


def _changed(pairs) -> float:
    """The share of positions whose greedy token differs between the two runs of each pair."""
    changed = total = 0
    for a, b in pairs:
        changed += int((a != b).sum())
        total += len(a)
    return changed / total


def test_greedy_output_is_neither_the_last_prompt_token_nor_one_token(tiny_reference):
    prompts, outputs = tiny_reference
    assert sum(output == [prompt[-1]] * len(output) for prompt, output in zip(prompts, outputs)) == 0
    assert all(len(set(output)) >= 3 for output in outputs), outputs


def _greedy(model, ids: list[int], positions: list[int] | None = None, tokens: int = 24) -> torch.Tensor:
    """``tokens`` greedy tokens after ``ids`` (fed at ``positions``, each new token at the next position)."""
    positions = list(range(len(ids))) if positions is None else positions
    ids, positions, out = list(ids), list(positions), []
    for _ in range(tokens):
        out.append(int(_argmax(model, ids, positions)[-1]))
        ids.append(out[-1])
        positions.append(positions[-1] + 1)
    return torch.tensor(out)


def test_dropping_the_context_changes_most_greedy_tokens(target, sequences):
    """Each continuation token fed alone (no keys and values before it): most next tokens differ from the full
    context's; generating after the prompt's first half dropped: most greedy tokens differ."""
    alone, halved = [], []
    for ids, start in sequences:
        full = _argmax(target, ids)[start - 1 : -1]
        with torch.no_grad():
            one_by_one = target(torch.tensor(ids).view(-1, 1)).logits[:, 0].argmax(-1)[start - 1 : -1]
        alone.append((full, one_by_one))
        halved.append((torch.tensor(ids[start:]), _greedy(target, ids[start // 2 : start])))
    assert _changed(alone) > 0.75
    assert _changed(halved) > 0.5


def test_the_positions_of_the_context_matter(target, sequences):
    """Generating with the prompt's keys one position off (a gap before the first generated token), or after the
    prompt's tokens in another order, changes greedy tokens."""
    gapped, shuffled = [], []
    for ids, start in sequences:
        reference = torch.tensor(ids[start:])
        gapped.append((reference, _greedy(target, ids[:start], [*range(start - 1), start])))
        order = torch.randperm(start - 1, generator=torch.Generator().manual_seed(start)).tolist()
        shuffled.append((reference, _greedy(target, [ids[i] for i in order] + [ids[start - 1]])))
    assert _changed(gapped) > 0.3
    assert _changed(shuffled) > 0.4


def test_the_draft_agrees_with_the_target_often_but_not_always(tiny_draft_dir, sequences):
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM.from_pretrained(tiny_draft_dir).eval()
    agreed = [(_argmax(draft, ids)[start - 1 : -1], torch.tensor(ids[start:])) for ids, start in sequences]
    assert 0.5 < 1 - _changed(agreed) < 1
