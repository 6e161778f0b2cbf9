"""The network bench's arithmetic: the link-aware Leviathan-style bound, the cells, and the goals read from a run."""

from __future__ import annotations

import pytest

from specsplit.bench import network
from specsplit.bench.evaluation import theoretical_speedup

pytestmark = pytest.mark.unit


def test_the_bound_is_leviathans_on_loopback_and_falls_with_the_links():
    for alpha, k, c in [(0.6, 4, 0.0), (0.8, 3, 0.1), (0.3, 8, 0.02)]:
        assert network.bound(alpha, k, c, 0.05, 0.0, 0.0, overlap=False) == pytest.approx(
            theoretical_speedup(alpha, k, c))
    near = network.bound(0.7, 4, 0.05, 0.05, 0.002, 0.002, overlap=False)
    far = network.bound(0.7, 4, 0.05, 0.05, 0.050, 0.050, overlap=False)
    assert 1.0 < far < near
    # a long draft link alone costs sync its full round trip; overlap hides it behind the target's leg
    draft_far_sync = network.bound(0.9, 4, 0.0, 0.05, 0.050, 0.050, overlap=False)
    draft_far_overlap = network.bound(0.9, 4, 0.0, 0.05, 0.050, 0.050, overlap=True)
    assert draft_far_overlap > draft_far_sync
    assert network.bound(0.5, 0, 0.1, 0.05, 0.01, 0.01, overlap=True) == 1.0


def test_a_cells_draft_cost_is_its_time_per_token_drafted_not_per_token_verified():
    """Blocks drafted ahead for a miss, and the bonus guess each ahead block starts with, cost draft time but are
    never verified: over verified tokens an overlap cell's draft would look a third dearer than it is. A session's
    first reply (it reads the context) is left out."""
    from specsplit.orchestrator.decode.loop import LoopStats

    loop = LoopStats(rounds=10, drafted=30, accepted=27, committed=37, draft_compute_s=2.5, draft_warm_s=2.0,
                     draft_warm_tokens=40)
    cell = network.Cell("model-overlap-fixed", network.DrafterKind.MODEL, 3, overlap=True)
    links = {"draft": {"srtt_ms": 1.0}, "target": {"srtt_ms": 1.0}}
    figures = network._cell_figures(cell, [network.Run(list(range(37)), 3.7, loop)], 8.0, [list(range(37))],
                                    0.1, links)
    assert figures["draft_cost_ratio"] == pytest.approx(0.5)  # 50 ms a token drafted, over a 100 ms step
    assert figures["identical_to_target_only"] == "1/1"


def test_a_level_pools_each_cells_repeats_against_every_target_only_pass():
    from specsplit.orchestrator.decode.loop import LoopStats

    def run(wall_s, ids=(1, 2, 3, 4)):
        return network.Run(list(ids), wall_s, LoopStats(rounds=4, committed=4, target_compute_s=0.4))

    cell = network.Cell("ngram-sync-fixed", network.DrafterKind.NGRAM, 8)
    runs = {"target-only": [[run(1.0)], [run(0.8)], [run(1.2)]],  # 4, 5 and 3.33 tokens/s: mean 4.11
            cell.name: [[run(0.5)], [run(1.5, ids=(1, 2, 3, 5))]]}  # 8 tokens in 2 s, one output differs
    links = {"draft": {"srtt_ms": 0.0}, "target": {"srtt_ms": 0.0}}
    level = network.level_report(0.0, {"runs": runs, "links_measured": links}, [cell], None, {})
    assert level["repeats"] == 2
    assert level["target_only_tokens_per_s"] == pytest.approx((4 + 5 + 4 / 1.2) / 3, abs=1e-3)
    assert level["noise"] == pytest.approx((5 - 4 / 1.2) / level["target_only_tokens_per_s"], abs=1e-3)
    figures = level["cells"][0]
    assert figures["tokens_per_s"] == pytest.approx(4.0)
    assert figures["identical_to_target_only"] == "1/2"


def test_cells_and_fixed_k_flags():
    cells = network.cells_for(["ngram"], network._fixed_k("ngram:6"))
    assert [c.name for c in cells] == ["ngram-sync-fixed", "ngram-sync-adaptive", "ngram-overlap-fixed",
                                       "ngram-overlap-adaptive"]
    assert {c.k for c in cells} == {6}
    with pytest.raises(ValueError, match="NAME:K"):
        network._fixed_k("ngram=6")


def test_goals_read_never_slower_and_the_share_kept_at_2_ms():
    def level(rtt, speedups, noise=0.02):
        return {"added_rtt_ms": rtt, "noise": noise,
                "cells": [{"cell": f"ngram-{m}-adaptive", "speedup_vs_target_only": s} for m, s in speedups.items()]}

    levels = [level(0, {"sync": 1.4, "overlap": 1.5}), level(2, {"sync": 1.3, "overlap": 1.45}),
              level(10, {"sync": 0.99, "overlap": 1.2})]
    goals = network.goals(levels, ["ngram"])
    assert goals["ngram_never_slower_than_target_only"]  # 0.99 is within the 2 % noise band
    assert goals["ngram_min_adaptive_speedup"] == 0.99
    assert goals["ngram_overlap_at_2ms_kept_of_loopback_gain"] == pytest.approx(0.9)
    assert goals["ngram_overlap_adaptive_speedup_at_10ms"] == 1.2
    levels[2]["cells"][0]["speedup_vs_target_only"] = 0.9
    assert not network.goals(levels, ["ngram"])["ngram_never_slower_than_target_only"]
