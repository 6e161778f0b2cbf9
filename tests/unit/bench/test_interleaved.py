"""``specsplit bench --suite interleaved``: the --drafters list and the draft service flags it implies."""

from __future__ import annotations

import argparse

import pytest

from specsplit.bench import interleaved
from specsplit.bench.evaluation import Summary, theoretical_speedup
from specsplit.bench.speculative import build_parser
from specsplit.lmkit.auth import Tokens
from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.api.config import DEFAULT_TREE_BRANCHES

pytestmark = pytest.mark.unit


def test_drafters_chains_fixed_k_and_tree_widths_are_parsed():
    entries = interleaved.parse_entries("ngram, eagle@2,ngram+eagle,medusa/1,recycling@3/8")
    assert [(e.label, e.drafter, e.chain, e.fixed_k, e.branches) for e in entries] == [
        ("ngram", DrafterKind.NGRAM, (), 0, 0),
        ("eagle@2", DrafterKind.EAGLE, (), 2, 0),
        ("ngram+eagle", DrafterKind.CHAIN, (DrafterKind.NGRAM, DrafterKind.EAGLE), 0, 0),
        ("medusa/1", DrafterKind.MEDUSA, (), 0, 1),
        ("recycling@3/8", DrafterKind.RECYCLING, (), 3, 8),
    ]


def test_requests_ask_for_the_tree_width_a_served_request_gets_unless_told():
    args = build_parser(argparse.ArgumentParser()).parse_args(["--json", "x.json", "--suite", "interleaved"])
    assert args.tree_branches == DEFAULT_TREE_BRANCHES > 1


@pytest.mark.parametrize("spec,fragment", [
    ("nope", "unknown drafter"),
    ("chain", "members joined by"),
    ("eagle@0", "name@K with K >= 1"),
    ("eagle@x", "name@K with K >= 1"),
    ("eagle,eagle", "each once"),
    ("medusa/0", "name/B with 1 <= B"),
    ("medusa/x", "name/B with 1 <= B"),
    ("medusa/99", "name/B with 1 <= B"),
    (" , ", "at least one"),
])
def test_bad_drafter_lists_are_refused(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        interleaved.parse_entries(spec)


def test_the_draft_service_gets_each_self_draft_flag_once():
    args = build_parser(argparse.ArgumentParser()).parse_args(["--json", "x.json", "--suite", "interleaved"])
    flags = interleaved.draft_flags(args, interleaved.parse_entries("ngram,eagle,ngram+eagle,quantized"))
    assert flags == ["--quantize", "int8", "--eagle-head", "smollm2-135m"]
    assert interleaved.draft_flags(args, interleaved.parse_entries("ngram")) == []


def test_each_contender_calls_under_a_token_of_its_own(tmp_path):
    services, own = interleaved.caller_tokens(tmp_path, ["target-only", "ngram", "recycling"])
    accepted = Tokens(path=str(services))
    callers = {label: accepted.caller(Tokens(path=str(path)).first()) for label, path in own.items()}
    assert None not in callers.values()
    assert len(set(callers.values())) == 3  # a recycling table per caller: none shared between contenders


def test_a_warm_up_set_sharing_prompts_with_the_measured_set_is_refused():
    args = build_parser(argparse.ArgumentParser()).parse_args([
        "--json", "x.json", "--suite", "interleaved", "--drafters", "recycling", "--prompt-set", "mixed",
        "--warm-prompt-set", "mixed-dev"])
    with pytest.raises(ValueError, match="shares prompts with --prompt-set mixed"):
        interleaved.run(args)


@pytest.mark.parametrize("accepted,draft_s,best_k", [(2, 0.07, 1), (8, 0.01, 8)])
def test_the_verify_free_bound_takes_the_best_k_for_the_measured_acceptance(accepted, draft_s, best_k):
    # 10 drafted tokens, `accepted` of them kept; a target step takes 1 s, a drafted token draft_s s (c = draft_s)
    summary = Summary(prompts=1, rounds=10, drafted=10, accepted=accepted, draft_compute_s=draft_s * 10,
                      baseline_target_compute_s=10.0, baseline_rounds=10)
    got = interleaved.figures(summary, 8)
    alpha, c = accepted / 10, draft_s
    assert got["verify_free_best_k"] == best_k
    assert got["verify_free_speedup"] == round(max(theoretical_speedup(alpha, n, c) for n in range(1, 9)), 3)
    assert got["verify_free_speedup"] >= got["theoretical_speedup"]
