"""The speed benchmark's arithmetic and outputs, on hand-built runs with known figures."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from specsplit.bench import speed
from specsplit.bench.evaluation import RunResult, theoretical_speedup
from specsplit.bench.prompts import DemoPrompt
from specsplit.lmkit.processes import cpu_seconds, cpu_used

pytestmark = pytest.mark.unit

PROMPT = DemoPrompt("p", "grounded", "text")


def run(tokens: int, wall_s: float, *, rounds: int, drafted=(), accepted=(), draft_s=0.0, target_s=0.0) -> RunResult:
    ids = list(range(tokens))
    return RunResult(PROMPT, "", ids, wall_s, rounds, sum(drafted), sum(accepted), draft_s, target_s, "LENGTH",
                     list(accepted), list(drafted))


def test_figures_compare_like_with_like():
    baseline = [run(40, 4.0, rounds=40, target_s=2.0)]  # 10 tok/s, 50 ms per target step
    # 40 tokens in 2 s, rounds of 4 drafted: 3, 4, 0, 2 ... accepted
    spec = [run(40, 2.0, rounds=4, drafted=[4, 4, 4, 4], accepted=[3, 4, 0, 2], draft_s=0.016, target_s=1.0)]
    hf = {"generate_tokens_per_s": 10.0, "assisted_tokens_per_s": 16.0}
    f = speed._figures(spec, baseline, speed.Mode("sync-fixed", 4, False, False), hf)
    assert f["speedup_vs_target_only"] == 2.0
    assert f["speedup_vs_hf_assisted"] == 1.25
    assert f["acceptance_rate"] == pytest.approx(9 / 16, abs=1e-4)
    assert f["draft_cost_ratio"] == pytest.approx((0.016 / 16) / 0.05, abs=1e-4)
    bound = theoretical_speedup(9 / 16, 4, (0.016 / 16) / 0.05)
    assert f["leviathan_bound"] == pytest.approx(bound, abs=1e-3)
    assert f["efficiency_vs_bound"] == pytest.approx(2.0 / bound, abs=1e-3)
    # position i is reached in every round; accepted where i < accepted count
    assert f["per_position_acceptance"] == [0.75, 0.75, 0.5, 0.25]
    assert f["identical_to_target_only"] == 1


def test_adaptive_modes_are_held_to_the_best_fixed_k_bound():
    baseline = [run(10, 1.0, rounds=10, target_s=0.5)]
    spec = [run(10, 0.5, rounds=4, drafted=[2, 2, 1, 1], accepted=[2, 1, 1, 0], target_s=0.3)]
    hf = {"generate_tokens_per_s": 10.0, "assisted_tokens_per_s": 10.0}
    f = speed._figures(spec, baseline, speed.Mode("sync-adaptive", 8, True, False), hf)
    alpha = 4 / 6
    assert f["leviathan_bound"] == pytest.approx(max(theoretical_speedup(alpha, k, 0.0) for k in range(1, 9)), abs=1e-3)


def args_for(**extra) -> argparse.Namespace:
    base = dict(model="m", drafter="ngram", draft_model="", prompt_set="demo", max_new_tokens=20, k=4,
                target_cpus="1", draft_cpus="0", target_threads=1, draft_threads=1, concurrency_max_new_tokens=16,
                concurrency_repeats=1, ngram_min=1, ngram_max=4, fixed_k=False, no_overlap=False, tp=1, chain="")
    return argparse.Namespace(**{**base, **extra})


def test_report_and_plot(tmp_path):
    baseline = [run(20, 2.0, rounds=20, target_s=1.0)]
    mode_runs = {
        name: (speed.Mode(name, 4, name.endswith("adaptive"), name.startswith("overlap")),
               [run(20, wall, rounds=8, drafted=[4] * 8, accepted=[1] * 8, target_s=0.8)])
        for name, wall in (("sync-adaptive", 1.6), ("overlap-adaptive", 1.5), ("sync-fixed", 1.7),
                           ("overlap-fixed", 1.6))
    }
    sweep = {k: (speed.Mode(f"sync-fixed-k{k}", k, False, False),
                 [run(20, 1.5 + k / 10, rounds=8, drafted=[k] * 8, accepted=[1] * 8)]) for k in (1, 2, 4)}

    def level(n, decode):
        return {"decode_tokens_per_s": decode, "end_to_end_tokens_per_s": decode / 2, "mean_drafted_per_round": 0.0,
                "mean_batch_size": float(n), "outputs": [[1, 2]] * n}

    concurrency = [{"sessions": n, "speculative": [level(n, 10.0 * n ** 0.6)], "no_speculation": [level(n, 9.0 * n ** 0.6)]}
                   for n in (1, 2, 8)]
    hf = {"generate_tokens_per_s": 10.0, "assisted_tokens_per_s": 12.0, "outputs": {"assisted": [list(range(20))]}}
    measured = {"modes": (baseline, mode_runs, sweep), "concurrency": concurrency}
    report = speed._report(args_for(), measured, hf)
    json.dumps(report)  # serialisable as is
    modes = report["single_stream"]["modes"]
    for name in ("sync-adaptive", "overlap-adaptive"):
        assert {"speedup_vs_target_only", "speedup_vs_hf_assisted", "efficiency_vs_bound"} <= set(modes[name])
    assert report["goals"]["overlap_beats_sync"] is True
    assert report["goals"]["speculation_ge_0_95_no_speculation_at_every_level"] is True
    at8 = report["concurrency"][-1]
    assert at8["no_speculation_vs_one_session"] == pytest.approx(8**0.6, abs=1e-3)
    assert report["goals"]["throughput_8_sessions_ge_3x_one"] is (8**0.6 >= 3.0)
    assert report["single_stream"]["hf"]["assisted_identical_to_specsplit"] == "1/1"
    png = tmp_path / "speed.png"
    assert speed.plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_concurrency = speed._report(args_for(), {"concurrency": concurrency}, None)
    assert "single_stream" not in only_concurrency and speed.plot(only_concurrency, tmp_path / "c.png")


def test_concurrency_rows_are_medians_of_paired_repeats():
    def sample(decode, outputs):
        return {"decode_tokens_per_s": decode, "end_to_end_tokens_per_s": decode / 2, "mean_drafted_per_round": 1.0,
                "mean_batch_size": 2.0, "outputs": outputs}

    same = [[1, 2], [3, 4]]
    # Repeat 2 is slow for both modes (a busy machine): the paired ratio stays near 1 where
    # unpaired medians would not; an outlier repeat does not move the median.
    spec = [sample(20.0, same), sample(10.0, same), sample(21.0, same)]
    none = [sample(20.0, same), sample(11.0, same), sample(19.0, same)]
    one = [{"sessions": 1, "speculative": [sample(10.0, [[1, 2]])] * 3, "no_speculation": [sample(10.0, [[1, 2]])] * 3}]
    row = speed._concurrency_table(one + [{"sessions": 2, "speculative": spec, "no_speculation": none}])[1]
    assert row["repeats"] == 3
    assert row["tokens_per_s_speculative"] == 20.0 and row["tokens_per_s_no_speculation"] == 19.0
    assert row["speculative_vs_no_speculation_per_repeat"] == [1.0, 0.909, 1.105]
    assert row["speculative_vs_no_speculation"] == 1.0
    assert row["no_speculation_vs_one_session"] == 1.9
    assert row["identical_outputs"] == "2/2"
    # one session differs in one repeat of one mode: that session is not identical
    spec[2] = sample(21.0, [[1, 2], [3, 5]])
    row = speed._concurrency_table(one + [{"sessions": 2, "speculative": spec, "no_speculation": none}])[1]
    assert row["identical_outputs"] == "1/2"


def test_concurrency_rows_carry_the_cpu_each_process_spent_a_token():
    def sample(decode, cpu):
        return {"decode_tokens_per_s": decode, "end_to_end_tokens_per_s": decode, "mean_drafted_per_round": 0.0,
                "mean_batch_size": 2.0, "outputs": [[1]], "cpu_ms_per_token": cpu}

    spec = [sample(10.0, {"target": 20.0, "orchestrator": 1.0}), sample(9.0, {"target": 30.0, "orchestrator": 2.0}),
            sample(11.0, {"target": 21.0, "orchestrator": 1.5})]
    none = [sample(10.0, {"target": 20.0, "orchestrator": 0.5}), sample(9.0, {"target": 22.0, "orchestrator": 0.5}),
            sample(11.0, {"target": 19.0, "orchestrator": 0.5})]
    row = speed._concurrency_table([{"sessions": 1, "speculative": spec, "no_speculation": none}])[0]
    assert row["cpu_ms_per_token_speculative"] == {"target": 21.0, "orchestrator": 1.5}
    assert row["cpu_ms_per_token_no_speculation"] == {"target": 20.0, "orchestrator": 0.5}
    assert row["cpu_per_token_speculative_vs_no_speculation"] == round(22.5 / 20.5, 3)
    # samples without the figure (no /proc): no CPU columns rather than made-up ones
    for s in spec:
        del s["cpu_ms_per_token"]
    row = speed._concurrency_table([{"sessions": 1, "speculative": spec, "no_speculation": none}])[0]
    assert "cpu_per_token_speculative_vs_no_speculation" not in row


def test_cpu_seconds_are_read_for_live_processes_only():
    import os

    used = cpu_seconds({"me": os.getpid()})
    if not used:
        pytest.skip("no /proc on this platform")
    start = used["me"]
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert cpu_seconds({"me": os.getpid()})["me"] >= start + 0.2
    assert cpu_used({"me": os.getpid()}, used)["me"] >= 0.2
    assert cpu_used({"me": os.getpid()}, {}) == {}  # nothing to count from
    assert cpu_seconds({"gone": 2**22 + 12345}) == {}
