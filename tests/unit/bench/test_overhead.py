"""The overhead suite's arithmetic: a round's parts add up to its wall time; figures against GPU steps."""

import pytest

from specsplit.bench import overhead
from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.decode.loop import LoopStats

pytestmark = pytest.mark.unit


def test_a_rounds_parts_add_up_to_its_wall_time_and_only_waited_drafting_counts():
    loop = LoopStats(rounds=10, committed=30, target_compute_s=0.030, target_forward_s=0.025, target_service_s=0.035,
                     target_wait_s=0.045, draft_compute_s=0.004, draft_service_s=0.006, draft_wall_s=0.010,
                     draft_wait_s=0.005)  # the rounds waited for half of the draft's replies' time
    mode = overhead.Mode("ngram4-overlap", 4, DrafterKind.NGRAM, True)
    row = overhead.parts_per_round([0.006] * 9, loop, mode)
    parts = row["parts_ms"]
    assert sum(parts.values()) == pytest.approx(6.0, abs=1e-3)
    assert parts["target_forward"] == pytest.approx(2.5) and parts["target_verification"] == pytest.approx(0.5)
    assert parts["target_service_outside_compute"] == pytest.approx(0.5) and parts["target_hop"] == pytest.approx(1.0)
    assert parts["draft_compute_waited"] == pytest.approx(0.2)  # half of 0.4 ms a round
    assert parts["orchestrator"] == pytest.approx(6.0 - 4.5 - 0.5)
    assert row["round_less_compute_ms"] == pytest.approx(6.0 - 3.2, abs=1e-3)
    assert row["tokens_per_round"] == 3.0


def test_figures_are_set_against_each_gpu_step():
    result = {"per_round": [{"mode": "k0", "transport": "shared", "round_less_compute_ms": 3.0}],
              "concurrency": [{"mode": "k0", "transport": "shared", "sessions": 32, "tokens_per_round": 1.0,
                               "cpu_ms_per_token": {"orchestrator": 0.25}}]}
    rows = overhead.against_gpu(result)
    assert [r["ms"] for r in rows] == [3.0, 8.0]  # 32 sessions x 0.25 ms: a target step's worth of orchestrator CPU
    eight_b = next(iter(overhead.GPU_STEPS))
    assert rows[0][eight_b] == pytest.approx(0.5) and rows[1][eight_b] == pytest.approx(8 / 6, rel=1e-2)


def test_the_collectors_share_is_taken_between_two_readings():
    inf = float("inf")
    bounds = (0.001, 0.01, 0.1, inf)

    def service(passes, seconds, counts):  # counts: cumulative per bound, generation 2 only
        return {"passes": passes, "seconds": seconds,
                "buckets": [{b: 0.0 for b in bounds}, {b: 0.0 for b in bounds}, dict(zip(bounds, counts))]}

    before = {"orchestrator": {"passes": [10, 1, 0], "seconds": [0.01, 0.001, 0.0], "longest_s": [0.0, 0.0, 0.0]},
              "target": service([0, 0, 2], [0.0, 0.0, 0.05], [0, 1, 2, 2])}
    after = {"orchestrator": {"passes": [30, 2, 0], "seconds": [0.03, 0.003, 0.0], "longest_s": [0.002, 0.0, 0.0]},
             "target": service([0, 0, 5], [0.0, 0.0, 0.35], [0, 1, 4, 5])}
    use = overhead.collector_use(before, after, tokens=1000)
    assert use["orchestrator"] == {"passes": [20, 1, 0], "ms_per_token": pytest.approx(0.022), "longest_ms": 2.0}
    assert use["target"]["passes"] == [0, 0, 3] and use["target"]["ms_per_token"] == pytest.approx(0.3)
    assert use["target"]["longest_under_ms"] is None  # one of the three passes fell past the last finite bound
    after["target"] = service([0, 0, 5], [0.0, 0.0, 0.1], [0, 1, 5, 5])
    assert overhead.collector_use(before, after, 1000)["target"]["longest_under_ms"] == 100.0
