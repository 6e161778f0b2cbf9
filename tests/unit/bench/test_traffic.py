"""The traffic bench: the mixed prompt set, interleaving, and the per-kind arithmetic on hand-built runs."""

from __future__ import annotations

import json

import pytest

from specsplit.bench import traffic
from specsplit.bench.evaluation import RunResult
from specsplit.bench.prompts import MIXED_PROMPTS, PROMPT_SETS, DemoPrompt, load_prompt_set

pytestmark = pytest.mark.unit

GROUNDED = {"code-edit", "extraction", "summary", "passage-qa", "rewrite", "list", "data-format"}


def test_the_mixed_set_has_48_prompts_of_8_kinds_with_a_held_out_split():
    kinds = {p.kind for p in MIXED_PROMPTS}
    assert len(MIXED_PROMPTS) >= 48 and len(kinds) >= 8
    assert len({p.name for p in MIXED_PROMPTS}) == len(MIXED_PROMPTS)
    for kind in kinds:  # every kind in both splits
        assert {p.split for p in MIXED_PROMPTS if p.kind == kind} == {"dev", "heldout"}
    assert {p.kind for p in MIXED_PROMPTS if p.group == "grounded"} == GROUNDED
    chats = [p for p in MIXED_PROMPTS if p.kind == "chat"]
    assert chats and all(len(p.messages) >= 3 and p.chat()[-1] == {"role": "user", "content": p.text} for p in chats)
    assert len(PROMPT_SETS["mixed-dev"]) + len(PROMPT_SETS["mixed-heldout"]) == len(MIXED_PROMPTS)


def test_a_prompt_set_whose_last_message_is_not_the_users_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    row = {"name": "x", "kind": "chat", "group": "open", "split": "dev",
           "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="last message"):
        load_prompt_set(path)


def test_contenders_rotate_so_no_one_always_runs_first():
    names = ["a", "b", "c"]
    firsts = [traffic.rotated(names, i)[0] for i in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert all(sorted(traffic.rotated(names, i)) == names for i in range(6))


def test_sampling_seeds_are_per_prompt_and_shared_by_contenders():
    a, b = DemoPrompt("a", "prose", ""), DemoPrompt("b", "prose", "")
    assert traffic.SAMPLING.params(a, 0) == traffic.SAMPLING.params(a, 0)
    assert traffic.SAMPLING.params(a, 0).seed != traffic.SAMPLING.params(b, 0).seed
    assert traffic.SAMPLING.params(a, 0).temperature == 0.7 and traffic.SAMPLING.params(a, 0).top_p == 0.95
    assert traffic.GREEDY.params(a, 0).greedy


def sample(prompt, contender, tokens, wall, decoding="greedy", ids=None, rounds=0, drafted=0, accepted=0):
    run = RunResult(prompt, "", ids if ids is not None else list(range(tokens)), wall, rounds, drafted, accepted,
                    0.0, 0.0, "")
    return traffic.Sample(contender, decoding, 0, run)


def test_rows_per_kind_group_and_split_with_ratios_and_goals():
    edit = DemoPrompt("e", "code-edit", "", "grounded", "dev")
    prose = DemoPrompt("p", "prose", "", "open", "heldout")
    settings = traffic.Settings(drafter=None, k=8, adaptive=True, overlap=True, max_new_tokens=10)
    measured = traffic.Traffic((edit, prose), [
        sample(edit, "target-only", 10, 1.0), sample(edit, "specsplit", 10, 0.5, rounds=4, drafted=8, accepted=6),
        sample(edit, "hf-generate", 10, 1.0), sample(edit, "hf-lookup-3", 10, 0.8),
        sample(edit, "hf-lookup-8", 10, 0.625),
        sample(prose, "target-only", 10, 1.0), sample(prose, "specsplit", 10, 1.0, ids=list(range(1, 11)), rounds=10),
        sample(prose, "hf-generate", 10, 1.0), sample(prose, "hf-lookup-3", 10, 1.0), sample(prose, "hf-lookup-8", 10, 1.0),
    ])
    report = traffic.report(measured, settings)
    json.dumps(report)
    rows = report["decodings"]["greedy"]["rows"]
    assert list(rows)[:5] == ["all", "group:grounded", "group:open", "split:dev", "split:heldout"]
    edit_row = rows["kind:code-edit"]
    assert edit_row["specsplit_vs_target_only"] == 2.0
    assert edit_row["best_hf_lookup"] == "hf-lookup-8" and edit_row["specsplit_vs_best_hf_lookup"] == 1.25
    assert edit_row["specsplit_acceptance_rate"] == 0.75 and edit_row["specsplit_drafted_per_round"] == 2.0
    assert edit_row["group"] == "grounded"
    assert rows["all"]["specsplit_vs_target_only"] == pytest.approx(20 / 1.5 / 10, abs=1e-3)
    assert rows["all"]["identical_to_target_only"]["specsplit"] == "1/2"  # the prose output differs
    goals = report["decodings"]["greedy"]["goals"]
    assert goals["grounded_kinds_ge_hf_lookup"] is True and goals["open_kinds_ge_0_98x_target_only"] is True
    assert goals["specsplit_outputs_identical"] is False
    assert len(report["per_generation"]) == 10
