"""`specsplit.ray_deploy.resources`: sizing the defaults to a local cluster and refusing what can never be scheduled.

Plain arithmetic on resource dicts; no Ray is started (the waiting part runs in tests/ray/test_placement.py).
"""

from __future__ import annotations

import pytest

from specsplit.ray_deploy.resources import Ask, Capacity, never_fits, refusal, replica_ask, require, size_cpus

pytestmark = pytest.mark.unit

LAPTOP = Capacity(({"CPU": 2.0, "memory": 8e9, "node:127.0.0.1": 1.0},), {"CPU": 2.0, "memory": 8e9})


def up_asks(target_cpus: float, draft_cpus: float, replica_cpus: float, replicas: int = 1) -> list[Ask]:
    return [Ask("target", {"CPU": target_cpus, "GPU": 0.0}, "--target-num-cpus, --target-num-gpus"),
            Ask("draft", {"CPU": draft_cpus, "GPU": 0.0}, "--draft-num-cpus, --draft-num-gpus"),
            replica_ask(replica_cpus, replicas)]


def test_defaults_share_a_small_local_cluster_and_stay_whole_elsewhere():
    up = {"target": (None, 1), "draft": (None, 1), "replica": (None, 1)}
    assert size_cpus(up, 2.0) == {"target": 0.66, "draft": 0.66, "replica": 0.66}
    assert size_cpus({**up, "replica": (None, 2)}, 2.0) == {"target": 0.5, "draft": 0.5, "replica": 0.5}
    assert size_cpus(up, 16.0) == {"target": 1.0, "draft": 1.0, "replica": 1.0}  # at most 1 each
    assert size_cpus(up, None) == {"target": 1.0, "draft": 1.0, "replica": 1.0}  # --ray-address: as asked
    # Explicit requests are kept; the defaults share what they leave.
    assert size_cpus({**up, "target": (1.5, 1)}, 2.0) == {"target": 1.5, "draft": 0.25, "replica": 0.25}
    assert size_cpus({**up, "target": (4.0, 1)}, 2.0)["target"] == 4.0
    sized = size_cpus(up, 2.0)
    assert not never_fits(up_asks(sized["target"], sized["draft"], sized["replica"]), LAPTOP)


def test_what_can_never_fit_is_named_with_the_numbers():
    assert never_fits(up_asks(1, 1, 1), LAPTOP) == "together they ask for CPU 3; the whole cluster has CPU 2"
    assert never_fits(up_asks(4, 0.5, 0.5), LAPTOP) == (
        "the target asks for CPU 4, more than any node of the cluster has")
    two_nodes = Capacity(({"CPU": 1.0}, {"CPU": 1.0, "GPU": 2.0, "target_node": 1.0}), {"CPU": 2.0})
    assert never_fits([Ask("target", {"CPU": 1.0, "GPU": 2.0, "target_node": 1.0}, "")], two_nodes) == ""
    assert "more than any node" in never_fits([Ask("target", {"CPU": 1.5}, "")], two_nodes)  # 2 CPUs, 1 per node
    assert "GPU 4" in never_fits([replica_ask(0, 2), Ask("w", {"GPU": 2.0}, "", count=2)], two_nodes)
    assert never_fits([Ask("draft", {"CPU": 0.0, "GPU": 0.0}, "")], LAPTOP) == ""  # asks for nothing


def test_refusal_lists_each_request_its_flags_and_the_clusters_total_and_free():
    cap = Capacity(LAPTOP.nodes, {"CPU": 0.5})
    asks = up_asks(4, 0.5, 0.5, replicas=2)
    message = refusal("cannot run it", asks, cap, local=True)
    lines = message.splitlines()
    assert lines[0] == "cannot run it"
    assert "target" in lines[1] and "CPU 4" in lines[1] and "(--target-num-cpus, --target-num-gpus)" in lines[1]
    assert "2 x orchestrator replica" in lines[3] and "--ray-num-replicas" in lines[3]
    assert "in all" in lines[4] and "CPU 5.5" in lines[4]
    assert "has CPU 2 in all over 1 node(s)" in message and "CPU 0.5 free now" in message
    assert "memory" not in message and "node:" not in message  # Ray's bookkeeping resources are left out
    assert "--ray-local-cpus" in message
    assert "add nodes" in refusal("x", asks, cap, local=False)


def test_require_refuses_at_once_and_only_warns_about_what_is_merely_taken(caplog):
    with pytest.raises(ValueError, match="cannot run what `specsplit up` asks for: together they ask for CPU 3"):
        require(up_asks(1, 1, 1), LAPTOP, True, "up")
    busy = Capacity(LAPTOP.nodes, {"CPU": 0.2})
    require(up_asks(0.5, 0.5, 0.5), busy, False, "up")  # fits the cluster, not what is free: wait, bounded
    assert "not all of this is free now" in caplog.text
